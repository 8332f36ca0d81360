"""Which pairs and which batches make epoch e: a pure function of (data, seed, epoch, rank).

Exact resume rests on this: the batches of an epoch depend only on the
prepared corpus, the seed, the epoch and the rank, never on what ran before,
so a resumed run skips the batches already consumed and sees the rest
unchanged. Batching needs only the corpus's length indexes (the longer side,
the target and the source: 6 bytes a pair);
the token ids stay memory-mapped and are collated, in DataLoader worker
processes with `train.num_workers`, while the model trains. With subword
sampling (`data.sampling_alpha`), each batch's text is encoded anew with a
segmentation drawn from (seed, epoch, batch), the same on every rank, in
every worker and after a resume.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from seq2seq.config import DataConfig
from seq2seq.text.corpus import Batch, bounded_shape, bucket, collate_pairs, dropped_as
from seq2seq.text.prepare import PreparedCorpus, training_sets
from seq2seq.text.tokenizer import Sampling
from seq2seq.text.vocab import EOS


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 100_003 + epoch


@dataclass
class EpochBatches:
    """This rank's batches of one epoch: batch j is `order[bounds[ids[j]]:bounds[ids[j] + 1]]`."""

    order: np.ndarray  # pair indices, bucketed
    bounds: np.ndarray  # (batches + 1,) offsets into order
    ids: np.ndarray  # this rank's batch numbers, in training order

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, j: int) -> list[int]:
        b = int(self.ids[j])
        return self.order[self.bounds[b] : self.bounds[b + 1]].tolist()


class EpochSource:
    """The training pairs of each epoch and this rank's share of their batches."""

    def __init__(
        self,
        corpus: PreparedCorpus,
        data: DataConfig,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
        num_workers: int = 0,
        bounded_shapes: bool = False,
    ) -> None:
        self.corpus, self.data, self.tokenizer = corpus, data, corpus.tokenizer
        self.max_tokens, self.seed, self.rank, self.world = max_tokens, seed, rank, world
        self.num_workers = num_workers
        self.bounded_shapes = bounded_shapes  # pad each batch to `bounded_shape` (for a compiled model)
        self._last: tuple[int, EpochBatches] | None = None  # the last epoch bucketed

    def batches(self, epoch: int) -> EpochBatches:
        """This rank's batches of `epoch`; every rank gets as many."""
        if self._last is None or self._last[0] != epoch:
            seed = epoch_seed(self.seed, epoch)
            pairs = self.epoch_pairs(epoch)
            keys = (self.corpus.lengths, *self.corpus.side_lengths)  # longer side, then target, then source
            lengths, *ties = keys if pairs is None else (key[pairs] for key in keys)
            order, bounds = bucket(lengths, self.max_tokens, seed, ties=ties)
            if pairs is not None:
                order = pairs[order]
            ids = np.random.default_rng(seed + 1).permutation(len(bounds) - 1)
            ids = ids[: len(ids) // self.world * self.world][self.rank :: self.world]
            self._last = (epoch, EpochBatches(order, bounds, ids))
        return self._last[1]

    def epoch_pairs(self, epoch: int) -> np.ndarray | None:
        """The pairs of `epoch` when training sets are upsampled (None: each pair once).

        A set of weight w contributes floor(w) copies of each pair and a sample, drawn
        anew each epoch, of the fraction w - floor(w) of its pairs.
        """
        weights = [w for _, _, _, w in training_sets(self.data)]  # each pair's sets, as prepared
        if all(w == 1 for w in weights):
            return None
        rng = np.random.default_rng(epoch_seed(self.seed, epoch) + 2)
        parts = []
        for (first, end), w in zip(self.corpus.set_ranges, weights):
            whole = np.arange(first, end)
            parts += [whole] * int(w)
            parts.append(np.sort(rng.choice(whole, size=round((w - int(w)) * len(whole)), replace=False)))
        return np.concatenate(parts)

    def batch(self, epoch: int, j: int) -> Batch:
        """The collated batch j of this rank in `epoch`."""
        batches = self.batches(epoch)
        indices = batches[j]
        pairs = [self.corpus.ids(i) for i in indices]
        if self.data.sampling_alpha:  # seeded by the batch's number in the epoch, whichever rank or worker runs it
            pairs = self._sampled(pairs, indices, epoch_seed(self.seed, epoch) * 1_000_003 + int(batches.ids[j]))
        batch = collate_pairs([s for s, _ in pairs], [t for _, t in pairs])
        if self.bounded_shapes:
            batch = batch.padded(*bounded_shape(len(pairs), batch.src.shape[1], batch.tgt_in.shape[1]))
        return batch

    def _sampled(
        self, best: list[tuple[list[int], list[int]]], indices: list[int], seed: int
    ) -> list[tuple[list[int], list[int]]]:
        """A sampled segmentation of the batch's text; a pair it makes empty or over-long keeps its best one."""
        d = self.data
        sampling = Sampling(d.sampling_alpha, d.sampling_nbest, seed % 2**32)
        text = [self.corpus.text(i) for i in indices]
        src = self.tokenizer.encode_src([s for s, _ in text], sampling)
        tgt = self.tokenizer.encode_tgt([t for _, t in text], sampling)
        return [
            (s + [EOS], t + [EOS]) if not dropped_as(s, t, d.max_len) else pair for s, t, pair in zip(src, tgt, best)
        ]

    def loader(self, epoch: int, start: int, pin_memory: bool = False) -> Generator[Batch, None, None]:
        """The collated batches of `epoch` from batch `start` on, in order; workers collate ahead.

        `pin_memory` (for CUDA) puts each batch in page-locked memory, which the copy to the GPU
        then reads without waiting for the host."""
        dataset = _EpochDataset(self, epoch)
        loader = torch.utils.data.DataLoader(
            dataset,
            batch_size=None,
            sampler=range(start, len(self.batches(epoch))),
            num_workers=self.num_workers,
            collate_fn=_identity,
            pin_memory=pin_memory,
        )
        yield from loader


class _EpochDataset(torch.utils.data.Dataset[Batch]):
    def __init__(self, source: EpochSource, epoch: int) -> None:
        self.source, self.epoch = source, epoch

    def __getitem__(self, j: int) -> Batch:
        return self.source.batch(self.epoch, j)


def _identity(batch: Any) -> Any:  # with batch_size=None the loader hands over one collated Batch
    return batch
