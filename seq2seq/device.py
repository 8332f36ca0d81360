"""Device and numeric precision: resolved once, in one place, for training and translation."""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from seq2seq.errors import TrainingError, UserError


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """`auto`, `cpu` or `cuda` as a device; `option` is how the user spelled the setting, for the error."""
    if name == "cuda" and not torch.cuda.is_available():
        given = f"{option} {name}" if option.startswith("-") else f"{option}={name}"
        raise UserError(f"{given} but CUDA is not available on this machine")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


CUDA_BF16_WIDTH = 512  # `auto` on CUDA: half precision from this model width on (resolve_precision says why)


def resolve_precision(precision: str, device: torch.device, width: int = CUDA_BF16_WIDTH) -> str:
    """The precision `train.precision` means on `device` for a model of `width` (d_model, or an RNN's hidden size).

    `auto` on CUDA: bf16 for models of width `CUDA_BF16_WIDTH` and more where
    the GPU supports it (no loss scaling needed), else fp16 with a gradient
    scaler; fp32 for narrower models. Why: on one NVIDIA H200 (torch 2.11,
    the isolated update step, target tokens/s), bf16 autocast ran 2.92x fp32
    for 6+6 layers of width 512 but 0.87x fp32 for the quickstart's 3+3 of
    width 256, where the casts and the extra kernel launches of autocast cost
    more than its faster matmuls save; `scripts/gpu_check.sh` measures both
    shapes again on each GPU it runs on. `auto` on CPU: bf16 autocast if the
    CPU has native bf16 instructions (AVX512-BF16 or AMX), else fp32.

    Why bf16 on such CPUs: scripts/bench/bench_train.py, on this project's 2-core AMD
    EPYC (avx512_bf16, no AMX), measured bf16 autocast at 1.66x the training
    tokens/s of fp32 for the quickstart model (3,305 vs 1,994) and 2.36x for
    6+6 layers of d_model 512 (1,061 vs 428), medians of 5 interleaved rounds;
    bf16 matmuls ran 5.3x fp32. Runs on the busy machine agreed in direction
    (1.1-1.8x and 1.4-2.5x). HF Marian gained far less here (0.90x/1.21x,
    ../shared/DESIGN.md): its casts and non-matmul work ate the gain, whereas
    this model's loss has a closed-form gradient and projects only real target
    tokens. It is safe: weights, optimizer state and the loss stay fp32, bf16
    has fp32's exponent range (no loss scaling), and training follows fp32:
    quickstart validation loss after 200 updates was 4.400 in bf16 and 4.401
    in fp32 (see also tests/test_training.py). Without native bf16 the
    matmuls are emulated, so fp32 stays the choice there (not measured here).
    With bounded row counts (`BoundedRows`) bf16's peak RSS over 500
    quickstart updates was 1.27x fp32's and flat, at 1.87x its tokens/s
    (`scripts/bench/bench_memory.py`, docs/results.md).
    """
    if precision == "fp16" and device.type != "cuda":
        raise TrainingError("train.precision=fp16 needs CUDA; use bf16 or fp32 on CPU")
    if precision == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise TrainingError("train.precision=bf16 is not supported by this GPU; use fp16")
    if precision != "auto":
        return precision
    if device.type == "cuda":
        if width < CUDA_BF16_WIDTH:
            return "fp32"
        return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
    return "bf16" if cpu_has_native_bf16() else "fp32"


# oneDNN's instruction sets below AVX512_CORE_BF16 (`ONEDNN_MAX_CPU_ISA`): with one of these, bf16 is emulated.
_ONEDNN_WITHOUT_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"}
)


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX tiles, as torch reports them (False where torch cannot tell), and allowed to be used.

    A process limited to fewer instructions than the CPU has (`ATEN_CPU_CAPABILITY=avx2`,
    `ONEDNN_MAX_CPU_ISA=AVX2`, as `scripts/cpu_kinds.sh` sets them to run as another CPU kind would) runs
    bf16 without the native instructions, so it counts as a CPU without them.
    """
    cpu = torch.cpu
    checks = (getattr(cpu, "_is_avx512_bf16_supported", None), getattr(cpu, "_is_amx_tile_supported", None))
    if not any(check() for check in checks if check is not None):
        return False
    if torch.backends.cpu.get_cpu_capability() != "AVX512":
        return False
    return os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() not in _ONEDNN_WITHOUT_BF16


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Mixed-precision context for forward passes; a no-op for fp32.

    bf16 on CPU also runs every linear layer on a bounded set of row counts
    (`BoundedRows`): see there for why.
    """
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    if device.type == "cpu" and precision == "bf16":
        stack = contextlib.ExitStack()
        stack.enter_context(torch.autocast(device.type, dtype=dtype))
        stack.enter_context(BoundedRows())
        return stack
    return torch.autocast(device.type, dtype=dtype)


def row_bucket(rows: int) -> int:
    """`rows` rounded up to a multiple of 16 and of 2**(bits-4): 8 sizes per octave, above 128 at most 12.5% more."""
    step = 1 << max(4, rows.bit_length() - 4)
    return -(-rows // step) * step


class BoundedRows(TorchFunctionMode):
    """Runs `F.linear` on row counts rounded up by `row_bucket` (zero rows appended, then sliced off).

    Why: PyTorch runs bf16 matmuls on CPU through oneDNN, which JIT-compiles a
    kernel (a primitive) for every new shape and caches up to 1,024 of them, a
    few MB each for a layer of the quickstart model. A training batch's row
    count (batch x length, or its real target tokens) is new almost every
    update, so the cache filled with one-off primitives and the allocator
    fragmented around their buffers: peak RSS grew without bound (2.8 GB after
    300 quickstart updates on one thread, against 0.9 GB in fp32), with a
    creation on nearly every matmul. Rounding the rows bounds the shapes to a
    few dozen per layer, all reused. Rows are independent in a linear layer, so
    the padding changes no real row's result; fp32 uses other GEMMs and keeps
    its shapes. `scripts/bench/bench_memory.py` measures both.
    """

    def __torch_function__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x: torch.Tensor = args[0]
        rows = x.numel() // max(x.shape[-1], 1)
        target = row_bucket(rows)
        if rows == 0 or target == rows:
            return func(*args, **kwargs)
        padded = F.pad(x.reshape(rows, x.shape[-1]), (0, 0, 0, target - rows))
        out = func(padded, *args[1:], **kwargs)
        return out[:rows].reshape(*x.shape[:-1], out.shape[-1])
