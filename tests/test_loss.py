"""The training loss: the hand-written label-smoothed cross-entropy and R-Drop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import model_config

from seq2seq.config import RNNConfig
from seq2seq.model import build_model
from seq2seq.text.corpus import Batch, pad
from seq2seq.text.vocab import BOS, EOS, PAD
from seq2seq.training.loss import batch_loss, label_smoothed_loss, symmetric_kl

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


# The Transformer, and the RNN whose decoder reads the context vector at every step
ARCHITECTURES = {
    "transformer": {"n_heads": 4, "d_ff": 64, "encoder_layers": 2, "decoder_layers": 2},
    "rnn-gru-context": {"arch": "rnn", "rnn": RNNConfig("gru", 2, 16, True, "none", context_every_step=True)},
    "decoder_only": {"arch": "decoder_only", "n_heads": 4, "d_ff": 64, "encoder_layers": 1, "decoder_layers": 1},
}


def _model(dropout: float, arch: str = "transformer") -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(model_config(d_model=32, dropout=dropout, **ARCHITECTURES[arch]), VOCAB, VOCAB)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_without_rdrop_the_loss_is_torchs_smoothed_cross_entropy_over_real_target_tokens(arch: str) -> None:
    model, batch = _model(dropout=0.3, arch=arch).train(), _batch()
    torch.manual_seed(3)
    loss, nll = batch_loss(model, batch, 0.1, rdrop_alpha=0.0)
    torch.manual_seed(3)  # the same dropout masks
    logits = model(batch.src, batch.src_pad_mask, batch.tgt_in)  # (B, T, V), padding included
    flat, target = logits.flatten(0, 1), batch.tgt_out.flatten()
    reference = F.cross_entropy(flat, target, ignore_index=PAD, label_smoothing=0.1, reduction="sum")
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(nll, F.cross_entropy(flat, target, ignore_index=PAD, reduction="sum").detach())


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rdrop_without_dropout_is_the_plain_loss(arch: str) -> None:
    model, batch = _model(dropout=0.0, arch=arch).train(), _batch()
    plain, plain_nll = batch_loss(model, batch, 0.1)
    rdrop, rdrop_nll = batch_loss(model, batch, 0.1, rdrop_alpha=5.0)  # two identical passes: no KL
    torch.testing.assert_close(rdrop, plain)
    torch.testing.assert_close(rdrop_nll, plain_nll)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rdrop_adds_the_disagreement_of_two_dropout_passes_in_training_only(arch: str) -> None:
    model, batch = _model(dropout=0.3, arch=arch), _batch()
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


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_rdrop_under_bf16_autocast_stays_close_to_fp32_and_backpropagates(arch: str) -> None:
    """precision=auto picks bf16 on CPUs with native bf16: both terms are then computed from fp32 logits."""
    model, batch = _model(dropout=0.3, arch=arch).train(), _batch()
    torch.manual_seed(4)
    reference, _ = batch_loss(model, batch, 0.1, rdrop_alpha=5.0)
    torch.manual_seed(4)  # the same two dropout masks
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, nll = batch_loss(model, batch, 0.1, rdrop_alpha=5.0)
    assert loss.dtype == nll.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=0.02, atol=0.0)
    loss.backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters() if p.requires_grad)
