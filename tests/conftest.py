"""Shared fixtures: a generated word-reversal task and a tiny model trained on it once."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from seq2seq.cli import main

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"
WORDS = "red blue green cat dog sun moon tree car house bird fish".split()


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


def tiny_overrides(corpus: Path, run_dir: Path, *extra: str) -> list[str]:
    return [f"data.dir={corpus}", "data.test=test", f"train.run_dir={run_dir}", *extra]


@pytest.fixture(scope="session")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("reversal"))


@pytest.fixture(scope="session")
def trained_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model trained through the CLI until it reverses sentences (about a minute on 2 cores)."""
    run_dir = tmp_path_factory.mktemp("runs") / "tiny"
    code = main(["train", "--config", str(TINY), *tiny_overrides(corpus, run_dir, "train.max_epochs=12")])
    assert code == 0
    return run_dir
