"""Cross-attention weights from the incremental API: those of a full teacher-forced pass, distributions
over the real source positions, recorded only when asked, chosen by layer and head, averaged over an ensemble.

Untrained tiny models with fixed seeds and dropout 0: every comparison is exact up to float rounding.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import model_config
from torch import Tensor

from seq2seq.config import DecodeConfig, RNNConfig
from seq2seq.decoding.alignment import model_attention, parse_layer, require_attention, select, teacher_forced_attention
from seq2seq.decoding.ensemble import Ensemble
from seq2seq.decoding.search import search
from seq2seq.decoding.uncached import UncachedModel
from seq2seq.errors import AttentionError, ConfigError
from seq2seq.model import Seq2SeqModel, Seq2SeqRNN, build_model
from seq2seq.text.vocab import BOS, EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 23
CLOSE = {"atol": 1e-5, "rtol": 1e-5}
MODELS: dict[str, dict[str, Any]] = {
    "pre": {},
    "post": {"norm": "post"},
    "rope": {"positions": "rope"},
    "relative-rmsnorm": {"positions": "relative", "max_relative_distance": 3, "norm_type": "rmsnorm"},
    "t5-bias": {"positions": "t5_bias", "t5_buckets": 8, "t5_max_distance": 6},
    "three decoder layers": {"decoder_layers": 3, "n_heads": 4},
    **{
        f"rnn-{score}": {"arch": "rnn", "rnn": RNNConfig(attention=score, hidden_size=12, layers=1)}
        for score in ("dot", "general", "mlp")
    },
}


def tiny_model(seed: int = 0, **overrides: Any) -> Seq2SeqModel:
    torch.manual_seed(seed)
    base: dict[str, Any] = {"d_model": 16, "n_heads": 2, "d_ff": 32, "encoder_layers": 2, "decoder_layers": 2}
    cfg = model_config(**{**base, "dropout": 0.0, "max_positions": 32, **overrides})
    return build_model(cfg, VOCAB, VOCAB).eval()


def sources() -> tuple[Tensor, Tensor]:
    """Three sources of 7, 5 and 3 tokens (EOS last, PAD after) and their padding mask."""
    g = torch.Generator().manual_seed(1)
    lengths = torch.tensor([7, 5, 3])
    positions = torch.arange(7)[None, :]
    src = torch.randint(EOS + 1, VOCAB, (3, 7), generator=g)
    src[positions == lengths[:, None] - 1] = EOS
    mask = positions >= lengths[:, None]
    return src.masked_fill(mask, PAD), mask


def targets() -> Tensor:
    """Three hypotheses of 6, 4 and 2 tokens, EOS-ended and PAD-filled, as search returns them."""
    g = torch.Generator().manual_seed(2)
    lengths = torch.tensor([6, 4, 2])
    positions = torch.arange(6)[None, :]
    tgt = torch.randint(EOS + 1, VOCAB, (3, 6), generator=g)
    tgt[positions == lengths[:, None] - 1] = EOS
    return tgt.masked_fill(positions >= lengths[:, None], PAD)


def shape_of(model: Seq2SeqModel) -> tuple[int, int]:
    """(layers, heads) of a model's cross-attention."""
    if isinstance(model, Seq2SeqRNN):
        return 1, 1
    return len(model.decoder.layers), model.decoder.layers[0].cross_attn.n_heads


@pytest.mark.parametrize("name", MODELS)
def test_incremental_weights_equal_a_teacher_forced_forward(name: str) -> None:
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    tgt = targets()
    incremental = teacher_forced_attention(model, src, mask, tgt)
    full = model.cross_attention(src, mask, torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1))
    assert incremental.shape == (3, 6, *shape_of(model), 7)  # (B, T, L, H, S)
    torch.testing.assert_close(incremental, full, **CLOSE)


@pytest.mark.parametrize("name", MODELS)
def test_each_row_is_a_distribution_over_the_real_source(name: str) -> None:
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    weights = teacher_forced_attention(model, src, mask, targets())  # (B, T, L, H, S)
    padding = mask[:, None, None, None, :].expand_as(weights)
    assert (weights[padding] == 0).all()
    assert (weights[~padding] > 0).all()
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(weights.shape[:-1]), **CLOSE)


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_recording_is_off_unless_asked_and_changes_no_logits(name: str) -> None:
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    inputs = torch.cat([torch.full_like(targets()[:, :1], BOS), targets()[:, :-1]], dim=1)
    plain = model.start(src, mask)
    recording = model.start(src, mask, need_attention=True)
    assert plain.attention is None
    assert recording.attention is not None
    for t in range(inputs.shape[1]):
        logits = plain.step(inputs[:, t : t + 1])
        torch.testing.assert_close(recording.step(inputs[:, t : t + 1]), logits, **CLOSE)
    assert plain.attention is None
    assert len(recording.attention.steps) == inputs.shape[1]


@pytest.mark.parametrize("name", MODELS)
@torch.no_grad()
def test_weights_follow_repeated_and_dropped_rows(name: str) -> None:
    """Rows repeated per sentence (a beam) and rows dropped later (finished sentences) are recorded
    as the rows search sees, each equal to its sentence's teacher-forced weights."""
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    tgt = targets()
    full = model.cross_attention(src, mask, torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1))
    session = model.start(src, mask, need_attention=True)
    assert session.attention is not None
    row_sentence = torch.arange(3).repeat_interleave(2)  # (6,): two rows per sentence
    session.select(row_sentence)
    drops = {2: [0, 1, 2, 3, 5], 3: [0, 2, 3]}  # one row stops (kept as a map), then two more (copied away)
    for t in range(5):
        if t in drops:
            keep = torch.tensor(drops[t])
            session.select(keep)
            row_sentence = row_sentence[keep]
        session.step(tgt[row_sentence, t - 1 : t] if t else torch.full((len(row_sentence), 1), BOS))
        torch.testing.assert_close(session.attention.steps[t], full[row_sentence, t], **CLOSE)


