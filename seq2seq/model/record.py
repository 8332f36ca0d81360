"""Where a decoding session keeps the cross-attention weights it was asked for: an `AttentionRecord`.

Decoding and training never form the weights (the fused attention kernels
skip them). To see them, a caller asks for them explicitly: a decoding
session started with `need_attention` (`model.start(src, src_pad_mask,
need_attention=True)`) carries a record (`session.attention`), and each step
then runs its layers with `need_attention=True`, which spell their
cross-attention out and return the weights beside their output; the step
keeps them as one entry of the record (`end_step`). A teacher-forced pass
asks the same way (`Seq2SeqTransformer.cross_attention`) and gets the weights
back directly. Nothing is ambient: a session without a record computes and
keeps nothing more, whatever else is running.

Shapes: N rows (hypotheses), L decoder layers, H heads, T target positions,
S source positions. An RNN's attention is one layer with one head.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


class AttentionRecord:
    """Cross-attention weights of a decoding session, one entry per step."""

    def __init__(self) -> None:
        self.steps: list[Tensor] = []  # (N, L, H, S) each, rows as search saw them at that step

    def end_step(self, layers: Sequence[Tensor]) -> None:
        """Keep the decoding step just run as one entry of `steps`: each layer's weights (N, H, T, S), bottom
        first, rows as search sees them, at the step's last position: (N, L, H, S)."""
        if not layers:  # a model without attention returns none
            return
        self.steps.append(torch.stack(list(layers), dim=1)[:, :, :, -1])  # (N, L, H, T, S) -> (N, L, H, S)
