"""Label-smoothed cross-entropy (Szegedy et al., 2016) that ignores padding."""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.tokenizer import PAD


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed NLL over non-padding target tokens.

    logits: (B, T, V); target: (B, T). The smoothed target puts 1 - epsilon on
    the reference token and spreads epsilon uniformly over the vocabulary.
    Sums, not means, so the caller can normalise by the tokens of a whole
    (accumulated, distributed) update.
    """
    keep = target != PAD  # (B, T)
    lprobs = torch.log_softmax(logits[keep].float(), dim=-1)  # (N, V)
    nll = -lprobs.gather(1, target[keep][:, None]).squeeze(1)  # (N,)
    smooth = -lprobs.mean(dim=-1)  # (N,)
    loss = (1.0 - epsilon) * nll + epsilon * smooth
    return loss.sum(), nll.sum()