def test_a_model_without_attention_is_refused() -> None:
    model = tiny_model(arch="rnn", rnn=RNNConfig(attention="none", hidden_size=12, layers=1))
    with pytest.raises(AttentionError, match=r"no attention \(model.rnn.attention: none\)"):
        require_attention(model)
    with pytest.raises(AttentionError, match="no attention"):
        require_attention(Ensemble([tiny_model(), model]))
    require_attention(tiny_model())


def test_layers_and_heads_are_chosen_and_named() -> None:
    weights = torch.rand(2, 5, 3, 4, 6)  # (B, T, L, H, S)
    last, layers, heads = select(weights, "last", "mean")
    torch.testing.assert_close(last, weights[:, :, 2:].mean(dim=3, keepdim=True))
    assert (layers, heads) == (["layer 3"], ["mean of 4 heads"])
    second, layers, heads = select(weights, 2, "each")
    torch.testing.assert_close(second, weights[:, :, 1:2])
    assert (layers, heads) == (["layer 2"], ["head 1", "head 2", "head 3", "head 4"])
    every, layers, _ = select(weights, "all", "each")
    torch.testing.assert_close(every, weights)
    assert layers == ["layer 1", "layer 2", "layer 3"]
    with pytest.raises(AttentionError, match="attention layer 4 does not exist: the model has 3 decoder layers"):
        select(weights, 4, "mean")
    with pytest.raises(AttentionError, match="layer 3 does not exist"):
        require_attention(tiny_model(), 3)
    with pytest.raises(ConfigError, match="attention layer must be last, all or a layer number from 1; got 0"):
        select(weights, 0, "mean")
    with pytest.raises(ConfigError, match="attention heads must be mean or each; got 'max'"):
        select(weights, "last", "max")


@pytest.mark.parametrize("text, expected", [("last", "last"), ("all", "all"), ("1", 1), ("12", 12)])
def test_layer_option_is_parsed(text: str, expected: object) -> None:
    assert parse_layer(text) == expected


@pytest.mark.parametrize("text", ["0", "-1", "first", "1.5", ""])
def test_bad_layer_option_is_a_config_error(text: str) -> None:
    with pytest.raises(ConfigError, match="--attention-layer must be last, all or a layer number from 1"):
        parse_layer(text)


def test_an_ensembles_attention_is_the_mean_of_its_members() -> None:
    members = [tiny_model(seed=0), tiny_model(seed=1, decoder_layers=3)]
    src, mask = sources()
    tgt = targets()
    weights, layers, heads = model_attention(Ensemble(members), src, mask, tgt, "last", "each")
    each = [select(teacher_forced_attention(m, src, mask, tgt), "last", "each")[0] for m in members]
    torch.testing.assert_close(weights, (each[0] + each[1]) / 2)
    assert layers == ["chosen layer"] and heads == ["head 1", "head 2"]  # layer 2 of one, layer 3 of the other
    same, layers, _ = model_attention(Ensemble([members[0], members[0]]), src, mask, tgt, 1, "mean")
    torch.testing.assert_close(same, select(teacher_forced_attention(members[0], src, mask, tgt), 1, "mean")[0])
    assert layers == ["layer 1"]
    with pytest.raises(AttentionError, match="different numbers of layers or heads"):
        model_attention(Ensemble(members), src, mask, tgt, "all", "mean")


def test_an_ensemble_records_its_members_layers_side_by_side() -> None:
    members = [tiny_model(seed=0), tiny_model(seed=1, decoder_layers=3), tiny_model(seed=2, **MODELS["rnn-dot"])]
    src, mask = sources()
    tgt = targets()
    each = [teacher_forced_attention(m, src, mask, tgt) for m in members]  # (B, T, L_i, 1 or 2, S)
    together = teacher_forced_attention(Ensemble(members[:2]), src, mask, tgt)
    assert together.shape == (3, 6, 5, 2, 7)
    torch.testing.assert_close(together, torch.cat(each[:2], dim=2))
    with pytest.raises(AttentionError, match="different numbers of heads"):
        teacher_forced_attention(Ensemble(members), src, mask, tgt)


@pytest.mark.parametrize("name", ["pre", "relative-rmsnorm", "three decoder layers"])
def test_uncached_decoding_records_the_same_weights(name: str) -> None:
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    tgt = targets()
    uncached = teacher_forced_attention(UncachedModel(model), src, mask, tgt)
    torch.testing.assert_close(uncached, teacher_forced_attention(model, src, mask, tgt), **CLOSE)


@pytest.mark.parametrize("name", ["pre", "rnn-mlp"])
@torch.no_grad()
def test_decoding_writes_only_into_its_own_record(name: str) -> None:
    """Each step records into its own session's record or none: a session's record gets nothing from another
    session's steps, nor from search or a teacher-forced pass run meanwhile."""
    model = tiny_model(**MODELS[name])
    src, mask = sources()
    inputs = torch.cat([torch.full_like(targets()[:, :1], BOS), targets()[:, :-1]], dim=1)
    mine, idle = (model.start(src, mask, need_attention=True) for _ in range(2))
    assert mine.attention is not None and idle.attention is not None
    for t in range(3):
        mine.step(inputs[:, t : t + 1])
        hypotheses = search(model, src, mask, DecodeConfig(beam_size=2, max_len_b=5), 31)
        teacher_forced_attention(model, src, mask, targets())
    assert all(hypotheses) and len(mine.attention.steps) == 3 and idle.attention.steps == []
