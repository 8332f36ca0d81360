"""bf16 autocast on CPU runs linear layers on a bounded set of row counts, with the same results."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import model_config
from torch.overrides import TorchFunctionMode

from seq2seq.device import autocast, resolve_precision, row_bucket
from seq2seq.model import build_model
from seq2seq.text.corpus import Batch
from seq2seq.training.loss import batch_loss

CPU = torch.device("cpu")


def test_row_buckets_are_few_and_above_128_rows_add_at_most_an_eighth() -> None:
    sizes = {row_bucket(rows) for rows in range(1, 4097)}
    assert len(sizes) <= 48  # 16..128 in steps of 16, then 8 sizes per octave
    for rows in range(1, 4097):
        bucket = row_bucket(rows)
        assert bucket >= rows
        assert bucket % 16 == 0 and (rows <= 128 or bucket <= rows * 1.125)


class _Rows(TorchFunctionMode):
    """Records the row count of every F.linear call made inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.linear:
            self.rows.add(args[0].numel() // args[0].shape[-1])
        return func(*args, **(kwargs or {}))


def test_bf16_autocast_gives_the_same_outputs_and_gradients_on_bucketed_rows() -> None:
    torch.manual_seed(0)
    linear = torch.nn.Linear(32, 48)
    x = torch.randn(3, 37, 32, requires_grad=True)
    results = []
    for context in (lambda: torch.autocast("cpu", dtype=torch.bfloat16), lambda: autocast("bf16", CPU)):
        linear.zero_grad()
        x.grad = None
        seen = _Rows()
        with seen, context():
            y = linear(x)
        assert y.shape == (3, 37, 48) and y.dtype == torch.bfloat16
        (y.float() ** 2).sum().backward()
        results.append((y.detach(), x.grad.clone(), linear.weight.grad.clone(), seen.rows))
    (y0, dx0, dw0, rows0), (y1, dx1, dw1, rows1) = results
    assert rows0 == {111} and rows1 == {112}  # 3 x 37 rows, run as 112
    assert torch.equal(y0, y1)  # rows are independent: padding changes no real row
    torch.testing.assert_close(dx1, dx0)
    torch.testing.assert_close(dw1, dw0)


def test_a_training_loss_in_bf16_sees_only_bucketed_row_counts() -> None:
    torch.manual_seed(0)
    cfg = model_config(d_model=32, n_heads=4, d_ff=64, encoder_layers=1, decoder_layers=1, dropout=0.0)
    model = build_model(cfg, 40, 40)
    src = torch.randint(4, 40, (5, 11))
    tgt_in, tgt_out = torch.randint(4, 40, (5, 7)), torch.randint(4, 40, (5, 7))
    tgt_out[0, 4:] = 0  # padding: the output layer projects the 32 real target tokens only
    batch = Batch(src, src == 0, tgt_in, tgt_out, int((tgt_out != 0).sum()))
    seen = _Rows()
    with seen, autocast("bf16", CPU):
        loss, _ = batch_loss(model, batch, 0.1)
    assert seen.rows == {64, 48, 32}  # 5 x 11 source rows, 5 x 7 target rows, 32 real tokens: all bucketed
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_fp32_autocast_is_a_no_op() -> None:
    seen = _Rows()
    with seen, autocast("fp32", CPU):
        y = torch.nn.Linear(8, 8)(torch.randn(3, 8))
    assert y.dtype == torch.float32 and seen.rows == {3}


@pytest.mark.parametrize(
    "limit", [{"ATEN_CPU_CAPABILITY": "avx2"}, {"ATEN_CPU_CAPABILITY": "default"}, {"ONEDNN_MAX_CPU_ISA": "AVX2"}]
)
def test_a_process_limited_below_native_bf16_trains_in_fp32_on_auto(limit: dict[str, str]) -> None:
    """Run as an AVX2-only CPU would (scripts/cpu_kinds.sh), `precision: auto` is that CPU's fp32, not emulated bf16."""
    code = "import torch; from seq2seq.device import resolve_precision as r; print(r('auto', torch.device('cpu')))"
    done = subprocess.run([sys.executable, "-c", code], env={**os.environ, **limit}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "fp32"


@pytest.mark.parametrize(
    ("width", "bf16", "expected"), [(256, True, "fp32"), (512, True, "bf16"), (1024, False, "fp16")]
)
def test_auto_on_cuda_is_half_precision_only_for_models_wide_enough(
    monkeypatch: pytest.MonkeyPatch, width: int, bf16: bool, expected: str
) -> None:
    """Narrow models update faster in fp32 on a GPU (autocast's casts and launches outweigh its matmuls)."""
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert resolve_precision("auto", torch.device("cuda"), width) == expected
    assert resolve_precision("fp32", torch.device("cuda"), width) == "fp32"
