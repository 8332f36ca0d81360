"""Which pairs and which batches make epoch e: a pure function of (data, seed, epoch).

Exact resume rests on this: the batches of an epoch depend only on the
corpus, the seed, the epoch and the rank, never on what ran before, so a
resumed run skips the batches already consumed and sees the rest unchanged.
With subword sampling (`data.sampling_alpha`) the training text is encoded
anew every epoch, with a segmentation drawn from (seed, epoch), the same on
every rank and after a resume.
"""

from __future__ import annotations

from collections.abc import Sequence

from seq2seq.config import DataConfig
from seq2seq.data import EncodedCorpus, encode_corpus, make_batches
from seq2seq.tokenizer import Sampling, Tokenizer


def epoch_seed(seed: int, epoch: int) -> int:
    return seed * 100_003 + epoch


class EpochSource:
    """The training corpus of each epoch and this rank's share of its batches."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        text: tuple[Sequence[str], Sequence[str]],  # (source lines, target lines)
        data: DataConfig,
        max_tokens: int,
        seed: int,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        self.tokenizer, self.text, self.data = tokenizer, text, data
        self.max_tokens, self.seed, self.rank, self.world = max_tokens, seed, rank, world
        self.name = f"{data.dir}/{data.train}"
        self._fixed = None if data.sampling_alpha else encode_corpus(tokenizer, *text, data.max_len, self.name)
        self._sampled: tuple[int, EncodedCorpus] | None = None  # (epoch, its encoding): the last one drawn

    def corpus(self, epoch: int) -> EncodedCorpus:
        """The encoded training pairs of `epoch`."""
        if self._fixed is not None:
            return self._fixed
        if self._sampled is None or self._sampled[0] != epoch:
            d = self.data
            sampling = Sampling(d.sampling_alpha, d.sampling_nbest, seed=epoch_seed(self.seed, epoch) % 2**32)
            self._sampled = (epoch, encode_corpus(self.tokenizer, *self.text, d.max_len, self.name, sampling))
        return self._sampled[1]

    def batches(self, epoch: int) -> list[list[int]]:
        """This rank's batches of `epoch` (indices into `corpus(epoch)`); every rank gets as many."""
        batches = make_batches(self.corpus(epoch).lengths(), self.max_tokens, seed=epoch_seed(self.seed, epoch))
        return batches[: len(batches) // self.world * self.world][self.rank :: self.world]
