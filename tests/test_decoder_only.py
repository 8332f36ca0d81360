"""The decoder-only translator (model.arch: decoder_only): what the shared model and search tests do not cover.

test_model.py, test_search.py, test_checkpoint.py, test_loss.py and test_explorer.py run their proofs (cache ==
forward, causality of the target, beam 1 == greedy, batch invariance, checkpoint round trip, bf16, the explorer)
over the decoder-only variants too. Here: the source part (padding, prefix LM against causal LM, its loss), the
attention it records over the source, ensembles, its config and its refusals, and the CLI end to end.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import TINY, decodes_and_evaluates, model_config, reversal_pairs, tiny_overrides
from test_model import VOCAB, source_batch, target_batch, tiny_model

from seq2seq.cli import main
from seq2seq.config import DecodeConfig, DecoderOnlyConfig, load_config
from seq2seq.decoding.ensemble import Ensemble
from seq2seq.decoding.search import search
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.model import DecoderOnlyTransformer, build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.text.corpus import Batch
from seq2seq.text.tokenizer import train_tokenizer
from seq2seq.text.vocab import BOS, EOS, PAD
from seq2seq.training.loss import batch_loss, label_smoothed_loss

pytestmark = pytest.mark.usefixtures("one_thread")

CLOSE = {"atol": 1e-5, "rtol": 1e-5}
PREFIXES = ["bidirectional", "causal"]


def decoder_only(prefix: str = "bidirectional", **settings: object) -> DecoderOnlyTransformer:
    model = tiny_model(arch="decoder_only", decoder_only=DecoderOnlyConfig(prefix=prefix), **settings)  # type: ignore[arg-type]
    assert isinstance(model, DecoderOnlyTransformer)
    return model.eval()


def with_source(
    model: DecoderOnlyTransformer, src: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor
) -> torch.Tensor:
    """The source part's logits (M, V), after the target's (every target position selected)."""
    every = torch.ones(tgt.shape, dtype=torch.bool)
    return model(src, mask, tgt, every, True)[every.sum() :]


@pytest.mark.parametrize("prefix", PREFIXES)
@pytest.mark.parametrize("positions", ["sinusoidal", "rope", "t5_bias"])
@torch.no_grad()
def test_source_padding_does_not_change_real_positions(prefix: str, positions: str) -> None:
    """More padding moves every row's source further right (its offset grows): positions stay each token's own."""
    model = decoder_only(prefix, positions=positions, t5_buckets=8, t5_max_distance=6)
    src, mask = source_batch()
    tgt = target_batch()
    padded_src = torch.cat([src, torch.full((3, 4), PAD)], dim=1)
    padded_mask = torch.cat([mask, torch.ones(3, 4, dtype=torch.bool)], dim=1)
    torch.testing.assert_close(model(padded_src, padded_mask, tgt), model(src, mask, tgt), **CLOSE)
    torch.testing.assert_close(
        with_source(model, padded_src, padded_mask, tgt), with_source(model, src, mask, tgt), **CLOSE
    )


@pytest.mark.parametrize("prefix", PREFIXES)
@torch.no_grad()
def test_a_causal_source_never_sees_its_later_tokens_and_a_prefix_lms_does(prefix: str) -> None:
    model = decoder_only(prefix)
    src, mask = source_batch()
    tgt = target_batch()
    changed = src.clone()
    changed[0, 4] = (src[0, 4] - EOS) % (VOCAB - EOS - 1) + EOS + 1  # row 0 (7 tokens): its fifth token
    before, after = with_source(model, src, mask, tgt), with_source(model, changed, mask, tgt)
    earlier = slice(0, 4)  # row 0's first source logits predict its tokens 1..4, from tokens 0..3
    if prefix == "causal":
        torch.testing.assert_close(after[earlier], before[earlier], **CLOSE)
    else:
        assert not torch.allclose(after[earlier], before[earlier], atol=1e-3)
    assert not torch.allclose(model(changed, mask, tgt)[0], model(src, mask, tgt)[0], atol=1e-3)  # the target sees it


def test_the_source_loss_is_its_weight_times_the_source_tokens_cross_entropy() -> None:
    model = decoder_only("causal")
    src, mask = source_batch()
    tgt_out = target_batch()
    tgt_in = torch.cat([torch.full((3, 1), BOS), tgt_out[:, :-1]], dim=1)
    batch = Batch(src, mask, tgt_in, tgt_out, int((tgt_out != PAD).sum()))
    model.train()  # dropout 0: the same numbers as eval
    plain, plain_nll = batch_loss(model, batch, 0.1)
    loss, nll = batch_loss(model, batch, 0.1, source_loss=0.5)
    torch.testing.assert_close(nll, plain_nll)
    keep = tgt_out != PAD
    logits = model(src, mask, tgt_in, keep, True)
    source = logits[int(keep.sum()) :]  # one per source token after its row's first: 6 + 4 + 2
    assert source.shape[0] == 12
    targets = torch.cat([src[i, 1:n] for i, n in enumerate([7, 5, 3])])  # row by row, as the model orders them
    expected, _ = label_smoothed_loss(source, targets, 0.1)
    torch.testing.assert_close(loss, plain + 0.5 * expected)
    for i, n in enumerate([7, 5, 3]):  # each row's source logits are its own, alone or in the batch
        alone = with_source(model.eval(), src[i : i + 1, :n], mask[i : i + 1, :n], tgt_in[i : i + 1])
        start = sum(m - 1 for m in [7, 5, 3][:i])
        torch.testing.assert_close(alone, source[start : start + n - 1], **CLOSE)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize("prefix", PREFIXES)
@torch.no_grad()
def test_the_recorded_attention_is_over_the_source_in_its_order_alone_or_in_a_batch(prefix: str) -> None:
    model = decoder_only(prefix, positions="rope")
    src, mask = source_batch()
    tgt = target_batch(length=4)

    def recorded(src: torch.Tensor, mask: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        session = model.start(src, mask, need_attention=True)
        for t in range(tgt.shape[1]):
            session.step(tgt[:, t : t + 1])
        assert session.attention is not None
        return session.attention.weights()  # (N, T, L, H, S)

    together = recorded(src, mask, tgt)
    assert together.shape == (3, 4, 4, 2, 7)
    torch.testing.assert_close(together.sum(dim=-1), torch.ones(3, 4, 4, 2))
    assert (together.permute(0, 4, 1, 2, 3)[mask] == 0).all()  # nothing on padding
    for i, n in enumerate([7, 5, 3]):
        alone = recorded(src[i : i + 1, :n], mask[i : i + 1, :n], tgt[i : i + 1])
        torch.testing.assert_close(alone[0], together[i, ..., :n], **CLOSE)


@torch.no_grad()
def test_an_ensemble_of_decoder_only_and_encoder_decoder_models_decodes_through_the_sessions() -> None:
    src, mask = source_batch()
    decode = DecodeConfig(strategy="beam", beam_size=3, nbest=2, max_len=6, max_len_b=6)
    prefix_lm, causal_lm = decoder_only("bidirectional"), decoder_only("causal", seed=1)
    transformer = tiny_model(seed=2).eval()
    twice = search(Ensemble([prefix_lm, prefix_lm]), src, mask, decode, 15)
    once = search(prefix_lm, src, mask, decode, 15)
    assert [[h.tokens for h in s] for s in twice] == [[h.tokens for h in s] for s in once]
    mixed = search(Ensemble([prefix_lm, causal_lm, transformer]), src, mask, replace(decode, strategy="greedy"), 15)
    assert len(mixed) == 3 and all(s[0].tokens[-1] == EOS for s in mixed)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.share_all_embeddings=false"], "model.share_all_embeddings must be true for model.arch: decoder_only"),
        (
            ["model.decoder_only.source_loss=1"],
            "model.decoder_only.source_loss needs model.decoder_only.prefix: causal",
        ),
        (
            [
                "model.decoder_only.prefix=causal",
                "model.decoder_only.source_loss=1",
                "optim.rdrop_alpha=1",
                "model.dropout=0.1",
            ],
            "cannot be combined with optim.rdrop_alpha",
        ),
        (["model.max_positions=128"], "data.max_len (64) must be below half of model.max_positions (128)"),
        (["model.decoder_only.prefix=both"], "model.decoder_only.prefix must be one of bidirectional, causal"),
        (["model.rnn.cell=gru"], "model.rnn.cell does not apply to model.arch: decoder_only"),
        (["model.transformer.attention=local_global"], "model.arch: decoder_only has no encoder (full only)"),
    ],
)
def test_bad_decoder_only_settings_are_one_line(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)) as caught:
        load_config(TINY, ["model.arch=decoder_only", "model.max_positions=256", *overrides])
    assert "\n" not in str(caught.value)


def test_a_decoder_only_setting_for_an_encoder_decoder_is_refused() -> None:
    with pytest.raises(ConfigError, match="model.decoder_only.prefix does not apply to model.arch: transformer"):
        load_config(TINY, ["model.decoder_only.prefix=causal"])


def test_averaging_a_decoder_only_checkpoint_with_an_encoder_decoder_is_refused(tmp_path: Path) -> None:
    src, tgt = reversal_pairs(300, seed=0)
    tokenizer = train_tokenizer(src, tgt, 64, shared=True)
    paths = []
    for arch in ("transformer", "decoder_only"):
        cfg = load_config(TINY, ["model.max_positions=256", f"model.arch={arch}"])
        model = build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
        paths.append(tmp_path / f"{arch}.pt")
        ckpt.save(paths[-1], ckpt.Checkpoint(cfg, tokenizer, model.state_dict(), "r1"))
    with pytest.raises(CheckpointError, match="model.arch is 'decoder_only', not 'transformer'"):
        ckpt.average_checkpoints(paths, tmp_path / "avg.pt")


def test_a_decoder_only_model_needs_one_vocabulary() -> None:
    cfg = model_config(arch="decoder_only")
    with pytest.raises(ValueError, match="one vocabulary"):
        build_model(cfg, 23, 24)


DECODER_ONLY = (
    "model.arch=decoder_only",
    "model.max_positions=256",
    "model.d_model=32",
    "train.max_epochs=2",
    "train.threads=1",
    "validation.bleu=false",
    "validation.best_metric=loss",
    "checkpoint.keep_last=2",
)


@pytest.mark.trains
def test_train_translate_evaluate_average_resume_and_refused_exports(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run, *DECODER_ONLY)]) == 0
    assert "M parameters (decoder_only)" in (run / "train.log").read_text(encoding="utf-8")
    best = str(run / "checkpoint_best.pt")
    assert isinstance(load_checkpoint(best).model, DecoderOnlyTransformer)
    decodes_and_evaluates(best, tmp_path, capsys, strategies=("greedy", "sample"))
    assert main(["average", "--run-dir", str(run), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 0
    capsys.readouterr()
    refusals = {
        "export": "prefix: bidirectional does not export to CTranslate2",
        "hf": "model.arch=decoder_only does not export to Marian",
        "int8": "decode.quantize=int8 is not available for model.arch: decoder_only",
    }
    for what, message in refusals.items():
        if what == "int8":
            code = main(["translate", "-c", best, "-i", str(tmp_path / "in.txt"), "decode.quantize=int8"])
        else:
            code = main(["export", best, "-o", str(tmp_path / what), *(["--format", "hf"] if what == "hf" else [])])
        err = capsys.readouterr().err
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err
    resumed = tiny_overrides(corpus, run, *DECODER_ONLY, "train.max_epochs=3")
    assert main(["train", "--config", str(TINY), *resumed]) == 0
    assert "resuming" in (run / "train.log").read_text(encoding="utf-8")


@pytest.mark.trains
def test_a_causal_lm_with_a_source_loss_trains_and_refuses_to_export(
    corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    settings = (*DECODER_ONLY, "model.decoder_only.prefix=causal", "model.decoder_only.source_loss=0.5")
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run, *settings)]) == 0
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint_best.pt"), "-o", str(tmp_path / "ct2")]) != 0
    err = capsys.readouterr().err
    assert "model.arch=decoder_only does not export to CTranslate2" in err and len(err.strip().splitlines()) == 1


@pytest.mark.trains
def test_fine_tuning_an_encoder_decoder_into_a_decoder_only_model_is_refused(
    trained_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    parent = f"train.init_from={trained_run / 'checkpoint_best.pt'}"
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, tmp_path / "run", *DECODER_ONLY, parent)]) != 0
    err = capsys.readouterr().err
    assert "model.arch is decoder_only, but the parent model was trained with transformer" in err
    assert len(err.strip().splitlines()) == 1
