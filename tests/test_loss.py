"""The training loss: the hand-written label-smoothed cross-entropy and R-Drop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import model_config

from seq2seq.data import Batch, pad
from seq2seq.model import build_model
from seq2seq.training.loss import batch_loss, label_smoothed_loss, symmetric_kl
from seq2seq.vocab import BOS, EOS, PAD

VOCAB = 24


@pytest.mark.parametrize("epsilon", [0.0, 0.1, 0.3])
def test_smoothed_loss_and_its_gradient_match_torch_cross_entropy(epsilon: float) -> None:
    torch.manual_seed(0)
    logits = torch.randn(12, VOCAB, requires_grad=True)
    target = torch.randint(VOCAB, (12,))
    loss, nll = label_smoothed_loss(logits, target, epsilon)
    loss.backward()
    ours = logits.grad.clone()
    logits.grad = None
    reference = F.cross_entropy(logits, target, label_smoothing=epsilon, reduction="sum")
    reference.backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, F.cross_entropy(logits, target, reduction="sum").detach())
    torch.testing.assert_close(ours, logits.grad)


@pytest.mark.parametrize("vocab", [VOCAB, 50_000])  # one block of rows; several
def test_symmetric_kl_and_its_gradient_are_both_kl_directions(vocab: int) -> None:
    torch.manual_seed(0)
    p, q = (torch.randn(7, vocab, requires_grad=True) for _ in range(2))
    ours = symmetric_kl(p, q)
    (3 * ours).backward()  # a scaled upstream gradient
    grads = p.grad.clone(), q.grad.clone()
    p.grad = q.grad = None
    logp, logq = p.log_softmax(-1), q.log_softmax(-1)
    both = F.kl_div(logq, logp, log_target=True, reduction="sum") + F.kl_div(
        logp, logq, log_target=True, reduction="sum"
    )
    (3 * both).backward()
    torch.testing.assert_close(ours, both)
    torch.testing.assert_close(grads[0], p.grad)
    torch.testing.assert_close(grads[1], q.grad)
    assert float(symmetric_kl(p, p).detach()) == pytest.approx(0.0, abs=1e-4)


def _batch() -> Batch:
    torch.manual_seed(1)
    tgt = [torch.randint(4, VOCAB, (n,)).tolist() + [EOS] for n in (5, 3, 7)]
    src = pad([torch.randint(4, VOCAB, (n,)).tolist() + [EOS] for n in (6, 4, 2)])
    tgt_out = pad(tgt)
    return Batch(src, src == PAD, pad([[BOS] + t[:-1] for t in tgt]), tgt_out, int((tgt_out != PAD).sum()))


def _model(dropout: float) -> torch.nn.Module:
    cfg = model_config(d_model=32, n_heads=4, d_ff=64, encoder_layers=2, decoder_layers=2, dropout=dropout)
    return build_model(cfg, VOCAB, VOCAB)


def test_rdrop_without_dropout_is_the_plain_loss() -> None:
    model, batch = _model(dropout=0.0).train(), _batch()
    plain, plain_nll = batch_loss(model, batch, 0.1)
    rdrop, rdrop_nll = batch_loss(model, batch, 0.1, rdrop_alpha=5.0)  # two identical passes: no KL
    torch.testing.assert_close(rdrop, plain)
    torch.testing.assert_close(rdrop_nll, plain_nll)


def test_rdrop_adds_the_disagreement_of_two_dropout_passes_in_training_only() -> None:
    model, batch = _model(dropout=0.3), _batch()
    model.eval()
    assert torch.equal(batch_loss(model, batch, 0.1, rdrop_alpha=5.0)[0], batch_loss(model, batch, 0.1)[0])
    model.train()
    torch.manual_seed(2)
    weak, _ = batch_loss(model, batch, 0.1, rdrop_alpha=1.0)
    torch.manual_seed(2)  # the same two dropout masks
    strong, nll = batch_loss(model, batch, 0.1, rdrop_alpha=5.0)
    assert float((strong - weak).detach()) > 0  # (5 - 1) / 4 times the symmetric KL of the two passes
    # the cross-entropy part is the mean of the two passes: on the scale of one pass
    assert 0.5 < float(nll) / batch.n_tokens / float(torch.log(torch.tensor(VOCAB))) < 1.5
    strong.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
