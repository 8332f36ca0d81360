"""Label-smoothed cross-entropy (Szegedy et al., 2016) with a hand-written gradient.

The loss is the largest elementwise job of a training step: it touches every
(token, vocabulary) pair. Autograd through log_softmax, gather and mean makes
about ten passes over that (N, V) array. Here the forward pass computes the
gradient softmax(z) - q, where q is the smoothed target distribution, from
the log-probabilities it has anyway (an exp in place and a scatter), and
backward subtracts the smoothing and scales in one pass: about a third less
time than before.
(Blocks of rows that stay in cache were tried too: on a busy 2-core machine
the many small parallel operations cost more than the memory traffic saved.)
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from seq2seq.text.corpus import Batch
from seq2seq.text.vocab import PAD


class _SmoothedCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        """logits: (N, V); target: (N,). Returns per-token (smoothed loss, nll), each (N,) float32."""
        log_p = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
        nll = log_p.gather(1, target[:, None]).squeeze(1).neg_()
        loss = (1.0 - epsilon) * nll - epsilon * log_p.mean(dim=-1)
        grad = None
        if ctx.needs_input_grad[0]:
            # softmax minus the target's share, in the logits' dtype, in log_p's memory when it can
            grad = torch.exp(log_p, out=log_p if logits.dtype == torch.float32 else torch.empty_like(logits))
            grad.scatter_add_(1, target[:, None], grad.new_full((target.shape[0], 1), -(1.0 - epsilon)))
        ctx.save_for_backward(grad)
        ctx.uniform = epsilon / logits.shape[1]  # the smoothing's share of every token
        ctx.mark_non_differentiable(nll)
        return loss, nll

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor, grad_nll: Tensor) -> tuple[Tensor, None, None]:
        """(softmax - q) * grad_loss in one pass, in place: the saved gradient is used once."""
        (grad,) = ctx.saved_tensors
        scale = grad_loss[:, None].to(grad.dtype)
        return torch.addcmul(scale * -ctx.uniform, grad, scale, out=grad), None, None


def label_smoothed_loss(logits: Tensor, target: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
    """Summed smoothed loss and summed NLL over the given target tokens.

    logits: (N, V) for N real (non-padding) target positions; target: (N,).
    The smoothed target puts 1 - epsilon on the reference token and spreads
    epsilon uniformly over the vocabulary. Sums, not means, so the caller can
    normalise by the tokens of a whole (accumulated, distributed) update.
    """
    loss, nll = _SmoothedCrossEntropy.apply(logits, target, epsilon)
    return loss.sum(), nll.sum().detach()


class _SymmetricKL(torch.autograd.Function):
    """KL(p||q) + KL(q||p) with its closed-form gradient, computed a block of rows at a time.

    Through autograd this is about twenty passes over two (N, V) arrays in
    memory; here, on a CPU, a block's intermediates stay in cache (a GPU takes
    all rows at once).
    With d = log p - log q, the gradients are p (d - KL(p||q) + 1) - q with
    respect to p's logits and q (1 - KL(q||p) - d) - p with respect to q's.
    """

    @staticmethod
    def forward(ctx: Any, zp: Tensor, zq: Tensor) -> Tensor:
        grad_p, grad_q = torch.empty_like(zp), torch.empty_like(zq)
        total = zp.new_zeros((), dtype=torch.float64)
        block = zp.shape[0] if zp.is_cuda else max(1, 2**17 // zp.shape[1])  # CPU: rows of about 512 KB
        for start in range(0, zp.shape[0], block):
            rows = slice(start, start + block)
            d, logq = torch.log_softmax(zp[rows], -1), torch.log_softmax(zq[rows], -1)
            p, q = d.exp(), logq.exp()
            d.sub_(logq)
            kl_pq = (p * d).sum(-1, keepdim=True)  # (rows, 1)
            kl_qp = (q * d).sum(-1, keepdim=True).neg_()
            total += kl_pq.sum().double() + kl_qp.sum().double()
            torch.mul(p, d - kl_pq + 1, out=grad_p[rows]).sub_(q)
            torch.mul(q, (1 - kl_qp) - d, out=grad_q[rows]).sub_(p)
        ctx.save_for_backward(grad_p, grad_q)
        return total.float()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor]:
        grad_p, grad_q = ctx.saved_tensors
        return grad_p.mul_(grad), grad_q.mul_(grad)


def symmetric_kl(logits_p: Tensor, logits_q: Tensor) -> Tensor:
    """KL(p||q) + KL(q||p), summed over positions; logits: (N, V) each."""
    return _SymmetricKL.apply(logits_p.float().contiguous(), logits_q.float().contiguous())


def batch_loss(
    model: torch.nn.Module, batch: Batch, epsilon: float, rdrop_alpha: float = 0.0, source_loss: float = 0.0
) -> tuple[Tensor, Tensor]:
    """Teacher-forced summed (smoothed loss, nll) of a batch, scoring only real target tokens.

    With `source_loss` > 0 (a decoder-only model, `model.decoder_only.source_loss`), the loss adds that weight
    times the loss of predicting each source token from those before it (`source_part_loss`); the nll stays
    the target's.

    With `rdrop_alpha` > 0 in training, R-Drop (Liang et al., 2021): the batch
    goes through the model twice in one call, under two dropout masks, and
    alpha times the symmetric KL between the two predictions, halved, is added.
    Everything is halved against the paper, which keeps the loss on the scale
    of one pass (Adam does not see the factor).
    """
    keep = batch.tgt_out != PAD  # (B, T)
    target = batch.tgt_out[keep]  # (N,)
    if source_loss > 0 and model.training:
        return source_part_loss(model, batch, keep, epsilon, source_loss)
    if rdrop_alpha <= 0 or not model.training:
        logits = model(batch.src, batch.src_pad_mask, batch.tgt_in, keep)  # (N, V)
        return label_smoothed_loss(logits, target, epsilon)
    twice = [torch.cat([t, t]) for t in (batch.src, batch.src_pad_mask, batch.tgt_in, keep)]
    logits = model(*twice).float()  # (2N, V): the first copy's positions, then the second's; fp32 once for both terms
    loss, nll = label_smoothed_loss(logits, torch.cat([target, target]), epsilon)
    return loss / 2 + rdrop_alpha / 4 * symmetric_kl(*logits.chunk(2)), nll / 2


def source_part_loss(
    model: torch.nn.Module, batch: Batch, keep: Tensor, epsilon: float, weight: float
) -> tuple[Tensor, Tensor]:
    """The target's (smoothed loss, nll) plus `weight` times the source part's smoothed loss, from one pass
    of a decoder-only model (seq2seq.model.decoder_only): its logits of the N target tokens, then those of
    the M source tokens after each row's first."""
    target = batch.tgt_out[keep]  # (N,)
    source = batch.src[:, 1:][~batch.src_pad_mask[:, 1:]]  # (M,): `source_targets`, in the model's order
    logits = model(batch.src, batch.src_pad_mask, batch.tgt_in, keep, True)  # (N + M, V)
    loss, nll = label_smoothed_loss(logits[: target.shape[0]], target, epsilon)
    source_part, _ = label_smoothed_loss(logits[target.shape[0] :], source, epsilon)
    return loss + weight * source_part, nll
