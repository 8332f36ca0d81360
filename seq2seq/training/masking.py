"""BERT's masking recipe (Devlin et al., 2019), and the validation of a masked language model.

Of each sentence's ordinary tokens (not padding, not the special ids <pad> <unk> <s> </s>, not a language
tag), round(`pretrain.mask_prob` x their number) are selected, at least one, uniformly without replacement, as
BERT's data generator does (a count per sentence, not a coin per token). Of the selected tokens,
`pretrain.mask_token` become the mask token, `pretrain.random_token` a uniformly random ordinary token, and the
rest stay unchanged; each selected position is predicted, the others are not scored.

A masked batch is an ordinary `Batch` whose `tgt_out` holds the original token at the selected positions and
<pad> elsewhere, so the training loop's loss (`batch_loss`: the positions whose target is not padding) scores
exactly the selected ones and `n_tokens` counts them. Masks are drawn from a generator seeded by (seed, epoch,
batch number): a resumed run masks each batch as an uninterrupted one did.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from seq2seq.config import PretrainConfig
from seq2seq.device import autocast
from seq2seq.model import Kernels, kernel_scope, training_kernel
from seq2seq.model.masked_lm import MaskedLM, mask_id
from seq2seq.text.corpus import Batch, EncodedCorpus, collate, make_batches
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.text.vocab import BOS, EOS, PAD


@dataclass(frozen=True)
class Masking:
    """Which tokens may be selected, how many are, and what replaces them."""

    vocab_size: int  # V: the mask token is V, random replacements are in [first_ordinary, V)
    first_ordinary: int  # the ids below are special (and language tags): never selected
    prob: float = 0.15
    mask: float = 0.8
    random: float = 0.1

    @classmethod
    def of(cls, p: PretrainConfig, tokenizer: Tokenizer) -> Masking:
        first = EOS + 1 + len(tokenizer.target_langs)  # the tags come right after the special ids
        return cls(tokenizer.src_vocab_size, first, p.mask_prob, p.mask_token, p.random_token)


def mask_tokens(src: Tensor, masking: Masking, generator: torch.Generator) -> tuple[Tensor, Tensor]:
    """Masked inputs (B, S) and targets (B, S): the original token where selected, PAD elsewhere."""
    eligible = (src >= masking.first_ordinary) & (src < masking.vocab_size)  # (B, S)
    counts = eligible.sum(dim=1)  # (B,)
    wanted = torch.minimum((counts * masking.prob).round().clamp(min=1), counts)  # (B,): 0 only without any
    scores = torch.rand(src.shape, generator=generator).masked_fill(~eligible, 2.0)  # ineligible last
    ranks = scores.argsort(dim=1).argsort(dim=1)  # (B, S): each position's place in a random order
    selected = ranks < wanted[:, None]
    draw = torch.rand(src.shape, generator=generator)
    to_mask = selected & (draw < masking.mask)
    to_random = selected & (draw >= masking.mask) & (draw < masking.mask + masking.random)
    randoms = torch.randint(masking.first_ordinary, masking.vocab_size, src.shape, generator=generator)
    inputs = torch.where(to_mask, mask_id(masking.vocab_size), torch.where(to_random, randoms, src))
    return inputs, torch.where(selected, src, PAD)


def masked_batch(batch: Batch, masking: Masking, seed: int) -> Batch:
    """The batch's sources masked (seeded by `seed`), as a batch whose targets are the selected tokens."""
    generator = torch.Generator().manual_seed(seed)
    inputs, targets = mask_tokens(batch.src, masking, generator)
    tgt_in = torch.full((batch.src.shape[0], 1), BOS, dtype=torch.long)  # no decoder: not read
    return Batch(inputs, batch.src_pad_mask, tgt_in, targets, int((targets != PAD).sum()))


class MaskedValidator:
    """Loss, perplexity and accuracy of the masked tokens of the validation sources, masked the same way at
    every validation (the same seed per batch), so that validations compare."""

    examples = ""  # no translations to show

    def __init__(
        self,
        model: MaskedLM,
        corpus: EncodedCorpus,
        masking: Masking,
        max_tokens: int,
        precision: str,
        device: torch.device,
        seed: int,
    ) -> None:
        self.model, self.corpus, self.masking = model, corpus, masking
        self.max_tokens, self.precision, self.device, self.seed = max_tokens, precision, device, seed

    @torch.no_grad()
    def __call__(self) -> dict[str, float]:
        was_training = self.model.training
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # nll, correct
        tokens = 0
        kernel = training_kernel(self.device, self.precision)
        try:
            for k, indices in enumerate(make_batches(self.corpus.lengths(), self.max_tokens)):
                batch = masked_batch(collate(self.corpus, indices), self.masking, self.seed + k).to(self.device)
                sums += self.batch_sums(batch, kernel)
                tokens += batch.n_tokens
        finally:
            self.model.train(was_training)
        nll, correct = (s / max(tokens, 1) for s in sums.tolist())
        return {"loss": nll, "ppl": math.exp(min(nll, 50)), "accuracy": correct}

    def batch_sums(self, batch: Batch, kernel: Kernels) -> Tensor:
        """(summed NLL, correct predictions) of the batch's selected tokens, float64 on the device."""
        keep = batch.tgt_out != PAD  # (B, S)
        target = batch.tgt_out[keep]  # (N,)
        with autocast(self.precision, self.device), kernel_scope(kernel):
            logits = self.model(batch.src, batch.src_pad_mask, None, keep).float()  # (N, V)
        nll = torch.nn.functional.cross_entropy(logits, target, reduction="sum")
        correct = (logits.argmax(dim=-1) == target).sum()
        return torch.stack([nll.double(), correct.double()])


def encode_sources(tokenizer: Tokenizer, lines: Sequence[str], max_len: int) -> EncodedCorpus:
    """EOS-terminated source ids of the non-empty lines of at most `max_len` pieces, each with a stand-in
    target (the corpus type needs one)."""
    ids = [s + [EOS] for s in tokenizer.encode_src(lines) if 0 < len(s) <= max_len]
    return EncodedCorpus(ids, [[EOS]] * len(ids))
