"""Dropout masks drawn 15 bits per element, and dropout fused with the residual connection."""

from __future__ import annotations

import pytest
import torch

from seq2seq.model.dropout import Dropout, add_dropout, dropout, keep_mask

CPU = torch.device("cpu")


@pytest.mark.parametrize("p", [0.1, 0.3, 0.5])
def test_every_element_is_dropped_with_probability_p_and_the_rest_scaled(p: float) -> None:
    torch.manual_seed(0)
    mask = keep_mask(torch.Size([1000, 1000]), p, torch.float32, CPU)
    dropped = mask == 0
    kept = mask[~dropped]
    assert torch.all(kept == kept[0]) and float(kept[0]) == pytest.approx(1 / (1 - p), rel=1e-4)
    # a generator draw masks two neighbours (16 and 15 random bits): both positions follow p
    for parity in (0, 1):
        rate = float(dropped.view(-1)[parity::2].float().mean())
        assert rate == pytest.approx(p, abs=0.003)
    assert float(mask.mean()) == pytest.approx(1.0, abs=0.004)  # the expectation of every element is kept


def test_neighbouring_decisions_are_independent() -> None:
    torch.manual_seed(0)
    dropped = (keep_mask(torch.Size([2_000_000]), 0.5, torch.float32, CPU) == 0).view(-1, 2)
    both = float((dropped[:, 0] & dropped[:, 1]).float().mean())
    assert both == pytest.approx(0.25, abs=0.003)


def test_masks_follow_the_seed_and_fit_odd_sizes() -> None:
    shape = torch.Size([3, 5, 7])
    torch.manual_seed(1)
    a = keep_mask(shape, 0.2, torch.float32, CPU)
    torch.manual_seed(1)
    b = keep_mask(shape, 0.2, torch.float32, CPU)
    torch.manual_seed(2)
    c = keep_mask(shape, 0.2, torch.float32, CPU)
    assert a.shape == shape and torch.equal(a, b) and not torch.equal(a, c)


def test_mask_keeps_the_requested_dtype() -> None:
    mask = keep_mask(torch.Size([64]), 0.1, torch.bfloat16, CPU)
    assert mask.dtype == torch.bfloat16
    assert dropout(torch.ones(64, dtype=torch.bfloat16), 0.1, True).dtype == torch.bfloat16


def test_add_dropout_is_the_residual_plus_masked_branch_and_its_gradient() -> None:
    torch.manual_seed(3)
    x = torch.randn(50, 40, requires_grad=True)
    y = torch.randn(50, 40, requires_grad=True)
    torch.manual_seed(4)
    out = add_dropout(x, y, 0.25, training=True)
    torch.manual_seed(4)
    mask = keep_mask(y.shape, 0.25, torch.float32, CPU)
    torch.testing.assert_close(out, x + y * mask)
    out.sum().backward()
    assert x.grad is not None and y.grad is not None
    torch.testing.assert_close(x.grad, torch.ones_like(x))
    torch.testing.assert_close(y.grad, mask)
    assert 0 < int((mask == 0).sum()) < mask.numel()


def test_no_dropout_outside_training_or_at_zero() -> None:
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    assert torch.equal(add_dropout(x, y, 0.3, training=False), x + y)
    assert torch.equal(add_dropout(x, y, 0.0, training=True), x + y)
    module = Dropout(0.3).eval()
    assert torch.equal(module(x), x)
    assert not module.state_dict()
