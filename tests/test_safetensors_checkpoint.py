"""`checkpoint.format: safetensors`: our checkpoints as safetensors files, read with the same checks as torch's."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import TINY, reversal_pairs, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.config import from_dict, load_config, to_dict
from seq2seq.errors import CheckpointError
from seq2seq.model import build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs import tensorfile
from seq2seq.text.tokenizer import train_tokenizer

pytest.importorskip("safetensors")


def a_checkpoint(file_format: str) -> ckpt.Checkpoint:
    """A small untrained model with a tokenizer of the toy task, its config asking for `file_format`."""
    src, tgt = reversal_pairs(300, 0)
    tokenizer = train_tokenizer(src, tgt, 64, shared=True)
    raw = to_dict(load_config(TINY))
    raw["checkpoint"]["format"] = file_format
    config = from_dict(raw)
    torch.manual_seed(0)
    model = build_model(config.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    return ckpt.Checkpoint(config, tokenizer, model.state_dict(), run_id="0123456789abcdef", step=7)


def test_a_safetensors_checkpoint_reads_back_as_the_torch_one(tmp_path: Path) -> None:
    saved = {}
    for file_format in ("torch", "safetensors"):
        path = tmp_path / f"{file_format}.pt"
        ckpt.save(path, a_checkpoint(file_format))
        saved[file_format] = ckpt.read(path)
        assert tensorfile.is_tensorfile(path) == (file_format == "safetensors")
        assert ckpt.peek_run_id(path) == "0123456789abcdef" and ckpt.peek_step(path) == 7
    torch_one, safe_one = saved["torch"], saved["safetensors"]
    assert safe_one.tokenizer.state() == torch_one.tokenizer.state() and safe_one.step == 7
    assert safe_one.model.keys() == torch_one.model.keys()
    assert all(torch.equal(safe_one.model[k], torch_one.model[k]) for k in torch_one.model)
    tied = safe_one.model["encoder.embedding.tokens.weight"], safe_one.model["decoder.output.weight"]
    assert tied[0] is tied[1]  # stored once, one tensor again
    assert safe_one.build_model() is not None
    raw = json.loads(json.dumps(to_dict(safe_one.config)))
    raw["checkpoint"]["format"] = "torch"
    assert raw == to_dict(torch_one.config)


def damaged(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    if how == "flipped":
        data[8 + length + 100] ^= 0x01  # a byte of the first tensor
    elif how == "truncated":
        del data[len(data) // 2 :]
    elif how == "no-metadata":
        from safetensors.torch import save

        data = bytearray(save({"x": torch.zeros(2)}))
    elif how == "missing-tensor":
        header = json.loads(data[8 : 8 + length])
        header["__metadata__"]["seq2seq"] = header["__metadata__"]["seq2seq"].replace('"t0"', '"t999"', 1)
        text = json.dumps(header).encode()
        data = bytearray(struct.pack("<Q", len(text)) + text + data[8 + length :])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("flipped", "checksum mismatch"),
        ("truncated", "not a readable checkpoint"),
        ("no-metadata", "not a seq2seq checkpoint"),
        ("missing-tensor", "names a tensor 't999' the file does not hold"),
    ],
)
def test_a_damaged_safetensors_checkpoint_is_one_line(
    how: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "checkpoint.pt"
    ckpt.save(path, a_checkpoint("safetensors"))
    damaged(path, how)
    with pytest.raises(CheckpointError, match=message):
        ckpt.read(path)
    (tmp_path / "in.txt").write_text("red cat\n", encoding="utf-8")
    assert main(["translate", "-c", str(path), "-i", str(tmp_path / "in.txt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.trains
def test_a_run_saving_safetensors_resumes_translates_and_averages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_corpus(tmp_path / "data", n_train=600)
    run = tmp_path / "run"
    common = [*tiny_overrides(corpus, run, "checkpoint.format=safetensors", "train.threads=1"), "train.precision=fp32"]
    assert main(["train", "--config", str(TINY), *common, "train.max_steps=10", "checkpoint.every=5"]) == 0
    assert all(tensorfile.is_tensorfile(p) for p in run.glob("checkpoint*.pt"))
    assert ckpt.read(run / ckpt.LAST).training is not None
    assert main(["train", "--config", str(TINY), *common, "train.max_steps=15", "checkpoint.every=5"]) == 0
    last = ckpt.read(run / ckpt.LAST)
    assert last.training is not None and last.training.progress.step == 15
    assert "resum" in (run / "train.log").read_text(encoding="utf-8")
    (tmp_path / "in.txt").write_text("red cat sun\n", encoding="utf-8")
    capsys.readouterr()
    assert main(["translate", "-c", str(run / ckpt.BEST), "-i", str(tmp_path / "in.txt")]) == 0
    assert capsys.readouterr().out.strip()
    assert main(["average", "--run-dir", str(run), "--last", "2", "-o", str(tmp_path / "avg.pt")]) == 0
    assert tensorfile.is_tensorfile(tmp_path / "avg.pt") and ckpt.read(tmp_path / "avg.pt").averaged_from
