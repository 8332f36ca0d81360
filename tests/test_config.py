"""Config loading: every mistake is caught before training, in one line that says where and what."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch
import yaml
from conftest import TINY, single_thread_env

from seq2seq.cli import main
from seq2seq.config import (
    MOVED_TRAIN_KEYS,
    REFERENCE_END,
    REFERENCE_START,
    ExperimentConfig,
    RNNConfig,
    Setting,
    apply_overrides,
    config_yaml,
    from_dict,
    load_config,
    migrate_model,
    reference_in,
    reference_table,
    save_config,
    settings,
    to_dict,
)
from seq2seq.device import resolve_precision
from seq2seq.errors import ConfigError, UserError
from seq2seq.model import build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.training.setup import data_workers

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DATA = ROOT / "tests" / "data"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path | None, *overrides: str) -> str:
    """The message of the ConfigError that loading must raise."""
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides))
    message = str(info.value)
    assert "\n" not in message, "config errors are one line"
    return message


# Every shipped config is valid (torchtune's test_configs): a typo in a YAML file fails here, not after a download.


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_loads_and_builds(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.data.src_lang != cfg.data.tgt_lang
    assert from_dict(to_dict(cfg)) == cfg  # what checkpoints store reads back the same
    vocab = cfg.data.vocab_size
    model = build_model(cfg.model, vocab, vocab)  # the model it describes can be built
    assert sum(p.numel() for p in model.parameters()) > 0


def test_configs_directory_is_not_empty() -> None:
    assert {p.name for p in CONFIGS} >= {"tiny.yaml", "quickstart.yaml"}


def test_shipped_configs_write_to_different_run_dirs() -> None:
    run_dirs = [load_config(p).train.run_dir for p in CONFIGS]
    assert len(set(run_dirs)) == len(run_dirs)


# Unknown keys.


def test_unknown_section_names_key_file_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "modle:\n  d_model: 64\n")
    message = config_error(path)
    assert "'modle'" in message
    assert str(path) in message
    assert "did you mean 'model'" in message


def test_unknown_nested_key_names_key_file_and_suggestion(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  d_modle: 64\n")
    message = config_error(path)
    assert "'model.d_modle'" in message
    assert str(path) in message
    assert "did you mean 'model.d_model'" in message


def test_unknown_override_key_is_suggested_and_blames_command_line(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "{}\n"), "train.lrr=0.1")
    assert "'train.lrr'" in message and "did you mean 'optim.lr'" in message
    assert "command line" in message


def test_unrelated_unknown_key_lists_valid_keys_instead_of_a_wrong_guess(tmp_path: Path) -> None:
    """A shared `train.` prefix must not make `train.foo` look like `train.seed`."""
    message = config_error(write(tmp_path, "train:\n  foo: 1\n"))
    assert "did you mean" not in message
    assert "valid keys:" in message and "max_tokens" in message


# Types and values.


@pytest.mark.parametrize(
    ("yaml_text", "needle"),
    [
        ("model:\n  d_model: big\n", "model.d_model must be int; got 'big'"),
        ("model:\n  d_model: true\n", "model.d_model must be int"),  # bool is not an int here
        ("model:\n  d_model: 64.5\n", "model.d_model must be int"),
        ("train:\n  lr: fast\n", "optim.lr must be float"),
        ("train:\n  deterministic: 1\n", "train.deterministic must be bool"),
        ("train:\n  betas: 0.9\n", "optim.betas must be a list of 2 values"),
        ("data:\n  src_lang: null\n", "data.src_lang must be str"),
        ("model: 5\n", "model must be a mapping"),
    ],
)
def test_wrong_type_is_rejected(tmp_path: Path, yaml_text: str, needle: str) -> None:
    path = write(tmp_path, yaml_text)
    message = config_error(path)
    assert needle in message and str(path) in message


def test_yaml_booleans_in_a_string_field_say_to_quote(tmp_path: Path) -> None:
    """`src_lang: no` (Norwegian) is YAML 1.1 for False; the message must say why, not just "got False"."""
    message = config_error(write(tmp_path, "data:\n  src_lang: no\n"))
    assert "data.src_lang must be str; got False" in message and "quote" in message
    assert load_config(write(tmp_path, "data:\n  src_lang: 'no'\n")).data.src_lang == "no"


def test_invalid_choice_lists_the_choices(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "model:\n  norm: middle\n"))
    assert "model.transformer.norm must be one of post, pre; got 'middle'" in message


def test_d_model_not_divisible_by_heads(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "model:\n  d_model: 66\n  n_heads: 4\n"))
    assert "model.d_model (66) must be divisible by model.transformer.n_heads (4)" in message


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["optim.lr=.inf"], "optim.lr must be a finite number"),
        (["model.dropout=nan"], "model.dropout must be a finite number"),
        (["optim.betas=[0.9, 1.5]"], "optim.betas"),
        (["optim.eps=0"], "optim.eps must be positive"),
        (["data.shared_vocab=false"], "model.share_all_embeddings needs data.shared_vocab"),
        (["data.max_len=600"], "data.max_len (600) must be below model.max_positions (512)"),
        (["data.sampling_nbest=1"], "data.sampling_nbest must be -1 or at least 2; got 1"),
        (["optim.rdrop_alpha=-1"], "optim.rdrop_alpha must be >= 0"),
        (["optim.rdrop_alpha=5", "model.dropout=0"], "optim.rdrop_alpha compares two dropout passes"),
        (["data.spm_model_type=bpe", "data.sampling_alpha=1"], "data.sampling_alpha is a dropout probability"),
        (["decode.beam_size=2", "decode.nbest=3"], "decode.nbest (3) must not exceed decode.beam_size (2)"),
        (
            ["model.transformer.positions=rope", "model.d_model=12", "model.transformer.n_heads=4"],
            "d_model / model.transformer.n_heads (3) must be even",
        ),
        (["model.transformer.max_relative_distance=0"], "model.transformer.max_relative_distance must be at least 1"),
        (
            ["model.arch=rnn", "model.rnn.hidden_size=33"],
            "model.rnn.hidden_size (33) must be even with model.rnn.bidirectional",
        ),
        (
            ["model.arch=rnn", "model.rnn.attention=bahdanau"],
            "model.rnn.attention must be one of none, dot, general, mlp",
        ),
        (
            ["model.arch=rnn", "model.rnn.context_every_step=true"],
            "model.rnn.context_every_step needs model.rnn.attention: none (with attention: general every step",
        ),
        (["model.arch=rnn", "model.rnn.cel=gru"], "did you mean 'model.rnn.cell'"),
        (["model.arch=lstm"], "model.arch must be one of transformer, rnn"),
        (["decode.max_input_len=1"], "decode.max_input_len must be 0 (the model's limit) or at least 2"),
    ],
)
def test_inconsistent_or_out_of_range_values(overrides: list[str], needle: str) -> None:
    assert needle in config_error(None, *overrides)


def test_invalid_yaml_reports_the_line(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "model:\n  d_model: 64\n n_heads: [\n"))
    assert "invalid YAML at line" in message


def test_missing_config_file(tmp_path: Path) -> None:
    assert "config file not found" in config_error(tmp_path / "nope.yaml")


def test_empty_section_keeps_defaults(tmp_path: Path) -> None:
    """`data:` with nothing below is YAML null; it means "no changes", not a type error."""
    cfg = load_config(write(tmp_path, "data:\nmodel:\n  d_model: 64\n"), ["data.vocab_size=100"])
    assert cfg.data.vocab_size == 100 and cfg.data.src_lang == "de" and cfg.model.d_model == 64


# Command-line overrides.


def test_overrides_convert_types_and_beat_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "train:\n  lr: 0.5\n  max_epochs: 3\n")
    cfg = load_config(
        path,
        ["optim.lr=1", "optim.eps=1e-3", "train.deterministic=true", "optim.betas=[0.8, 0.9]", "model.d_model=128"],
    )
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)  # int -> float
    assert cfg.optim.eps == pytest.approx(1e-3) and isinstance(cfg.optim.eps, float)  # PyYAML reads "1e-3" as str
    assert cfg.train.deterministic is True
    assert cfg.optim.betas == (0.8, 0.9)  # a YAML list becomes the declared tuple
    assert cfg.model.d_model == 128
    assert cfg.train.max_epochs == 3  # untouched file values stay


def test_a_section_given_as_a_mapping_sets_its_keys_and_keeps_the_files_others(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  vocab_size: 64\n  max_len: 100\n")
    cfg = load_config(path, ["data={dir: /tmp/x, max_len: 64}", "model={transformer: {d_ff: 96}}"])
    assert (cfg.data.dir, cfg.data.max_len, cfg.data.vocab_size) == ("/tmp/x", 64, 64)
    assert cfg.model.transformer is not None and cfg.model.transformer.d_ff == 96
    assert "data.vocab_sise" in config_error(path, "data={vocab_sise: 8}")  # each key still checked by name


def test_overrides_into_a_new_section_and_with_equals_in_value(tmp_path: Path) -> None:
    cfg = load_config(None, ["data.dir=/tmp/a=b", "decode.strategy=greedy"])
    assert cfg.data.dir == "/tmp/a=b" and cfg.decode.strategy == "greedy"


@pytest.mark.parametrize("override", ["optim.lr", "=3", "optim.lr.x=1", "optim.betas=[0.9]"])
def test_malformed_override_is_a_config_error(override: str) -> None:
    config_error(None, override)


def test_apply_overrides_returns_a_validated_copy() -> None:
    cfg = ExperimentConfig()
    changed = apply_overrides(cfg, ["decode.beam_size=3"])
    assert changed.decode.beam_size == 3 and cfg.decode.beam_size == 5
    with pytest.raises(ConfigError, match="decode.beam_size must be at least 1"):
        apply_overrides(cfg, ["decode.beam_size=0"])


# by_precision: settings for the precision training resolves to on the machine at hand.

BY_PRECISION = """model:
  transformer:
    d_ff: 512
