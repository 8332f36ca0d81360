"""Checkpoint files: the typed format, atomic writes, checksums, clear errors, run ids, averaging."""

from __future__ import annotations

import dataclasses
import errno
import functools
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import TINY, reversal_pairs

from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, RNNConfig, TransformerConfig, apply_overrides, load_config, to_dict
from seq2seq.decoding.translate import Translator
from seq2seq.errors import CheckpointError
from seq2seq.model import Seq2SeqModel, build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import (
    Checkpoint,
    Progress,
    TrainingState,
    atomic_save,
    average_checkpoints,
    load_checkpoint,
    remove_stale_temporaries,
)
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.tokenizer import Tokenizer, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    src, tgt = reversal_pairs(300, seed=0)
    return train_tokenizer(src, tgt, 64, shared=True)


@pytest.fixture(scope="module")
def cfg() -> ExperimentConfig:
    return load_config(TINY)


def model_with_seed(cfg: ExperimentConfig, tokenizer: Tokenizer, seed: int) -> Seq2SeqModel:
    torch.manual_seed(seed)
    return build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)


def save_model(
    path: Path, model: torch.nn.Module, tokenizer: Tokenizer, cfg: ExperimentConfig, run_id: str = "r1"
) -> None:
    ckpt.save(path, Checkpoint(cfg, tokenizer, model.state_dict(), run_id))


ARCHITECTURES = {
    "transformer": [],
    "rope-rmsnorm-post": [
        "model.transformer.positions=rope",
        "model.transformer.norm_type=rmsnorm",
        "model.transformer.norm=post",
    ],
    "relative": ["model.transformer.positions=relative"],
    "t5-bias": ["model.transformer.positions=t5_bias"],
    "none": ["model.transformer.positions=none"],
    "rnn-lstm-mlp": ["model.arch=rnn", "model.transformer=null", "model.rnn.attention=mlp", "model.rnn.hidden_size=32"],
    "rnn-gru-none-unidirectional": [
        "model.arch=rnn",
        "model.transformer=null",
        "model.rnn.cell=gru",
        "model.rnn.attention=none",
        "model.rnn.bidirectional=false",
        "model.share_all_embeddings=false",
    ],
    "decoder_only-prefix": ["model.arch=decoder_only", "model.max_positions=256"],
    "decoder_only-causal-rope": [
        "model.arch=decoder_only",
        "model.decoder_only.prefix=causal",
        "model.decoder_only.source_loss=0.5",
        "model.transformer.positions=rope",
        "model.max_positions=256",
    ],
    "rnn-gru-none-context": [
        "model.arch=rnn",
        "model.transformer=null",
        "model.rnn.cell=gru",
        "model.rnn.attention=none",
        "model.rnn.context_every_step=true",
        "model.rnn.hidden_size=32",
    ],
}


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_round_trip_gives_identical_logits(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer, arch: str
) -> None:
    cfg = apply_overrides(cfg, ARCHITECTURES[arch])
    model = model_with_seed(cfg, tokenizer, 0).eval()
    save_model(tmp_path / "c.pt", model, tokenizer, cfg)
    loaded = load_checkpoint(tmp_path / "c.pt")
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    tgt = torch.tensor([[1, 5, 6], [1, 8, 9]])
    with torch.no_grad():
        logits = model(src, src == 0, tgt)
        assert torch.equal(loaded.model(src, src == 0, tgt), logits)
        # The comparison can fail: a model of the same shape with other weights disagrees.
        assert not torch.allclose(model_with_seed(cfg, tokenizer, 123).eval()(src, src == 0, tgt), logits, atol=1e-3)
    assert loaded.config == cfg and loaded.tokenizer.state() == tokenizer.state() and loaded.checkpoint.training is None
    assert loaded.checkpoint.run_id == "r1"


