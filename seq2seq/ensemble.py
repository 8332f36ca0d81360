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
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from seq2seq.checkpoint import Loaded, load_checkpoint
from seq2seq.errors import AttentionError, CheckpointError
from seq2seq.model import AttentionRecord, DecoderCache, RNNCache, Seq2SeqModel, Seq2SeqRNN
from seq2seq.model.rnn import Encoded
from seq2seq.model.transformer import Seq2SeqTransformer
from seq2seq.search import IncrementalModel

MemberMemory = Tensor | Encoded
"""A member's encoder output: a Transformer's (B, S, D), or an RNN's states."""
MemberCache = DecoderCache | RNNCache


class EnsembleCache:
    """One cache per member; beam reordering and dropping finished rows apply to all of them.

    With an attention record, each step keeps the members' cross-attention side
    by side, (N, L1 + L2 + ..., H, S): the members' layers one after another,
    which needs them to have the same number of heads.
    """

    def __init__(self, caches: list[MemberCache]) -> None:
        self.caches = caches
        self.attention: AttentionRecord | None = None

    def reorder(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.reorder(index)

    def select(self, index: Tensor) -> None:
        for cache in self.caches:
            cache.select(index)

    def start_recording(self) -> None:
        """Give each member a record of its own while the ensemble has one."""
        for cache in self.caches:
            if self.attention is not None and cache.attention is None:
                cache.attention = AttentionRecord()

    def end_step(self) -> None:
        """Keep the members' weights of the step just run, side by side, in the ensemble's record."""
        if self.attention is None:
            return
        records = [cache.attention for cache in self.caches if cache.attention is not None]
        steps = [record.steps[-1] for record in records if record.steps]
        if not steps:  # no member has attention
            return
        if len({weights.shape[2] for weights in steps}) > 1:
            raise AttentionError("the ensemble's members have different numbers of heads: record them one by one")
        self.attention.steps.append(torch.cat(steps, dim=1))


class Ensemble(nn.Module):
    def __init__(self, members: Sequence[Seq2SeqModel]) -> None:
        super().__init__()
        self.members = nn.ModuleList(members)  # registered: .eval(), .to(), parameters
        self.models: list[Seq2SeqModel] = list(members)  # the same modules, typed

    @property
    def max_positions(self) -> int:
        return min(int(m.max_positions) for m in self.models)

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> list[MemberMemory]:
        return [m.encode(src, src_pad_mask) for m in self.models]

    def init_cache(self, memories: list[MemberMemory], src_pad_mask: Tensor) -> EnsembleCache:
        return EnsembleCache([member_cache(m, memory, src_pad_mask) for m, memory in zip(self.models, memories)])

    def decode_step(self, tokens: Tensor, cache: EnsembleCache) -> Tensor:
        """The members' mean next-token log-probability: (N, V)."""
        cache.start_recording()
        steps = [member_step(m, tokens, c) for m, c in zip(self.models, cache.caches)]
        cache.end_step()
        logprobs = [torch.log_softmax(logits.float(), dim=-1) for logits in steps]
        return torch.stack(logprobs).mean(dim=0)


def member_cache(model: Seq2SeqModel, memory: MemberMemory, src_pad_mask: Tensor) -> MemberCache:
    """`model.init_cache`, with the member's encoder output told apart by its kind of model."""
    if isinstance(model, Seq2SeqRNN):
        assert isinstance(memory, Encoded)
        return model.init_cache(memory, src_pad_mask)
    assert isinstance(memory, Tensor)
    return model.init_cache(memory, src_pad_mask)


def member_step(model: Seq2SeqModel, tokens: Tensor, cache: MemberCache) -> Tensor:
    """`model.decode_step`, with the member's cache told apart by its kind of model."""
    if isinstance(model, Seq2SeqRNN):
        assert isinstance(cache, RNNCache)
        return model.decode_step(tokens, cache)
    assert isinstance(cache, DecoderCache)
    return model.decode_step(tokens, cache)


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

    def _incremental(
        transformer: Seq2SeqTransformer, rnn: Seq2SeqRNN, ensemble: Ensemble
    ) -> tuple[
        IncrementalModel[Tensor, DecoderCache],
        IncrementalModel[Encoded, RNNCache],
        IncrementalModel[list[MemberMemory], EnsembleCache],
    ]:
        return transformer, rnn, ensemble
