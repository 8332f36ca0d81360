"""Linear layers with the bias and ReLU inside oneDNN's matmul: the numbers and gradients of F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from seq2seq.model import linear as fused
from seq2seq.model.linear import linear


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, relu: bool) -> torch.Tensor:
    y = F.linear(x, w, b)
    return F.relu(y) if relu else y


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_output_and_gradients_equal_f_linear(relu: bool, with_bias: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 7, 16, requires_grad=True)
    w = torch.randn(24, 16, requires_grad=True)
    b = torch.randn(24, requires_grad=True) if with_bias else None
    grad = torch.randn(3, 7, 24)
    results = []
    for f in (linear, reference):
        for t in (x, w, b):
            if t is not None:
                t.grad = None
        y = f(x, w, b, relu)
        y.backward(grad)
        results.append((y.detach(), x.grad, w.grad, None if b is None else b.grad))
    assert fused.ONEDNN  # the fused path is what this test checks on an x86 CPU build
    for got, want in zip(*results):
        if want is None:
            assert got is None
        else:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    if relu:
        assert bool((results[0][0] == 0).any())  # the ReLU did cut something


def test_frozen_inputs_get_no_gradient() -> None:
    x, w, b = torch.randn(5, 8), torch.randn(4, 8, requires_grad=True), torch.randn(4)
    linear(x, w, b, relu=True).sum().backward()
    assert w.grad is not None and x.grad is None and b.grad is None


def test_bf16_autocast_takes_pytorchs_path() -> None:
    x, w, b = torch.randn(5, 8), torch.randn(4, 8), torch.randn(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = linear(x, w, b)
    assert y.dtype == torch.bfloat16
