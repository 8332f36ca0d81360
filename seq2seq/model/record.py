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

An ensemble's session keeps no steps of its own: its record holds its
members' records (`members`), and `parts()` gives the records whose layers and
heads belong together, whatever the kind of session, so alignment can read a
model and an ensemble alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from seq2seq.errors import AttentionError


class AttentionRecord:
    """Cross-attention weights of a decoding session, one entry per step (or an ensemble's members' records)."""

    def __init__(self, members: Sequence[AttentionRecord] = ()) -> None:
        self.steps: list[Tensor] = []  # (N, L, H, S) each, rows as search saw them at that step
        self.members = list(members)  # an ensemble's: one record per member, which keep the steps

    def parts(self) -> list[AttentionRecord]:
        """The records whose layers and heads belong together: this one, or each member's of an ensemble."""
        return [part for member in self.members for part in member.parts()] if self.members else [self]

    def weights(self) -> Tensor:
        """Every step's weights, (N, T, L, H, S); an ensemble's members' layers side by side, (N, T, L1 + L2 + ...,
        H, S), which needs them to have the same number of heads (a member without attention adds none)."""
        recorded = [part.steps for part in self.parts() if part.steps]
        if not recorded:
            raise AttentionError("the decoding session recorded no attention: the model has none")
        if len({steps[0].shape[2] for steps in recorded}) > 1:
            raise AttentionError("the ensemble's members have different numbers of heads: record them one by one")
        return torch.cat([torch.stack(steps, dim=1) for steps in recorded], dim=2)

    def end_step(self, layers: Sequence[Tensor]) -> None:
        """Keep the decoding step just run as one entry of `steps`: each layer's weights (N, H, T, S), bottom
        first, rows as search sees them, at the step's last position: (N, L, H, S)."""
        if not layers:  # a model without attention returns none
            return
        self.steps.append(torch.stack(list(layers), dim=1)[:, :, :, -1])  # (N, L, H, T, S) -> (N, L, H, S)
