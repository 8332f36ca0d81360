"""Every shipped config loads and validates, so a recipe never fails at its start."""

from __future__ import annotations

from pathlib import Path

import pytest

from seq2seq.config import load_config
from seq2seq.model import build_model

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_builds_its_model(path: Path) -> None:
    cfg = load_config(path)
    assert cfg.data.src_lang != cfg.data.tgt_lang
    model = build_model(cfg.model, cfg.data.vocab_size, cfg.data.vocab_size)
    assert sum(p.numel() for p in model.parameters()) > 0


def test_shipped_configs_write_to_different_run_dirs() -> None:
    run_dirs = [load_config(p).train.run_dir for p in CONFIGS]
    assert len(set(run_dirs)) == len(run_dirs)