optim:
  lr: 0.002
by_precision:
  bf16:
    model:
      transformer:
        d_ff: 1024
    optim.lr: 0.001
  fp32:
"""


@pytest.mark.parametrize(("precision", "d_ff", "lr"), [("bf16", 1024, 1e-3), ("fp32", 512, 2e-3), ("fp16", 512, 2e-3)])
def test_by_precision_applies_the_block_of_the_precision_training_runs_in(
    tmp_path: Path, precision: str, d_ff: int, lr: float
) -> None:
    device = "cuda" if precision == "fp16" else "cpu"  # fp16 is CUDA's; without one, loading it must say so
    overrides = [f"train.precision={precision}", f"train.device={device}"]
    if device == "cuda" and not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA is not available"):
            load_config(write(tmp_path, BY_PRECISION), overrides)
        return
    cfg = load_config(write(tmp_path, BY_PRECISION), overrides)
    assert (cfg.model.transformer.d_ff, cfg.optim.lr) == (d_ff, lr)


def test_by_precision_auto_follows_the_precision_training_resolves_to_here(tmp_path: Path) -> None:
    """Whatever this CPU is: the block chosen is that of the precision `setup_device` will train in."""
    cfg = load_config(write(tmp_path, BY_PRECISION), ["train.device=cpu", "train.precision=auto"])
    here = resolve_precision("auto", torch.device("cpu"), cfg.model.d_model)
    assert cfg.model.transformer.d_ff == (1024 if here == "bf16" else 512)


def test_by_precision_loses_to_the_command_line_and_is_not_stored(tmp_path: Path) -> None:
    path = write(tmp_path, BY_PRECISION)
    cfg = load_config(path, ["train.precision=bf16", "model.transformer.d_ff=768"])
    assert (cfg.model.transformer.d_ff, cfg.optim.lr) == (768, 1e-3)
    saved = tmp_path / "run_config.yaml"
    save_config(cfg, saved)  # what a run directory and its checkpoints hold: the result, without the block
    assert "by_precision" not in saved.read_text() and load_config(saved) == cfg


@pytest.mark.parametrize(
    ("block", "needles"),
    [
        ("  bf17:\n    model.dropout: 0.1\n", ["'by_precision.bf17'", "fp32, bf16, fp16"]),
        ("  bf16: 3\n", ["by_precision.bf16 must be a mapping"]),
        ("  bf16:\n    train.precision: fp32\n", ["by_precision.bf16.train.precision", "depends on"]),
        ("  fp32:\n    model:\n      d_model: 128\n", ["by_precision.fp32.model.d_model", "depends on"]),
        ("  fp32:\n    model: null\n", ["by_precision.fp32.model:", "depends on model.d_model"]),
        ("  fp16:\n    model.transformer.dff: 64\n", ["by_precision.fp16", "'model.transformer.dff'", "d_ff"]),
        ("  bf16:\n    model.dropout: 1.5\n", ["by_precision.bf16", "model.dropout"]),
    ],
)
def test_a_bad_by_precision_block_fails_naming_it_even_where_it_would_not_apply(
    tmp_path: Path, block: str, needles: list[str]
) -> None:
    path = write(tmp_path, f"model:\n  d_model: 64\nby_precision:\n{block}")
    message = config_error(path, "train.precision=fp32", "train.device=cpu")
    assert str(path) in message
    for needle in needles:
        assert needle in message, message


def test_by_precision_cannot_be_overridden_from_the_command_line(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, BY_PRECISION), "by_precision.bf16.model.transformer.d_ff=64")
    assert "by_precision" in message and "config files only" in message


def test_the_quickstarts_feed_forward_width_follows_the_precision() -> None:
    """512 where the 14 minutes bind (fp32, a CPU without native bf16), 1,024 where bf16 finishes the epochs."""
    path = ROOT / "configs" / "quickstart.yaml"
    assert load_config(path, ["train.precision=fp32"]).model.transformer.d_ff == 512
    assert load_config(path, ["train.precision=bf16"]).model.transformer.d_ff == 1024


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    cfg = load_config(None, ["optim.betas=[0.8, 0.9]", "model.transformer.norm=post", "data.src_lang=fr"])
    save_config(cfg, tmp_path / "saved.yaml")
    assert load_config(tmp_path / "saved.yaml") == cfg


# The CLI turns a ConfigError into one line and exit code 2.


def test_cli_bad_config_exits_2_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = write(tmp_path, "model:\n  d_modle: 64\n")
    proc = subprocess.run(
        [sys.executable, "-m", "seq2seq", "train", "--config", str(path)],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        env=single_thread_env(),
    )
    assert proc.returncode == 2
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "model.d_modle" in lines[0] and str(path) in lines[0] and "did you mean 'model.d_model'" in lines[0]
    assert proc.stdout == ""


def test_configs_without_the_architecture_keys_get_todays_transformer() -> None:
    """Checkpoints written before model.arch, norm_type, max_relative_distance and rnn existed load unchanged."""
    model = to_dict(ExperimentConfig())["model"]
    flat = {**{k: v for k, v in model.items() if k != "transformer"}, **model["transformer"]}
    for key in ("arch", "norm_type", "max_relative_distance"):
        del flat[key]
    old = from_dict({**to_dict(ExperimentConfig()), "model": flat})
    assert old == ExperimentConfig()
    assert old.model.transformer is not None and old.model.rnn is None
    assert (old.model.arch, old.model.transformer.norm_type, old.model.transformer.positions) == (
        "transformer",
        "layernorm",
        "sinusoidal",
    )


def test_config_files_of_the_flat_layout_load_as_before() -> None:
    """tests/data/old_tiny.yaml is configs/tiny.yaml as it was before model.transformer: the same experiment."""
    assert load_config(DATA / "old_tiny.yaml") == load_config(ROOT / "configs" / "tiny.yaml")
    assert load_config(DATA / "old_tiny.yaml", ["model.transformer.d_ff=64"]) is not None  # migrated, then overridden
    rnn = load_config(DATA / "old_rnn.yaml").model
    assert rnn.arch == "rnn" and rnn.transformer is None  # n_heads, d_ff, norm: ignored then, dropped now
    assert rnn.rnn == RNNConfig(cell="gru", layers=1, hidden_size=16)
    assert (rnn.d_model, rnn.dropout) == (16, 0.2)
    assert to_dict(load_config(DATA / "old_rnn.yaml"))["model"] == {
        "arch": "rnn",
        "d_model": 16,
        "dropout": 0.2,
        "max_positions": 512,
        "rnn": {
            "attention": "general",
            "bidirectional": True,
            "cell": "gru",
            "context_every_step": False,  # written before it existed: Sutskever et al.'s decoder, as then
            "hidden_size": 16,
            "layers": 1,
        },
        "share_all_embeddings": True,
        "share_decoder_embeddings": True,
    }


# Settings that moved out of train.* (optim, validation, checkpoint): old files, overrides and checkpoints.

NEW_KEYS = [
    "optim.optimizer=adamw",
    "optim.lr=3.0e-3",
    "optim.betas=[0.9, 0.99]",
    "optim.eps=1.0e-8",
    "optim.weight_decay=0.01",
    "optim.schedule=cosine",
    "optim.warmup_steps=50",
    "optim.label_smoothing=0.0",
    "optim.rdrop_alpha=0.5",
    "optim.clip_norm=2.0",
    "validation.every=100",
    "validation.bleu=false",
    "validation.best_metric=loss",
    "validation.patience=3",
    "checkpoint.every=25",
    "checkpoint.keep_last=4",
    "checkpoint.average_last=2",
]


def test_a_config_file_with_the_old_train_keys_loads_migrated_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """tests/data/old_train.yaml sets every moved setting at its old train.* key: the same experiment as the
    new keys give, and one line in the log that names each old key and its new place."""
    with caplog.at_level(logging.INFO, logger="seq2seq.config"):
        old = load_config(DATA / "old_train.yaml")
    notes = [r for r in caplog.records if r.name == "seq2seq.config"]
    assert len(notes) == 1 and notes[0].levelno == logging.WARNING
    for old_key, new_key in MOVED_TRAIN_KEYS.items():
        assert f"train.{old_key} is now {new_key}" in notes[0].getMessage()
    assert len(MOVED_TRAIN_KEYS) == len(NEW_KEYS)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="seq2seq.config"):
        new = load_config(DATA / "old_tiny.yaml", ["model.dropout=0.1", *NEW_KEYS, "train.max_epochs=10"])
        assert to_dict(new)["train"] == to_dict(old)["train"]
        assert (new.optim, new.validation, new.checkpoint) == (old.optim, old.validation, old.checkpoint)
        saved = yaml.safe_load(config_yaml(old))
        assert not set(saved["train"]) & set(MOVED_TRAIN_KEYS) and saved["validation"]["bleu"] is False
        caplog.clear()
        for path in (ROOT / "configs").glob("*.yaml"):  # the project's own configs use the new keys
            load_config(path)
    # (a `by_precision` block that applies here says so at INFO; a migration warns)
    assert not [r for r in caplog.records if r.name == "seq2seq.config" and r.levelno >= logging.WARNING]


def test_old_train_keys_on_the_command_line_are_migrated_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="seq2seq.config"):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", ["train.lr=0.5", "train.valid_bleu=false", "train.seed=3"])
    assert (cfg.optim.lr, cfg.validation.bleu, cfg.train.seed) == (0.5, False, 3)
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert messages == [
        "command line: train.lr is now optim.lr (the old keys are still read; write the new ones)",
        "command line: train.valid_bleu is now validation.bleu (the old keys are still read; write the new ones)",
    ]
    later = load_config(ROOT / "configs" / "tiny.yaml", ["optim.lr=0.25", "train.lr=0.5"])
    assert later.optim.lr == 0.5  # the last override wins, whichever name it uses
    assert apply_overrides(cfg, ["train.keep_last=7"]).checkpoint.keep_last == 7  # a checkpoint's decode overrides
    message = config_error(None, "train.patience=-1")
    assert "validation.patience must be >= 0" in message


def test_a_file_that_gives_a_setting_under_both_names_is_refused(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "train:\n  lr: 0.1\noptim:\n  lr: 0.2\n"))
    assert "train.lr is the old name of optim.lr, and both are given: keep optim.lr" in message
    assert "optim must be a mapping, got int" in config_error(write(tmp_path, "train:\n  lr: 0.1\noptim: 3\n"))


def test_checkpoints_storing_the_old_train_keys_load_migrated(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A checkpoint's stored config cannot be rewritten: read at the new keys, with a note (not a warning)."""
    stored = torch.load(DATA / "old_transformer.pt", weights_only=True)["config"]
    assert {"lr", "valid_bleu", "keep_last"} <= set(stored["train"])  # the old layout
    assert load_checkpoint(DATA / "old_transformer.pt").config.optim == ExperimentConfig().optim
    raw = ckpt.read(DATA / "old_transformer.pt").to_dict()
    old_train = {**raw["config"]["train"], "lr": 0.002, "valid_bleu": False, "keep_last": 3, "save_every": 7}
    old_keys = {new: old for old, new in MOVED_TRAIN_KEYS.items()}
    for section in ("optim", "validation", "checkpoint"):
        for key, value in raw["config"].pop(section).items():
            if f"{section}.{key}" in old_keys:  # not the settings added since (checkpoint.format)
                old_train.setdefault(old_keys[f"{section}.{key}"], value)
    raw["config"]["train"] = old_train
    raw["sha256"] = ckpt.content_hash(raw)
    torch.save(raw, tmp_path / "old.pt")
    caplog.clear()  # the reads above note too where an earlier test left seq2seq's loggers at INFO
    with caplog.at_level(logging.INFO, logger="seq2seq.config"):
        cfg = ckpt.read(tmp_path / "old.pt").config
    assert (cfg.optim.lr, cfg.validation.bleu, cfg.checkpoint.keep_last, cfg.checkpoint.every) == (0.002, False, 3, 7)
    [note] = [r for r in caplog.records if r.name == "seq2seq.config"]
    assert note.levelno == logging.INFO
    assert note.getMessage().endswith(
        "old.pt (stored config): written with 17 settings at their old train.* keys, read at their new ones"
    )
    ckpt.save(tmp_path / "again.pt", ckpt.read(tmp_path / "old.pt"))
    resaved = torch.load(tmp_path / "again.pt", weights_only=True)["config"]
    assert resaved["optim"]["lr"] == 0.002 and not set(resaved["train"]) & set(MOVED_TRAIN_KEYS)


