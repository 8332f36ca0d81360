"""The oldest torch that loads an untrusted checkpoint safely, checked at load time.

A checkpoint is a pickle, read with `torch.load(weights_only=True)`, whose restricted
unpickler is the only safety boundary between a downloaded file and code execution.
Releases before 2.6.0 let a crafted file run code through it anyway (CVE-2025-32434),
and releases before 2.10.0 let it corrupt memory (CVE-2026-24747). pyproject.toml
asks for the same version, but an environment can hold an older torch than the
package declares (installed with --no-deps, or torch upgraded or downgraded later).
"""

from __future__ import annotations

import re

from seq2seq.errors import UserError

MIN_TORCH = (2, 10)  # keep in step with the torch floor in pyproject.toml


def check_torch_version(installed: str | None = None) -> None:
    """Raise a one-line `UserError` if `installed` (default: the imported torch) is older than `MIN_TORCH`."""
    if installed is None:
        import torch

        installed = str(torch.__version__)
    match = re.match(r"(\d+)\.(\d+)", installed)
    if match is None or (int(match[1]), int(match[2])) < MIN_TORCH:
        required = ".".join(map(str, MIN_TORCH))
        raise UserError(
            f"torch {installed} is installed, but loading checkpoints safely needs torch >= {required} "
            "(older torch.load(weights_only=True) can be made to run code or corrupt memory); upgrade torch"
        )
