"""`train.compile`: batches padded to a bounded set of shapes, and a compiled forward pass that trains and
resumes as the eager one does.

Inductor takes 15-30 s per graph on a 2-core CPU, so the fast tests compile with the `aot_eager` backend
(Dynamo's graph capture and AOT autograd, without generating kernels): what `train.compile` adds to the
update (whole logits, padded rows, the graph per shape) is exercised all the same. The slow test runs
Inductor itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.model.build import build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import LAST
from seq2seq.text.corpus import Batch, bounded_shape, collate_pairs, length_bucket
from seq2seq.text.vocab import PAD
from seq2seq.training.loss import batch_loss
from seq2seq.training.monitor import read_metrics
from seq2seq.training.trainer import train
from seq2seq.training.update import Compiled

FAST = ("validation.bleu=false", "train.max_tokens=256", "train.max_epochs=1000", "train.threads=1")


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """150 pairs: 4 batches an epoch at 256 tokens, so a compiled run meets few shapes (each a graph of seconds)."""
    return write_corpus(tmp_path_factory.mktemp("small"), n_train=150)


@pytest.fixture
def aot_eager(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """torch.compile with the aot_eager backend, whatever mode is asked for; a fresh Dynamo cache."""
    real: Callable[..., Any] = torch.compile

    def compile_fast(model: Any, mode: str | None = None, dynamic: bool | None = None) -> Any:
        return real(model, backend="aot_eager", dynamic=dynamic)

    monkeypatch.setattr(torch, "compile", compile_fast)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def config(corpus: Path, run_dir: Path, *extra: str) -> ExperimentConfig:
    return load_config(TINY, tiny_overrides(corpus, run_dir, *FAST, *extra))


def random_batch(rows: int, src_len: int, tgt_len: int, seed: int = 0) -> Batch:
    rng = random.Random(seed)
    src = [[rng.randrange(4, 64) for _ in range(rng.randint(1, src_len - 1))] + [2] for _ in range(rows)]
    tgt = [[rng.randrange(4, 64) for _ in range(rng.randint(1, tgt_len - 1))] + [2] for _ in range(rows)]
    return collate_pairs(src, tgt)


def test_bounded_shapes_cover_every_batch_with_a_few_shapes_and_little_padding() -> None:
    rows = range(1, 4097)
    lengths = range(1, 513)
    assert all(length_bucket(n) >= n and length_bucket(n) % 8 == 0 for n in lengths)
    assert all(length_bucket(n) <= 1.25 * n for n in lengths if n > 32)
    assert len({length_bucket(n) for n in lengths}) <= 4 * 7  # 4 per octave above 8
    shapes = [bounded_shape(r, 1, 1)[0] for r in rows]
    assert all(s >= r and s % 8 == 0 for s, r in zip(shapes, rows))
    assert all(s <= 1.125 * r for s, r in zip(shapes, rows) if r > 64)
    assert len(set(shapes)) <= 8 * 9


def test_a_padded_batch_gives_the_same_loss_and_gradients(one_thread: None, aot_eager: None) -> None:
    cfg = load_config(TINY)
    torch.manual_seed(0)
    model = build_model(cfg.model, 64, 64)
    batch = random_batch(5, 9, 11)
    grown = batch.padded(*bounded_shape(5, 9, 11))
    assert grown.src.shape == (8, 16) and grown.tgt_in.shape == (8, 16) and grown.n_tokens == batch.n_tokens
    whole = Compiled(model, "default")  # every position's logits from the graph, the real ones selected after
    results = []
    for b, runner in ((batch, model), (grown, model), (grown, whole)):
        model.zero_grad()
        loss, nll = batch_loss(runner, b, 0.1)
        loss.backward()
        results.append((loss.detach(), nll, [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for loss, nll, grads in results[1:]:
        torch.testing.assert_close(loss, results[0][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(nll, results[0][1], rtol=1e-5, atol=1e-5)
        for g, g0 in zip(grads, results[0][2], strict=True):
            torch.testing.assert_close(g, g0, rtol=1e-4, atol=1e-6)


def test_padding_never_shrinks_a_batch() -> None:
    with pytest.raises(ValueError, match="cannot shrink"):
        random_batch(4, 8, 8).padded(2, 8, 8)


@pytest.mark.trains
def test_bounded_epochs_hold_the_same_pairs_in_the_bounded_shapes(small: Path, tmp_path: Path) -> None:
    from seq2seq.training.assembly import assemble

    plain = assemble(config(small, tmp_path / "plain"))
    bounded = assemble(config(small, tmp_path / "bounded", "train.compile=default"))
    try:
        for j in range(len(plain.epochs.batches(1))):
            a, b = plain.epochs.batch(1, j), bounded.epochs.batch(1, j)
            (rows, s), t = a.src.shape, a.tgt_in.shape[1]
            assert b.src.shape + b.tgt_in.shape[1:] == bounded_shape(rows, s, t)
            assert torch.equal(b.src[:rows, :s], a.src) and torch.equal(b.tgt_out[:rows, :t], a.tgt_out)
            assert (b.src[:, s:] == PAD).all() and (b.tgt_out[rows:] == PAD).all() and b.n_tokens == a.n_tokens
    finally:
        plain.close()
        bounded.close()


@pytest.mark.trains
def test_a_compiled_run_resumes_exactly(small: Path, tmp_path: Path, aot_eager: None) -> None:
    """Dropout on (padded shapes draw their own masks), stopped mid-epoch, across an epoch end: the compiled run
    resumes to the weights of its uninterrupted twin."""
    compiled = ("model.dropout=0.2", "model.transformer.attention_dropout=0.1", "optim.warmup_steps=4")
    compiled += ("train.compile=default",)
    whole = train(config(small, tmp_path / "whole", *compiled, "train.max_steps=6"))
    train(config(small, tmp_path / "part", *compiled, "train.max_steps=2"))  # mid-epoch: an epoch is 4 updates
    torch._dynamo.reset()  # a resumed run starts in a new process: nothing compiled yet
    resumed = train(config(small, tmp_path / "part", *compiled, "train.max_steps=6"))
    assert whole.epoch == 2 and (resumed.step, resumed.epoch) == (whole.step, whole.epoch)
    a, b = (ckpt.read(tmp_path / name / LAST).model for name in ("whole", "part"))
    assert all(torch.equal(a[name], b[name]) for name in a)
    log = (tmp_path / "whole" / "train.log").read_text()
    assert "torch.compile: 1 graph(s) so far; update 1 compiled batches of" in log


@pytest.mark.trains
def test_without_dropout_a_compiled_run_trains_as_the_eager_one(small: Path, tmp_path: Path, aot_eager: None) -> None:
    """Padding and whole logits change no real token's loss: the same loss at every update, within rounding
    (weights drift further: Adam's first steps move a near-zero gradient by about lr whatever its size)."""
    settings = ("model.dropout=0", "optim.warmup_steps=4", "train.max_steps=8", "train.log_every=1")
    train(config(small, tmp_path / "eager", *settings))
    train(config(small, tmp_path / "compiled", *settings, "train.compile=default"))
    eager, compiled = ([r["loss"] for r in read_metrics(tmp_path / n / "metrics.jsonl") if r["event"] == "train"]
                       for n in ("eager", "compiled"))  # fmt: skip
    assert len(eager) == 8
    torch.testing.assert_close(torch.tensor(compiled), torch.tensor(eager), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
@pytest.mark.trains
def test_train_compile_with_inductor_from_the_cli(small: Path, tmp_path: Path) -> None:
    torch._dynamo.reset()
    overrides = tiny_overrides(small, tmp_path / "run", *FAST, "train.compile=default", "train.max_steps=8")
    assert main(["train", "--config", str(TINY), *overrides]) == 0
    log = (tmp_path / "run" / "train.log").read_text()
    graphs = [line for line in log.splitlines() if "torch.compile:" in line]
    assert graphs and len(graphs) <= 8  # at most a graph per update, each logged
    assert "training finished at step 8" in log