def test_the_migration_leaves_todays_layout_alone() -> None:
    model = to_dict(load_config(ROOT / "configs" / "m30k_de_en_rnn.yaml"))["model"]
    assert migrate_model(model, "x") == model
    model = to_dict(ExperimentConfig())["model"]
    assert migrate_model(model, "x") == model


@pytest.mark.parametrize(
    ("text", "overrides", "needle"),
    [
        (
            "model:\n  arch: rnn\n  transformer:\n    d_ff: 64\n",
            [],
            "model.transformer.d_ff does not apply to model.arch: rnn",
        ),
        ("model:\n  rnn:\n    cell: gru\n", [], "model.rnn.cell does not apply to model.arch: transformer"),
        ("model:\n  arch: transformer\n  rnn: {}\n", [], "model.rnn does not apply to model.arch: transformer"),
        ("model:\n  transformer:\n    n_heads: 2\n", ["model.arch=rnn"], "model.transformer.n_heads does not apply"),
        ("model:\n  arch: rnn\n", ["model.transformer.norm=post"], "model.transformer.norm does not apply"),
        ("model:\n  transformer:\n    n_heads: 2\n", ["model.d_ff=64"], "model.d_ff is a Transformer setting"),
        ("model:\n  d_ff: 64\n  transformer:\n    n_heads: 2\n", [], "write it as model.transformer.d_ff"),
    ],
)
def test_settings_of_the_architecture_not_chosen_are_refused_naming_the_key(
    tmp_path: Path, text: str, overrides: list[str], needle: str
) -> None:
    message = config_error(write(tmp_path, text), *overrides)
    assert needle in message and "exp.yaml" in message


