"""Data-parallel training: 2 gloo processes under torchrun (on one node, or as two nodes) equal 1 process
accumulating their 2 batches."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, TINY, tiny_overrides, write_corpus

from seq2seq.config import load_config
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import LAST
from seq2seq.training.trainer import train

# Dropout on: rank r draws the masks of micro-batch r, exactly as the single process does.
COMMON = (
    "model.dropout=0.2",
    "train.max_steps=4",
    "validation.bleu=false",
    "train.max_tokens=256",
    "train.log_every=1",
    "train.threads=1",
)


@pytest.mark.trains  # torchrun's two workers, and one process here
@pytest.mark.parametrize(
    ("device", "extra"),
    [
        ("cpu", ()),
        ("cpu", ("optim.rdrop_alpha=2",)),  # each rank's two passes in one forward: one backward for DDP to reduce
        pytest.param("cuda", (), marks=pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")),
    ],
)
def test_two_processes_match_one_process_with_the_doubled_batch(
    tmp_path: Path, device: str, extra: tuple[str, ...]
) -> None:
    """gloo on the CPU, NCCL with one GPU a process on CUDA; with R-Drop too."""
    corpus = write_corpus(tmp_path / "corpus", n_train=600)
    ddp_run, single_run = tmp_path / "ddp", tmp_path / "single"
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "seq2seq",
        "train",
        "--config",
        str(TINY),
        *tiny_overrides(corpus, ddp_run, *COMMON, *extra, "train.update_freq=1", f"train.device={device}"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    single_overrides = tiny_overrides(
        corpus, single_run, *COMMON, *extra, "train.update_freq=2", f"train.device={device}"
    )
    single = train(load_config(TINY, single_overrides))

    assert (ddp_run / "spm.model").read_bytes() == (single_run / "spm.model").read_bytes()
    ddp = ckpt.read(ddp_run / LAST)
    assert ddp.training is not None
    assert ddp.training.progress.step == single.step == 4
    assert ddp.training.progress.batch_in_epoch == 4  # per rank; the single process used 8
    assert single.batch_in_epoch == 8
    reference = ckpt.read(single_run / LAST).model
    for name, tensor in ddp.model.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    log = (ddp_run / "train.log").read_text()
    assert log.count("model: ") == 1 and "2 process(es)" in log  # rank 0 alone writes the log
    assert log.count("step 4: loss") == 1
    assert sorted(p.name for p in ddp_run.glob("checkpoint*.pt")) == [
        "checkpoint_best.pt",
        "checkpoint_last.pt",
        "checkpoint_step4.pt",
    ]
    assert ddp.training.progress.best == pytest.approx(single.best, rel=1e-5)


@pytest.mark.slow  # ~30 s: two agents and their rendezvous
@pytest.mark.trains
def test_two_torchrun_agents_with_c10d_rendezvous_match_one_process(tmp_path: Path) -> None:
    """Multi-node training as a cluster runs it: one agent per node (here two on loopback), one process each."""
    corpus = write_corpus(tmp_path / "corpus", n_train=600)
    nodes_run, single_run = tmp_path / "nodes", tmp_path / "single"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=seq2seq-test",
        "-m",
        "seq2seq",
        "train",
        "--config",
        str(TINY),
        *tiny_overrides(corpus, nodes_run, *COMMON, "train.update_freq=1"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    errors = [agent.communicate(timeout=300)[1] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], errors[0][-2000:] + errors[1][-2000:]

    single = train(load_config(TINY, tiny_overrides(corpus, single_run, *COMMON, "train.update_freq=2")))
    nodes = ckpt.read(nodes_run / LAST)
    assert nodes.training is not None and nodes.training.progress.step == single.step == 4
    reference = ckpt.read(single_run / LAST).model
    for name, tensor in nodes.model.items():
        torch.testing.assert_close(tensor, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    assert "2 process(es)" in (nodes_run / "train.log").read_text()


class Exited(Exception):
    def __init__(self, code: int) -> None:
        self.code = code


def fake_exit(code: int) -> None:
    raise Exited(code)


@pytest.mark.parametrize("joined", [True, False])
def test_a_worker_that_joined_a_process_group_ends_without_finalizing(
    joined: bool, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Past its command, a data-parallel worker leaves by os._exit with the command's code, its output flushed:
    a gloo thread still releasing the last collective when Python shuts down aborts the process."""
    from seq2seq import entry
    from seq2seq.training import distributed

    monkeypatch.setattr(distributed, "_joined", joined)
    monkeypatch.setattr(entry.os, "_exit", fake_exit)
    argv = ["config", "--config", str(TINY)]
    if joined:
        with pytest.raises(Exited) as ended:
            entry.main(argv)
        assert ended.value.code == 0
        with pytest.raises(Exited) as ended:
            entry.main([*argv, "no_such.key=1"])
        assert ended.value.code == 2  # an error's code too
    else:
        assert entry.main(argv) == 0
    assert "model:" in capsys.readouterr().out
