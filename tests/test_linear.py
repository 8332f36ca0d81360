"""Float32 linears through oneDNN (seq2seq.model.linear): the numbers and gradients of F.linear."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from seq2seq.model import linear as linear_module
from seq2seq.model.linear import linear, onednn_pays, uses_onednn

pytestmark = pytest.mark.skipif(
    not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")),
    reason="this PyTorch has no oneDNN linear",
)
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


@pytest.fixture
def onednn(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(linear_module, "USE_ONEDNN", True)
    yield


def grads(x: Tensor, weight: Tensor, bias: Tensor | None, relu: bool, fused: bool) -> list[Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in (x, weight) + ((bias,) if bias is not None else ())]
    b = leaves[2] if bias is not None else None
    if fused:
        y = linear(leaves[0], leaves[1], b, relu)
    else:
        y = F.linear(leaves[0], leaves[1], b)
        y = F.relu(y) if relu else y
    (y * torch.linspace(-1, 1, y.numel()).view(y.shape)).sum().backward()
    return [y.detach(), *(t.grad for t in leaves)]


@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("d_in", "d_out"), [(16, 48), (48, 16), (8, 80)])  # 8 -> 80: a wide weight (MKL's grad)
def test_onednn_linear_equals_f_linear_with_its_gradients(
    onednn: None, relu: bool, bias: bool, d_in: int, d_out: int
) -> None:
    g = torch.Generator().manual_seed(d_in * d_out)
    x = torch.randn(3, 7, d_in, generator=g)  # three dimensions: the rows are flattened and restored
    weight = torch.randn(d_out, d_in, generator=g) / d_in**0.5
    b = torch.randn(d_out, generator=g) if bias else None
    assert uses_onednn(x)
    for got, expected in zip(grads(x, weight, b, relu, True), grads(x, weight, b, relu, False), strict=True):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_a_transposed_input_and_a_weight_slice(onednn: None) -> None:
    """What the model hands it: a non-contiguous input, a weight that is rows of a larger parameter."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(24, 5, generator=g).t()  # (5, 24), not contiguous
    stacked = torch.randn(36, 24, generator=g)
    for got, expected in zip(
        grads(x, stacked[12:], None, False, True), grads(x, stacked[12:], None, False, False), strict=True
    ):
        torch.testing.assert_close(got, expected, **CLOSE)


def test_bf16_autocast_and_other_dtypes_keep_f_linear(onednn: None) -> None:
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not uses_onednn(x)
        assert linear(x, torch.randn(3, 8), None).dtype == torch.bfloat16
    assert not uses_onednn(x.double())


def test_a_process_capped_below_avx512_keeps_mkl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    onednn_pays.cache_clear()
    try:
        assert not onednn_pays()
    finally:
        onednn_pays.cache_clear()


def test_a_transformer_trains_the_same_through_either_path(monkeypatch: pytest.MonkeyPatch) -> None:
    from seq2seq.config import ModelConfig, TransformerConfig
    from seq2seq.model import build_model

    cfg = ModelConfig(
        d_model=16, dropout=0.0, transformer=TransformerConfig(n_heads=2, d_ff=32, encoder_layers=2, decoder_layers=2)
    )
    g = torch.Generator().manual_seed(1)
    src = torch.randint(4, 30, (3, 6), generator=g)
    tgt = torch.randint(4, 30, (3, 5), generator=g)
    results = []
    for use in (True, False):
        monkeypatch.setattr(linear_module, "USE_ONEDNN", use)
        torch.manual_seed(0)
        model = build_model(cfg, 30, 30)
        logits = model(src, src == 0, tgt)
        logits.logsumexp(-1).sum().backward()
        results.append([logits.detach(), *(p.grad for p in model.parameters())])
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