def test_the_command_line_switches_architecture_by_dropping_the_files_section() -> None:
    cfg = load_config(ROOT / "configs" / "tiny.yaml", ["model.arch=rnn", "model.transformer=null"])
    assert cfg.model.arch == "rnn" and cfg.model.transformer is None and cfg.model.rnn == RNNConfig()
    assert from_dict(to_dict(cfg)) == cfg
    assert "transformer" not in to_dict(cfg)["model"]


def test_rdrop_counts_only_the_chosen_architectures_dropout() -> None:
    message = config_error(None, "model.arch=rnn", "model.dropout=0", "optim.rdrop_alpha=1")
    assert "optim.rdrop_alpha compares two dropout passes" in message
    assert load_config(None, ["model.dropout=0", "model.transformer.attention_dropout=0.1", "optim.rdrop_alpha=1"])


@pytest.mark.parametrize(
    "override",
    [
        "model.d_model=1099511627776",
        "model.transformer.n_heads=4096",
        "model.transformer.d_ff=1099511627776",
        "model.transformer.encoder_layers=100000",
        "model.transformer.decoder_layers=100000",
        "model.max_positions=1099511627776",
        "model.transformer.max_relative_distance=1099511627776",
        "model.rnn.layers=100000",
        "model.rnn.hidden_size=1099511627776",
        "decode.beam_size=1099511627776",
        "data.sampling_nbest=1099511627776",
    ],
)
def test_absurd_sizes_are_refused_with_their_limit(override: str) -> None:
    """Sizes that fit in int64 but no memory: refused at load time, naming the key and the allowed range."""
    key = override.split("=")[0]
    arch = [f"model.arch={key.split('.')[1]}"] if key.startswith(("model.rnn.", "model.decoder_only.")) else []
    assert f"{key} must be at most " in config_error(None, *arch, override)


