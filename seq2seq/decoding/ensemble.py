"""An ensemble of models decoded as one: the mean of their next-token log-probabilities at every step.

`Ensemble.start` starts a session of every member and returns an
`EnsembleSession` over them, so greedy, beam and sampling search, n-best lists,
prefixes and `Translator` work unchanged: each member encodes the source and
keeps its own session; a step runs every member's and averages their
log-probabilities (search renormalises the mean). The members are driven only
through the session protocol (seq2seq.model.session), whatever their kind, so
a Transformer and an RNN may decode together. All members must share the
tokenizer, so that a token id means the same piece to each of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from seq2seq.errors import CheckpointError
from seq2seq.model import AttentionRecord, Seq2SeqModel
from seq2seq.model.session import DecodingSession
from seq2seq.runs.checkpoint import Loaded, load_checkpoint

if TYPE_CHECKING:
    from seq2seq.model import Seq2SeqRNN, Seq2SeqTransformer
    from seq2seq.model.session import Decodable


class EnsembleSession:
    """One session per member; beam reordering and dropping finished rows apply to all of them.

    With `need_attention`, each member records its own weights, and the
    ensemble's record holds the members' records (`AttentionRecord.members`):
    `weights()` puts their layers side by side, `parts()` gives them one by one.
    """

    def __init__(self, sessions: list[DecodingSession], need_attention: bool = False) -> None:
        self.sessions = sessions
        records = [session.attention for session in sessions if session.attention is not None]
        self.attention = AttentionRecord(records) if need_attention else None

    def step(self, tokens: Tensor) -> Tensor:
        """The members' mean next-token log-probability: (N, V)."""
        logprobs = [torch.log_softmax(session.step(tokens).float(), dim=-1) for session in self.sessions]
        return torch.stack(logprobs).mean(dim=0)

    def reorder(self, index: Tensor) -> None:
        for session in self.sessions:
            session.reorder(index)

    def select(self, index: Tensor) -> None:
        for session in self.sessions:
            session.select(index)


class Ensemble(nn.Module):
    def __init__(self, members: Sequence[Seq2SeqModel]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)  # registered: .eval(), .to(), parameters
        self.models: list[Seq2SeqModel] = list(members)  # the same modules, typed

    @property
    def max_positions(self) -> int:
        return min(int(m.max_positions) for m in self.models)

    @property
    def attention_layers(self) -> list[int]:
        """Each member's decoder layers with cross-attention, one number per member (`alignment.Attending`)."""
        return [layers for m in self.models for layers in m.attention_layers]

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> EnsembleSession:
        """Every member's session over the sources (B, S), driven as one."""
        sessions: list[DecodingSession] = [m.start(src, src_pad_mask, need_attention) for m in self.models]
        return EnsembleSession(sessions, need_attention)


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


if TYPE_CHECKING:  # for mypy only: every model, and an ensemble of them, is one that search can drive

    def _decodable(transformer: Seq2SeqTransformer, rnn: Seq2SeqRNN, ensemble: Ensemble) -> tuple[Decodable, ...]:
        return transformer, rnn, ensemble
