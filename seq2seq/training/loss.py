"""Label-smoothed cross-entropy (Szegedy et al., 2016) with a hand-written gradient.

The loss is the largest elementwise job of a training step: it touches every
(token, vocabulary) pair. Autograd through log_softmax, gather and mean makes
about ten passes over that (N, V) array; the closed-form gradient
softmax(z) - q, where q is the smoothed target distribution, needs three.
"""

from __future__ import annotations

import torch
from torch import Tensor

from seq2seq.data import Batch
from seq2seq.tokenizer import PAD


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        """logits: (N, V) float; target: (N,). Returns per-token (smoothed loss, nll), each (N,)."""
        lse = torch.logsumexp(logits, dim=-1)  # (N,)
        nll = lse - logits.gather(1, target[:, None]).squeeze(1)
        smooth = lse - logits.mean(dim=-1)  # -mean_v log p_v
        ctx.save_for_backward(logits, target, lse)
        ctx.epsilon = epsilon
        ctx.mark_non_differentiable(nll)
        return (1.0 - epsilon) * nll + epsilon * smooth, nll

    @staticmethod
    def backward(ctx, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        logits, target, lse = ctx.saved_tensors
        eps = ctx.epsilon
        grad = torch.exp(logits - lse[:, None])  # softmax, (N, V)
        grad.sub_(eps / logits.shape[1])
        grad.scatter_add_(1, target[:, None], torch.full_like(lse[:, None], -(1.0 - eps)))
        return grad.mul_(grad_loss[:, None]), None, None


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed NLL over the given target tokens.

    logits: (N, V) for N real (non-padding) target positions; target: (N,).
    The smoothed target puts 1 - epsilon on the reference token and spreads
    epsilon uniformly over the vocabulary. Sums, not means, so the caller can
    normalise by the tokens of a whole (accumulated, distributed) update.
    """
    loss, nll = _SmoothedCrossEntropy.apply(logits.float(), target, epsilon)
    return loss.sum(), nll.sum().detach()


def batch_loss(model: torch.nn.Module, batch: Batch, epsilon: float) -> tuple[Tensor, Tensor]:
    """Teacher-forced summed (smoothed loss, nll) of a batch, scoring only real target tokens."""
    keep = batch.tgt_out != PAD  # (B, T)
    logits = model(batch.src, batch.src_pad_mask, batch.tgt_in, keep)  # (N, V)
    return label_smoothed_loss(logits, batch.tgt_out[keep], epsilon)