def test_average_last_needs_as_many_kept_checkpoints() -> None:
    message = config_error(None, "checkpoint.keep_last=0", "checkpoint.average_last=3")
    assert "checkpoint.average_last (3) must not exceed checkpoint.keep_last (0)" in message


def test_yaml_aliases_are_refused(tmp_path: Path) -> None:
    """A few nested aliases expand a few KB into gigabytes; anchors without aliases are harmless."""
    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\nb: &b [*a, *a, *a, *a, *a, *a, *a, *a, *a]\n"
    assert "exp.yaml:2: YAML aliases (*name) are not supported" in config_error(write(tmp_path, bomb))
    assert load_config(write(tmp_path, "train: &t\n  seed: 3\n")).train.seed == 3
    assert "optim.betas" in config_error(None, "optim.betas=[&x 0.9, *x]")  # kept as text, then refused


def test_a_key_given_twice_is_refused_with_its_line(tmp_path: Path) -> None:
    """YAML would keep the second silently: an edit to the first would change nothing."""
    twice = "train:\n  lr: 1.0e-3\n  seed: 3\n  lr: 2.0e-3\n"
    assert "exp.yaml:4: 'lr' is given twice in the same section" in config_error(write(tmp_path, twice))
    sections = "train:\n  lr: 1.0e-3\ndecode:\n  beam_size: 2\ntrain:\n  seed: 3\n"
    assert "exp.yaml:5: 'train' is given twice" in config_error(write(tmp_path, sections))
    same_name_elsewhere = "train:\n  seed: 3\ndecode:\n  seed: 4\n"
    cfg = load_config(write(tmp_path, same_name_elsewhere))
    assert (cfg.train.seed, cfg.decode.seed) == (3, 4)


