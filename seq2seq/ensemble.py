"""An ensemble of models decoded as one: the mean of their next-token log-probabilities at every step.

`Ensemble` offers the incremental API that `seq2seq.search` drives, so greedy,
beam and sampling search, n-best lists and `Translator` work unchanged: each
member encodes the source and keeps its own cache; a step runs every member
and averages their log-probabilities (search renormalises the mean). All
members must share the tokenizer, so that a token id means the same piece to
each of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from seq2seq.checkpoint import Loaded, load_checkpoint
from seq2seq.errors import CheckpointError
from seq2seq.model import Seq2SeqModel


class EnsembleCache:
    """One cache per member; beam reordering and dropping finished rows apply to all of them."""

    def __init__(self, caches: list[Any]) -> None:
        self.caches = caches

    def reorder(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(index)

    def select(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.select(index)


class Ensemble(nn.Module):
    def __init__(self, members: Sequence[Seq2SeqModel]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)  # registered: .eval(), .to(), parameters
        self.models: list[Seq2SeqModel] = list(members)  # the same modules, typed

    @property
    def max_positions(self) -> int:
        return min(int(m.max_positions) for m in self.models)

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> list[Any]:
        return [m.encode(src, src_pad_mask) for m in self.models]

    def init_cache(self, memories: list[Any], src_pad_mask: Tensor) -> EnsembleCache:
        return EnsembleCache([m.init_cache(memory, src_pad_mask) for m, memory in zip(self.models, memories)])

    def decode_step(self, tokens: Tensor, cache: EnsembleCache) -> Tensor:
        """The members' mean next-token log-probability: (N, V)."""
        logprobs = [
            torch.log_softmax(m.decode_step(tokens, c).float(), dim=-1) for m, c in zip(self.models, cache.caches)
        ]
        return torch.stack(logprobs).mean(dim=0)


def load_ensemble(paths: Sequence[str | Path], device: str | torch.device = "cpu") -> tuple[Ensemble, Loaded]:
    """The models of several checkpoints as one ensemble, and the first checkpoint (its tokenizer and config)."""
    loaded = [load_checkpoint(path, device) for path in paths]
    first = loaded[0]
    for path, other in zip(paths[1:], loaded[1:]):
        for side in ("tgt", "src"):
            if getattr(other.tokenizer, f"{side}_proto") != getattr(first.tokenizer, f"{side}_proto"):
                what = "target" if side == "tgt" else "shared" if first.tokenizer.shared else "source"
                raise CheckpointError(
                    f"{path}: its {what} vocabulary differs from {paths[0]}'s; an ensemble needs one vocabulary"
                )
    return Ensemble([member.model for member in loaded]).to(device).eval(), first
