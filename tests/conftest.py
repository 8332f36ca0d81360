"""Shared fixtures: a generated word-reversal task and a tiny model trained on it once."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from filelock import FileLock

from seq2seq.cli import main
from seq2seq.config import ModelConfig, TransformerConfig, migrate_model
from seq2seq.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, for the CUDA runs below
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")),
]
TINY = ROOT / "configs" / "tiny.yaml"
WORDS = "red blue green cat dog sun moon tree car house bird fish".split()


# A shell starts a background job (`bash scripts/check.sh &`, `nohup ...`) with SIGINT ignored, and Python then
# leaves it ignored in itself and in every process it starts: no Ctrl-C the tests send would arrive. So the test
# processes (each xdist worker loads this file) take Python's own handler back, as if started from a terminal; the
# processes they start then get SIGINT's default again (exec resets a handled signal).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


# Which tests train a model. Their outcomes move with the CPU's kernels, so `scripts/cpu_kinds.sh` runs them once
# per emulated CPU kind: `@pytest.mark.trains` says a test trains, and the hooks below keep that list true. A test
# that runs `Trainer.fit` in this process (itself or through a fixture, the shared `trained_run` included) without
# the mark ends in an error naming it; a test whose training runs in a subprocess is marked by hand.
_fits: list[str] = []
_fit = Trainer.fit


def _counted_fit(self: Trainer) -> Any:
    _fits.append(str(self.run.path))
    return _fit(self)


Trainer.fit = _counted_fit  # type: ignore[method-assign]


# The files that take longest (seconds of one test process on a 2-core AVX2-only CPU, where the suite is slowest),
# run first: `scripts/check.sh` hands whole files to its two test processes in collection order, one more to a
# process whenever it runs out, so a long file started last would leave the other process idle for minutes.
# test_export.py goes before them all: its first test trains the shared `trained_run`, which most files wait for,
# and the README's file beside it does not need it (started later, another file's process waited 36 s for it).
FIRST_FILE = "test_export.py"
LONGEST_FILES = {
    "test_readme.py": 201,
    "test_recipe.py": 167,
    "test_export.py": 159,
    "test_hostile.py": 143,
    "test_scripts.py": 111,
    "test_bad_input.py": 84,
    "test_training.py": 81,
    "test_compile.py": 70,
    "test_signals.py": 67,
    "test_stopping.py": 60,
    "test_multilingual.py": 55,
    "test_serve.py": 54,
    "test_search.py": 52,
    "test_run_dir.py": 47,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "trained_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.trains)  # the shared trained model: every user depends on its training
    # longest files first, each file's tests in their order (a stable sort), the others after them as collected
    items.sort(key=lambda item: (item.path.name != FIRST_FILE, -LONGEST_FILES.get(item.path.name, 0)))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    _fits.clear()  # before the test's fixtures are set up: a session fixture that trains counts for its first user


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    if _fits and item.get_closest_marker("trains") is None:
        trained = ", ".join(sorted(set(_fits)))
        _fits.clear()
        pytest.fail(f"{item.nodeid} trains a model ({trained}) but is not marked @pytest.mark.trains", pytrace=False)


def reversal_pairs(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Sentences of 2-7 words; the target is the same words in reverse order."""
    rng = random.Random(seed)
    src = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) for _ in range(n)]
    return src, [" ".join(reversed(s.split())) for s in src]


def write_corpus(directory: Path, n_train: int = 3000, seed: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, split_seed in (("train", n_train, seed), ("val", 100, seed + 1), ("test", 100, seed + 2)):
        src, tgt = reversal_pairs(n, split_seed)
        (directory / f"{split}.src").write_text("\n".join(src) + "\n", encoding="utf-8")
        (directory / f"{split}.tgt").write_text("\n".join(tgt) + "\n", encoding="utf-8")
    return directory


def write_multi_corpus(directory: Path, n_train: int = 2000) -> Path:
    """train/val/test .src, .rev (reversed) and .same (copied): the two pairs share their source files."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, seed in (("train", n_train, 0), ("val", 60, 1), ("test", 60, 2)):
        src, rev = reversal_pairs(n, seed)
        for lang, lines in (("src", src), ("rev", rev), ("same", src)):
            (directory / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return directory


def tiny_overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.dir={corpus}", "data.test=test", f"train.run_dir={run_dir}", *extra]


def decodes_and_evaluates(
    best: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], nbest: int = 3, strategies: tuple[str, ...] = ()
) -> None:
    """`translate` with beam n-best (JSONL, `nbest` each) and with each other search, then `evaluate`, through
    the CLI on checkpoint `best`; each exits 0, and evaluate prints BLEU."""
    source = tmp_path / "in.txt"
    source.write_text("red cat dog\nblue sun\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    argv = ["translate", "-c", best, "-i", str(source), "-o", str(out)]
    assert main([*argv, "--format", "jsonl", f"decode.nbest={nbest}", f"decode.beam_size={nbest}"]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [len(r["nbest"]) for r in records] == [nbest, nbest]
    for strategy in strategies:
        assert main([*argv[:-1], str(tmp_path / f"{strategy}.txt"), f"decode.strategy={strategy}"]) == 0
    assert main(["evaluate", "-c", best]) == 0
    assert "BLEU" in capsys.readouterr().out


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """`name` in a directory shared by every test process of this run, made by `make(path)` in the first process
    that asks for it (under a file lock; the others wait, then read the same files: built once for the run, not
    once per process). Its users only read it."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # where the xdist workers' roots are
    path, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # what a process that failed here left
            make(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return made_once(tmp_path_factory, "reversal", write_corpus)


@pytest.fixture(scope="session")
def trained_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained through the CLI until it reverses sentences (~97% exact; 15-40 s on 2 shared cores),
    once for the whole run (`made_once`).

    One thread: with torch's default (a thread per core) this run took 20x longer while other
    processes shared the two cores; a model this small gains little from a second thread anyway.
    fp32 explicitly: `auto` is bf16 on CPUs with native bf16, and what the model learns must not
    depend on the CPU kind the tests run on.
    """

    def train(directory: Path) -> None:
        settings = ("train.max_epochs=30", "train.threads=1", "train.precision=fp32")
        assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, directory / "tiny", *settings)]) == 0

    return made_once(tmp_path_factory, "trained_run", train) / "tiny"  # the run's name: what `serve` shows


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run a test's tensor work on one thread (tiny tensors gain nothing from more; shared cores lose a lot)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> Iterator[torch.device]:
    """Where an equivalence test runs: the CPU, and CUDA too when there is a GPU (`scripts/gpu_check.sh`).

    On CUDA without TF32 and with deterministic kernels where torch has them, so that what is exact on
    the CPU (a resume, an accumulation) is exact there too.
    """
    where = torch.device(request.param)
    if where.type != "cuda":
        yield where
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield where
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def single_thread_env() -> dict[str, str]:
    """The environment for a `python -m seq2seq` subprocess, limited to one thread like the tests themselves."""
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def model_config(**settings: Any) -> ModelConfig:
    """A ModelConfig from keyword arguments in the flat layout (n_heads=2, arch="rnn", rnn=RNNConfig(...)):
    the Transformer's keys go to model.transformer, or are dropped for an RNN, as config files' are."""
    model = migrate_model(settings, "model_config")
    transformer = model.pop("transformer", None)
    return ModelConfig(**model, transformer=None if transformer is None else TransformerConfig(**transformer))