def test_a_fixed_vector_rnn_saved_before_context_every_step_existed_loads_as_it_was(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    cfg = apply_overrides(cfg, ARCHITECTURES["rnn-gru-none-unidirectional"])
    model = model_with_seed(cfg, tokenizer, 0).eval()
    save_model(tmp_path / "c.pt", model, tokenizer, cfg)
    stored = torch.load(tmp_path / "c.pt", weights_only=True)
    del stored["config"]["model"]["rnn"]["context_every_step"]  # as it was written then
    stored.pop("sha256")
    stored["sha256"] = ckpt.content_hash(stored)
    torch.save(stored, tmp_path / "older.pt")
    loaded = load_checkpoint(tmp_path / "older.pt")
    assert loaded.config == cfg and loaded.config.model.rnn is not None
    assert not loaded.config.model.rnn.context_every_step
    src = torch.tensor([[5, 6, 7, 2], [8, 9, 2, 0]])
    tgt = torch.tensor([[1, 5, 6], [1, 8, 9]])
    with torch.no_grad():
        assert torch.equal(loaded.model(src, src == 0, tgt), model(src, src == 0, tgt))


def test_a_checkpoint_of_a_model_on_any_device_is_written_in_cpu_memory_and_reads_back_equal(
    tmp_path: Path, tokenizer: Tokenizer, device: torch.device
) -> None:
    cfg = load_config(TINY)
    model = model_with_seed(cfg, tokenizer, 0).to(device)
    optimizer = torch.optim.Adam(model.parameters())
    tokens = torch.full((2, 3), 5, device=device)
    model(tokens, tokens == 0, tokens).sum().backward()
    optimizer.step()
    training = TrainingState(Progress(step=1, epoch=1), optimizer.state_dict(), {})
    ckpt.save(tmp_path / "c.pt", Checkpoint(cfg, tokenizer, model.state_dict(), "r1", training=training))

    raw = torch.load(tmp_path / "c.pt", weights_only=True)  # no map_location: the file itself says where
    loaded = ckpt.read(tmp_path / "c.pt")
    for name, tensor in model.state_dict().items():
        assert raw["model"][name].device.type == "cpu", name
        assert torch.equal(loaded.model[name], tensor.cpu()), name
    for state in raw["train_state"]["optimizer"]["state"].values():
        assert all(value.device.type == "cpu" for value in state.values())
    embedding, output = raw["model"]["encoder.embedding.tokens.weight"], raw["model"]["decoder.output.weight"]
    assert embedding.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()  # tied: stored once


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"format": "old"}, path)
    with pytest.raises((pickle.PicklingError, AttributeError)):
        atomic_save({"unpicklable": lambda: None}, path)
    assert torch.load(path, weights_only=False) == {"format": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


def test_stale_temporaries_are_removed(tmp_path: Path) -> None:
    (tmp_path / ".checkpoint_last.pt.abc123.tmp").write_bytes(b"partial")
    (tmp_path / "notes.tmp").write_text("not ours")
    assert [p.name for p in remove_stale_temporaries(tmp_path)] == [".checkpoint_last.pt.abc123.tmp"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.tmp"]


def test_damaged_or_foreign_files_give_one_line_errors(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    save_model(tmp_path / "good.pt", model_with_seed(cfg, tokenizer, 0), tokenizer, cfg)
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ckpt.read(tmp_path / "truncated.pt")
    torch.save({"weights": 1}, tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="not a seq2seq checkpoint"):
        ckpt.read(tmp_path / "foreign.pt")
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        ckpt.read(tmp_path / "missing.pt")
    with pytest.raises(CheckpointError, match="is a directory, not a checkpoint file"):
        ckpt.read(tmp_path)


def test_flipped_bytes_fail_the_checksum(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    model = model_with_seed(cfg, tokenizer, 0)
    save_model(tmp_path / "good.pt", model, tokenizer, cfg)
    data = bytearray((tmp_path / "good.pt").read_bytes())
    # Flip four bytes inside the largest tensor's storage (found by its bytes), not in zip headers.
    weight = next(iter(sorted(model.state_dict().values(), key=lambda t: -t.numel())))
    start = bytes(data).index(weight.detach().reshape(-1)[:64].numpy().tobytes()) + 128
    data[start : start + 4] = bytes(b ^ 0xFF for b in data[start : start + 4])
    (tmp_path / "flipped.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.read(tmp_path / "flipped.pt")


def test_python_objects_are_refused_as_unsafe(tmp_path: Path) -> None:
    torch.save({"format": "seq2seq-checkpoint", "payload": Path("x")}, tmp_path / "objects.pt")
    with pytest.raises(CheckpointError, match="refused as unsafe") as error:
        ckpt.read(tmp_path / "objects.pt")
    assert "weights_only=False" not in str(error.value)


def test_typed_fields_are_checked(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    good = Checkpoint(cfg, tokenizer, model_with_seed(cfg, tokenizer, 0).state_dict(), "r1").to_dict()
    for field, value, message in [
        ("tokenizer", {"src": b"garbage", "tgt": None}, "SentencePiece model is unusable"),
        ("tokenizer", None, "tokenizer must be dict"),
        ("model", {"w": [1, 2]}, "model.w must be Tensor"),
        ("run_id", 7, "run_id must be str"),
        ("version", 99, "version 99 is not supported"),
        ("train_state", {"progress": {"step": "3"}, "optimizer": {}, "scaler": {}}, "progress.step must be int"),
        ("step", "3", "step must be int or NoneType"),
        ("step", -1, "step must be in"),
        ("step", True, "step must be in"),
    ]:
        with pytest.raises(CheckpointError, match=message):
            Checkpoint.from_dict({**good, field: value}, "crafted.pt")


def test_training_state_round_trips(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    model = model_with_seed(cfg, tokenizer, 0)
    optimizer = torch.optim.Adam(model.parameters())
    progress = Progress(step=7, epoch=2, batch_in_epoch=3, best=1.5, best_metric="loss", elapsed=12.0)
    state = TrainingState(progress, optimizer.state_dict(), {"scale": 1.0})
    ckpt.save(tmp_path / "last.pt", Checkpoint(cfg, tokenizer, model.state_dict(), "r1", state))
    loaded = ckpt.read(tmp_path / "last.pt")
    assert loaded.training is not None and loaded.training.progress == progress
    assert loaded.training.scaler == {"scale": 1.0} and loaded.run_id == "r1"


def test_the_step_of_the_weights_round_trips_and_older_files_have_none(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    """What a fine-tuning run names as its starting point; files written before it was kept read as unknown."""
    checkpoint = Checkpoint(cfg, tokenizer, model_with_seed(cfg, tokenizer, 0).state_dict(), "r1", step=42)
    ckpt.save(tmp_path / "best.pt", checkpoint)
    assert ckpt.read(tmp_path / "best.pt").step == 42
    older = checkpoint.to_dict()
    del older["step"]
    assert Checkpoint.from_dict(older, "older.pt").step is None


def test_a_config_asking_for_a_huge_model_is_refused_before_allocating(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    checkpoint = Checkpoint(cfg, tokenizer, model_with_seed(cfg, tokenizer, 0).state_dict(), "r1")
    huge = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, d_model=32768, transformer=TransformerConfig(n_heads=8, d_ff=131072))
    )
    ckpt.save(tmp_path / "huge.pt", dataclasses.replace(checkpoint, config=huge))  # 4 GiB+ if it were built
    with pytest.raises(CheckpointError, match="weights do not fit the stored config"):
        load_checkpoint(tmp_path / "huge.pt")


def test_a_full_disk_leaves_the_old_file_and_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "checkpoint_last.pt"
    atomic_save({"format": "old"}, path)

    def full(obj: object, f: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointError, match="no space left on the device; the previous file, if any, is intact"):
        atomic_save({"format": "new"}, path)
    monkeypatch.undo()
    assert torch.load(path, weights_only=False) == {"format": "old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_last.pt"]


def test_step_checkpoints_sort_by_number_and_prune_only_this_runs(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    run = RunDirectory(tmp_path)
    model = model_with_seed(cfg, tokenizer, 0)
    for step in (9, 10, 100, 2):
        save_model(run.step(step), model, tokenizer, cfg, run_id="mine")
    save_model(run.step(50), model, tokenizer, cfg, run_id="other")
    (tmp_path / "checkpoint_stepfoo.pt").write_bytes(b"x")
    assert [p.name for p in run.step_checkpoints("mine")] == [f"checkpoint_step{n}.pt" for n in (2, 9, 10, 100)]
    run.prune(2, "mine")
    names = ["checkpoint_step10.pt", "checkpoint_step100.pt"]
    assert [p.name for p in run.step_checkpoints("mine")] == names
    assert [p.name for p in run.step_checkpoints()] == ["checkpoint_step10.pt", "checkpoint_step50.pt", names[1]]


def test_average_is_the_mean_of_the_parameters(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    models = [model_with_seed(cfg, tokenizer, seed) for seed in range(3)]
    paths = [tmp_path / f"c{seed}.pt" for seed in range(3)]
    for model, path in zip(models, paths):
        save_model(path, model, tokenizer, cfg)
    average_checkpoints(paths, tmp_path / "avg.pt")
    averaged = ckpt.read(tmp_path / "avg.pt")
    assert averaged.training is None and averaged.averaged_from == [str(p) for p in paths]
    states = [m.state_dict() for m in models]
    for name, tensor in averaged.model.items():
        expected = sum(s[name].double() for s in states) / 3
        torch.testing.assert_close(tensor, expected.float(), rtol=0, atol=1e-7)
        assert tensor.dtype == states[0][name].dtype


def test_average_refuses_checkpoints_of_different_models(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer
) -> None:
    save_model(tmp_path / "a.pt", model_with_seed(cfg, tokenizer, 0), tokenizer, cfg)
    wider = load_config(TINY, ["model.transformer.d_ff=256"])
    save_model(tmp_path / "b.pt", model_with_seed(wider, tokenizer, 0), tokenizer, wider)
    with pytest.raises(CheckpointError, match="model.transformer.d_ff is 256, not 128"):
        average_checkpoints([tmp_path / "a.pt", tmp_path / "b.pt"], tmp_path / "avg.pt")
    with pytest.raises(CheckpointError, match="no checkpoints"):
        average_checkpoints([], tmp_path / "avg.pt")


def test_cli_averages_the_last_n_step_checkpoints_of_the_run_and_the_result_translates(
    tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    run = RunDirectory(tmp_path / "run")
    states = []
    for step in (1, 2, 3):
        model = model_with_seed(cfg, tokenizer, step)
        save_model(run.step(step), model, tokenizer, cfg, run_id="mine")
        states.append(model.state_dict())
    save_model(run.last, model, tokenizer, cfg, run_id="mine")
    save_model(run.step(4), model_with_seed(cfg, tokenizer, 9), tokenizer, cfg, run_id="earlier")  # not this run's
    out = tmp_path / "avg.pt"
    assert main(["average", "--run-dir", str(run.path), "--last", "2", "-o", str(out)]) == 0
    averaged = ckpt.read(out)
    assert averaged.averaged_from == [str(run.step(s)) for s in (2, 3)]
    for name, tensor in averaged.model.items():
        torch.testing.assert_close(tensor, ((states[1][name].double() + states[2][name].double()) / 2).float())
    translations = Translator.from_checkpoint(out).translate(["red cat dog", "sun"])
    assert len(translations) == 2 and all(isinstance(t, str) for t in translations)
    assert main(["average", "--run-dir", str(tmp_path / "nowhere"), "-o", str(out)]) == 1
    assert "run directory not found" in capsys.readouterr().err


def test_content_hash_is_unchanged_for_files_already_written() -> None:
    """The bounded walk gives the digest the unbounded one gave (computed with it), so stored hashes still verify."""
    raw = {
        "a": [1, 2.5, float("nan"), b"xy", None, "text", True],
        "t": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "e": torch.empty(0),
        "n": {3: (1, 2)},
    }
    expected = "b4eaedbf7c8e4d9cbdd48ebb227508a33cb6572058b8bf0e01d136510bfdde99"
    assert ckpt.content_hash(raw) == ckpt.content_hash(raw, file_size=10**6) == expected


def test_content_walk_is_bounded_by_the_file_size() -> None:
    numbers = [0] * 100
    shared = {"w": [numbers] * 100}  # 10,000 values from a pickle of a few hundred bytes
    with pytest.raises(CheckpointError, match="repeats shared parts"):
        ckpt.content_hash(shared, file_size=10)
    tied = torch.zeros(1000)  # tied embeddings: one tensor under three names
    assert ckpt.content_hash({"a": tied, "b": tied, "c": tied}, file_size=4000)
    with pytest.raises(CheckpointError, match="nested more than 32 levels"):
        ckpt.content_hash(functools.reduce(lambda inner, _: [inner], range(40), []))


def test_optimizer_state_must_describe_the_model(tmp_path: Path, cfg: ExperimentConfig, tokenizer: Tokenizer) -> None:
    model = model_with_seed(cfg, tokenizer, 0)
    optimizer = torch.optim.Adam(model.parameters())
    state = optimizer.state_dict()
    progress = ckpt.Progress()
    good = ckpt.TrainingState(progress, state, {})
    good.check_fits(optimizer, None, "x.pt")
    older = {**state, "param_groups": [{k: v for k, v in state["param_groups"][0].items() if k != "maximize"}]}
    ckpt.TrainingState(progress, older, {}).check_fits(optimizer, None, "x.pt")  # settings a newer torch added
    other = torch.optim.Adam(
        model_with_seed(load_config(TINY, ["model.transformer.encoder_layers=1"]), tokenizer, 0).parameters()
    )
    first = next(iter(model.parameters()))
    shapes = {**state, "state": {0: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(3), "exp_avg_sq": first}}}
    cases = [
        ({}, "param_groups must be list"),
        (other.state_dict(), "this model has"),
        ({**state, "param_groups": [{**state["param_groups"][0], "lr": "fast"}]}, "param_groups.0.lr must be"),
        (shapes, "state.0.exp_avg has shape (3,)"),
    ]
    for stored, needle in cases:
        with pytest.raises(CheckpointError, match=re.escape(needle)):
            ckpt.TrainingState(progress, stored, {}).check_fits(optimizer, None, "x.pt")
    with pytest.raises(CheckpointError, match="lacks 'scale'"):
        good.check_fits(optimizer, torch.amp.GradScaler("cpu", enabled=True), "x.pt")


DATA = Path(__file__).resolve().parent / "data"


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        (
            "old_transformer.pt",
            {
                "arch": "transformer",
                "transformer": TransformerConfig(
                    n_heads=2,
                    d_ff=16,
                    encoder_layers=1,
                    decoder_layers=1,
                    norm="post",
                    positions="learned",
                    activation="gelu",
                ),
                "rnn": None,
            },
        ),
        ("old_rnn.pt", {"arch": "rnn", "transformer": None, "rnn": RNNConfig("gru", 1, 8, False, "dot")}),
    ],
)
def test_checkpoints_of_the_flat_model_layout_load_and_resave_in_todays(
    tmp_path: Path, name: str, expected: dict[str, object]
) -> None:
    """tests/data holds checkpoints saved before model.transformer existed, each with every model key flat."""
    stored = torch.load(DATA / name, weights_only=True)
    assert "n_heads" in stored["config"]["model"] and "rnn" in stored["config"]["model"]  # the flat layout
    loaded = load_checkpoint(DATA / name)
    model = loaded.config.model
    assert {key: getattr(model, key) for key in expected} == expected
    assert model.d_model == (8 if model.arch == "transformer" else 9)
    ckpt.save(tmp_path / "again.pt", ckpt.read(DATA / name))
    resaved = torch.load(tmp_path / "again.pt", weights_only=True)["config"]["model"]
    assert "n_heads" not in resaved and resaved == to_dict(loaded.config)["model"]
    again = load_checkpoint(tmp_path / "again.pt")
    assert again.config == loaded.config
    weights, reread = loaded.model.state_dict(), again.model.state_dict()
    assert weights.keys() == reread.keys() and all(torch.equal(weights[k], reread[k]) for k in weights)


META_BUILD = """
import sys
from seq2seq.config import load_config
from seq2seq.model import build_model, on_meta
from seq2seq.model.masked_lm import build_masked_lm

for overrides in VARIANTS:
    cfg = load_config(sys.argv[1], overrides).model
    builds = [lambda: build_model(cfg, 60, 60 if cfg.share_all_embeddings else 70)]
    if cfg.arch == "transformer":
        builds.append(lambda: build_masked_lm(cfg, 60))
    for build in builds:
        with on_meta():
            meta = build()
        assert "torch._dynamo" not in sys.modules, (overrides, "a meta build imported torch._dynamo")
        real = build()
        assert all(t.is_meta for t in meta.state_dict().values()), overrides
        shapes = {k: t.shape for k, t in meta.state_dict().items()}
        assert shapes == {k: t.shape for k, t in real.state_dict().items()}, overrides
        assert {k: t.shape for k, t in meta.named_buffers()} == {k: t.shape for k, t in real.named_buffers()}
print("built", len(VARIANTS))
"""
META_VARIANTS = [
    [],
    ["model.transformer.positions=rope", "model.transformer.norm_type=rmsnorm"],
    ["model.transformer.positions=learned", "model.share_all_embeddings=false", "model.share_decoder_embeddings=false"],
    ["model.transformer.positions=relative"],
    ["model.transformer.positions=t5_bias"],
    ["model.transformer.attention=local_global"],
    ["model.transformer.attention=linformer"],
    ["model.arch=rnn", "model.transformer=null"],
    ["model.arch=decoder_only", "model.max_positions=256", "model.transformer.positions=rope"],
]


def test_a_meta_build_has_the_real_shapes_and_loads_nothing_of_torch_compile() -> None:
    """Checking a checkpoint builds its model on the meta device (`on_meta`): the same tensors as a real build,
    without drawing values, and without the seconds of importing torch._dynamo (which meta arithmetic and a meta
    `normal_` would import) in every command that loads a checkpoint. In a fresh process: this one imported it."""
    code = f"VARIANTS = {META_VARIANTS!r}\n{META_BUILD}"
    done = subprocess.run([sys.executable, "-c", code, str(TINY)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["built", str(len(META_VARIANTS))]
