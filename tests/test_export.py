"""Export to CTranslate2: the engine, fed the exported model, translates as `seq2seq translate` does."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from seq2seq import checkpoint as ckpt
from seq2seq.cli import main
from seq2seq.model import build_model
from seq2seq.translate import Translator


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


ctranslate2 = pytest.importorskip("ctranslate2", reason="the export extra is not installed")


def _ct2_translate(model_dir: Path, translator: Translator, sources: list[str]) -> list[tuple[str, float]]:
    """Greedy CTranslate2 translations and their summed token log-probabilities (EOS included)."""
    engine = ctranslate2.Translator(str(model_dir), intra_threads=1)
    pieces = [translator.tokenizer.src.encode(s, out_type=str) for s in sources]
    results = engine.translate_batch(pieces, beam_size=1, return_scores=True, max_decoding_length=64)
    out = []
    for r in results:
        hypothesis = r.hypotheses[0]
        out.append((translator.tokenizer.tgt.decode(hypothesis), r.scores[0] * (len(hypothesis) + 1)))
    return out


@pytest.mark.usefixtures("one_thread")
def test_exported_model_translates_like_the_checkpoint(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    checkpoint = trained_run / "checkpoint_best.pt"
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "ct2")]) == 0
    assert {"model.bin", "config.json", "spm.model"} <= {p.name for p in (tmp_path / "ct2").iterdir()}
    translator = Translator.from_checkpoint(checkpoint, strategy="greedy", length_penalty=0.0)
    sources = lines(corpus / "test.src")[:60]
    ours = translator.translate_full(sources)
    theirs = _ct2_translate(tmp_path / "ct2", translator, sources)
    assert [t.text for t in ours] == [text for text, _ in theirs]
    for mine, (_, summed) in zip(ours, theirs):  # the same model: the same log-probabilities, up to rounding
        assert mine.hypotheses[0].score == pytest.approx(summed, abs=2e-3)


@pytest.mark.usefixtures("one_thread")
def test_int8_export_still_translates(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    checkpoint = trained_run / "checkpoint_best.pt"
    assert main(["export", str(checkpoint), "-o", str(tmp_path / "int8"), "--quantization", "int8"]) == 0
    translator = Translator.from_checkpoint(checkpoint, strategy="greedy")
    sources = lines(corpus / "test.src")[:60]
    ours = [t.text for t in translator.translate_full(sources)]
    theirs = [text for text, _ in _ct2_translate(tmp_path / "int8", translator, sources)]
    assert sum(a == b for a, b in zip(ours, theirs)) >= 0.9 * len(sources)


def test_export_refuses_bad_requests(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    assert main(["export", checkpoint, "-o", str(tmp_path / "a"), "--quantization", "int3"]) == 1
    assert "--quantization must be one of" in capsys.readouterr().err
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    assert main(["export", checkpoint, "-o", str(tmp_path / "full")]) == 1
    assert "exists and is not empty" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    stored = ckpt.read(checkpoint)
    rope = dataclasses.replace(stored.config, model=dataclasses.replace(stored.config.model, positions="rope"))
    model = build_model(rope.model, stored.tokenizer.src_vocab_size, stored.tokenizer.tgt_vocab_size)
    ckpt.save(tmp_path / "rope.pt", ckpt.Checkpoint(rope, stored.tokenizer, model.state_dict()))
    assert main(["export", str(tmp_path / "rope.pt"), "-o", str(tmp_path / "b")]) == 1
    assert "model.positions=rope does not export to CTranslate2 yet" in capsys.readouterr().err