def test_config_files_must_be_small_regular_files(tmp_path: Path) -> None:
    assert "/dev/zero: not a regular file" in config_error(Path("/dev/zero"))
    assert "Is a directory" in config_error(tmp_path)
    big = write(tmp_path, "# padding\n" * 200_000)
    assert "larger than 1 MiB; not a config file" in config_error(big)


@pytest.mark.parametrize(("value", "expected"), [("auto", "auto"), ("2", 2), ("0", 0)])
def test_num_workers_takes_a_count_or_auto(value: str, expected: int | str) -> None:
    assert load_config(TINY, [f"train.num_workers={value}"]).train.num_workers == expected


@pytest.mark.parametrize(
    ("value", "message"), [("x", "train.num_workers must be int or 'auto'; got 'x'"), ("65", "must be in [0, 64]")]
)
def test_num_workers_refuses_anything_else_naming_the_key(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(TINY, [f"train.num_workers={value}"])


def test_auto_workers_are_none_on_the_cpu_and_a_few_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a worker would take a core from the model; on CUDA sampling in the main process starves the GPU,
    so a core is left to the training process and at most 4 work ahead."""
    cuda = torch.device("cuda")
    for cores, workers in ((16, 4), (3, 2), (1, 0)):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        assert data_workers("auto", torch.device("cpu")) == 0 and data_workers("auto", cuda) == workers
    assert data_workers(3, torch.device("cpu")) == 3 and data_workers(0, cuda) == 0


def out_of_bounds(s: Setting) -> list[tuple[str, str]]:
    """(a value just outside each bound of setting s, as an override's text; what its message must say)."""
    spec, cases = s.spec, []
    if spec.min is not None or spec.above is not None:
        cases.append((spec.min - 1 if spec.min is not None else spec.above, f"must be {spec.bounds()}"))
    if spec.max is not None or spec.below is not None:
        cases.append((spec.max + 1 if spec.max is not None else spec.below, f"must be {spec.bounds()}"))
    if spec.limit is not None:
        cases.append((spec.limit + 1, f"must be at most {spec.limit}"))
    cases = [(v, "is out of range" if abs(v) >= 2**63 else needle) for v, needle in cases]  # int64: read as such
    shown = [(f"[{v}, {v}]" if typing.get_origin(s.kind) is tuple else repr(v), needle) for v, needle in cases]
    return [(f"{s.key}={text}", needle) for text, needle in shown]


BOUND_CASES = [case for s in settings() for case in out_of_bounds(s)]


@pytest.mark.parametrize(("override", "needle"), BOUND_CASES, ids=[o for o, _ in BOUND_CASES])
def test_every_bound_of_the_schema_is_checked_naming_the_key(override: str, needle: str) -> None:
    """Each bound declared with a setting refuses the value just past it, in one line naming the key."""
    key = override.split("=")[0]
    arch = [f"model.arch={key.split('.')[1]}"] if key.startswith(("model.rnn.", "model.decoder_only.")) else []
    assert f"{key} {needle}; got " in config_error(None, *arch, override)


def test_every_setting_has_its_help() -> None:
    assert len(BOUND_CASES) > 40
    for s in settings():
        assert s.spec.help.strip(), s.key


# The configuration reference of docs/guide.md is generated from the settings.


def test_the_guides_configuration_reference_is_generated_from_the_settings() -> None:
    """A setting added, or its default, bounds or help changed, without regenerating the table fails here."""
    assert reference_in(ROOT / "docs" / "guide.md") == reference_table(), (
        "docs/guide.md's configuration reference is stale: run `seq2seq config --reference docs/guide.md`"
    )


def test_config_reference_prints_the_table_or_writes_it_between_the_markers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "--reference"]) == 0 and capsys.readouterr().out == reference_table()
    doc = tmp_path / "doc.md"
    doc.write_text(f"# Settings\n\n{REFERENCE_START}\n| old |\n{REFERENCE_END}\n\nafter\n", encoding="utf-8")
    assert main(["config", "--reference", str(doc)]) == 0 and "updated" in capsys.readouterr().out
    text = doc.read_text(encoding="utf-8")
    assert text == f"# Settings\n\n{REFERENCE_START}\n{reference_table()}{REFERENCE_END}\n\nafter\n"
    assert main(["config", "--reference", str(doc)]) == 0 and "already up to date" in capsys.readouterr().out
    assert doc.read_text(encoding="utf-8") == text
    doc.write_text("no markers\n", encoding="utf-8")
    assert main(["config", "--reference", str(doc)]) == 1 and "markers" in capsys.readouterr().err
