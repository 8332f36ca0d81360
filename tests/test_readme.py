"""The README's commands run as written, so the guide and the code cannot drift apart.

Every fenced block after a `<!-- readme-test -->` line runs, in order, in one
scratch directory that sees the project's `configs/` and `scripts/`, with the
installed `seq2seq` and `python` first on PATH. Blocks that take minutes (the
quickstart, the whole test suite) or never end (a server) are not marked.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

MARK = "<!-- readme-test -->"
BLOCK = re.compile(re.escape(MARK) + r"\n```bash\n(.*?)```", re.DOTALL)


def marked_blocks(text: str) -> list[str]:
    return BLOCK.findall(text)


def test_the_marker_is_only_used_before_bash_blocks() -> None:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert text.count(MARK) == len(marked_blocks(text)) >= 5


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[subprocess.CompletedProcess[str]]]:
    """Every marked block, run once in order (later blocks use what earlier ones made)."""
    work = tmp_path_factory.mktemp("readme")
    for name in ("configs", "scripts"):
        (work / name).symlink_to(ROOT / name)
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    results = []
    for block in marked_blocks((ROOT / "README.md").read_text(encoding="utf-8")):
        done = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True, text=True, timeout=600
        )
        results.append(done)
        assert done.returncode == 0, f"README block failed:\n{block}\n--- stderr:\n{done.stderr[-3000:]}"
    return work, results


@pytest.mark.trains  # the blocks train through `seq2seq train`
def test_every_marked_readme_block_runs(ran: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    work, results = ran
    assert all(r.returncode == 0 for r in results)
    assert (work / "runs/toy/checkpoint_best.pt").is_file() and (work / "runs/toy/ct2/model.bin").is_file()
    assert (work / "runs/toy-ft/checkpoint_best.pt").is_file()
    assert "initialized from" in (work / "runs/toy-ft/train.log").read_text()


@pytest.mark.trains
def test_the_readme_jobs_learn_their_toy_tasks(ran: tuple[Path, list[subprocess.CompletedProcess[str]]]) -> None:
    """The outputs the README's reader sees: BLEU from evaluate, translations that are sentences."""
    _, results = ran
    outputs = "\n".join(r.stdout for r in results)
    assert re.search(r"BLEU = \d", outputs)
    reversed_, copied = results[4].stdout.splitlines()[-2:]  # --tgt-lang tgt, then --tgt-lang same
    assert reversed_.split() and copied.split() and reversed_ != copied  # the tag chose the task


@pytest.mark.trains
def test_the_readme_fine_tunes_an_imported_model_past_its_parent(
    ran: tuple[Path, list[subprocess.CompletedProcess[str]]],
) -> None:
    """Start from a pretrained model: the fine-tuned import scores above its parent, and transformers
    loads its export (the block's last line is generate's translation)."""
    work, results = ran
    pretrained = next(r for r in results if "import-hf" in r.args[-1])
    parent, tuned = (float(b) for b in re.findall(r"^BLEU = ([\d.]+)", pretrained.stdout, re.MULTILINE))
    assert tuned > parent + 10
    assert (work / "runs/opus-ft/hf/model.safetensors").is_file()
    assert pretrained.stdout.splitlines()[-1].startswith("['")
