"""Text in, text out with the trained tiny model: batching, order, odd inputs and the CLI's formats.

`seq2seq evaluate` is tested in test_cli.py.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import shutil
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import ROOT, reversal_pairs, single_thread_env

from seq2seq.cli import main
from seq2seq.decoding.search import length_penalty
from seq2seq.decoding.translate import Translation, Translator
from seq2seq.errors import ConfigError
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.text.download import tokenized_reference

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: a second thread only adds waiting


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint, nbest=2)


LINES, REFERENCES = reversal_pairs(10, seed=7)
LINES += ["cat", " ".join(["red", "dog", "sun", "tree"] * 5)]  # one word; 20 words, longer than any training sentence


def outputs(translations: list[Translation]) -> list[list[list[int]]]:
    return [[h.tokens for h in t.hypotheses] for t in translations]


@pytest.mark.parametrize("strategy", ["beam", "greedy", "sample"])
def test_translations_do_not_depend_on_the_batch(translator: Translator, strategy: str) -> None:
    """Each sentence alone, then all together under several token budgets (batch sizes 1 to all)."""
    alone = [translator.with_decode(strategy=strategy).translate_full([line])[0] for line in LINES]
    for max_tokens in (8, 40, 6000):
        mixed = translator.with_decode(strategy=strategy, max_tokens=max_tokens).translate_full(LINES)
        assert outputs(mixed) == outputs(alone)
        for a, m in zip(alone, mixed):
            assert [h.score for h in m.hypotheses] == pytest.approx([h.score for h in a.hypotheses], abs=1e-4)


def test_translation_runs_in_eval_mode_and_leaves_the_models_mode_as_it_was(checkpoint: Path) -> None:
    """Decoding sees every module in eval mode, whether the model came in training (validation) or eval mode
    (translate, serve), and the model leaves in the mode it came in."""
    translator = Translator.from_checkpoint(checkpoint)
    model = translator.model
    seen: list[bool] = []
    hook = model.encoder.register_forward_pre_hook(lambda module, args: seen.append(any_training(model)))
    try:
        expected = translator.translate(LINES[:3])
        assert seen == [False] and not any_training(model)
        model.train()
        assert translator.translate(LINES[:3]) == expected
        assert seen == [False, False] and all(m.training for m in model.modules())
    finally:
        hook.remove()
        model.eval()


def any_training(module: torch.nn.Module) -> bool:
    return any(m.training for m in module.modules())


def test_output_follows_input_order(translator: Translator) -> None:
    forward = translator.translate(LINES[:10])
    assert len(set(forward)) > 1  # translations that differ, so that their order is visible
    assert forward == [translator.translate([line])[0] for line in LINES[:10]]
    assert translator.translate(LINES[:10][::-1]) == forward[::-1]


def test_empty_lines_translate_to_empty_lines(translator: Translator) -> None:
    out = translator.translate_full(["", "red cat", "   ", "sun moon"])
    assert [t.text for t in out] == ["", *translator.translate(["red cat"]), "", *translator.translate(["sun moon"])]
    assert out[0].hypotheses == [] and out[2].hypotheses == []
    assert translator.translate([]) == []


def test_long_input_is_truncated_with_a_warning(translator: Translator, caplog: pytest.LogCaptureFixture) -> None:
    long_line = " ".join(["green", "bird"] * 200)  # far beyond model.max_positions = 128
    with caplog.at_level(logging.WARNING, logger="seq2seq"):
        out = translator.with_decode(strategy="greedy").translate(["red cat", long_line])
    assert out[0] == translator.with_decode(strategy="greedy").translate(["red cat"])[0] and out[1]
    assert "input line 2 has" in caplog.text and "truncated" in caplog.text
    caplog.clear()
    decode = replace(translator.decode, strategy="greedy", max_input_len=4)
    short = Translator(translator.model, translator.tokenizer, decode)
    with caplog.at_level(logging.WARNING, logger="seq2seq"):
        out = short.translate(["red cat", "red cat dog sun moon"])
    assert out == short.translate(["red cat", "red cat dog"])  # 3 subwords + EOS: the start of the line is kept
    assert "input line 2 has 5 subwords; truncated to the first 3" in caplog.text


# The command line.


def test_cli_jsonl_has_nbest_scores_and_token_logprobs(
    checkpoint: Path, translator: Translator, tmp_path: Path
) -> None:
    (tmp_path / "in.txt").write_text("red cat dog\n\nsun moon\n", encoding="utf-8")
    code = main(
        [
            "translate",
            "-c",
            str(checkpoint),
            "-i",
            str(tmp_path / "in.txt"),
            "-o",
            str(tmp_path / "out.jsonl"),
            "--format",
            "jsonl",
            "decode.beam_size=3",
            "decode.nbest=3",
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text(encoding="utf-8").splitlines()]
    assert [r["source"] for r in records] == ["red cat dog", "", "sun moon"]
    expected = translator.with_decode(beam_size=3, nbest=3).translate_full(["red cat dog", "sun moon"])
    assert [records[0]["translation"], records[2]["translation"]] == [t.text for t in expected]
    assert [[h["translation"] for h in records[i]["nbest"]] for i in (0, 2)] == [t.texts for t in expected]
    assert records[1] == {"source": "", "translation": "", "score": None, "nbest": []}
    for record in (records[0], records[2]):
        nbest = record["nbest"]
        assert len(nbest) == 3 and len({tuple(h["tokens"]) for h in nbest}) == 3
        assert [h["score"] for h in nbest] == sorted((h["score"] for h in nbest), reverse=True)
        assert record["score"] == nbest[0]["score"] and record["translation"] == nbest[0]["translation"]
        for h in nbest:
            assert len(h["token_logprobs"]) == len(h["tokens"]) == len(h["pieces"])
            assert all(lp <= 0 for lp in h["token_logprobs"]) and h["pieces"][-1] == "</s>"
            assert h["score"] == pytest.approx(sum(h["token_logprobs"]) / length_penalty(len(h["tokens"]), 1.0))


def test_cli_text_output_matches_the_library(checkpoint: Path, translator: Translator, tmp_path: Path) -> None:
    (tmp_path / "in.txt").write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    code = main(["translate", "-c", str(checkpoint), "-i", str(tmp_path / "in.txt"), "-o", str(tmp_path / "out.txt")])
    assert code == 0
    assert (tmp_path / "out.txt").read_text(encoding="utf-8").splitlines() == translator.translate(LINES)


def test_interactive_translates_each_line_as_it_arrives(
    checkpoint: Path, translator: Translator, tmp_path: Path
) -> None:
    """Write one line, read its translation, then write the next: stdin is a stream, not a file."""
    sources = ["red cat", "", "sun moon tree"]
    translations = translator.with_decode(strategy="greedy").translate(sources)
    env = {**single_thread_env(), "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "seq2seq",
                "translate",
                "-c",
                str(checkpoint),
                "--interactive",
                "decode.strategy=greedy",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            encoding="utf-8",
            env=env,
        )
        assert proc.stdin is not None and proc.stdout is not None
        lines: queue.Queue[str] = queue.Queue()
        stdout = proc.stdout
        threading.Thread(target=lambda: [lines.put(line) for line in stdout], daemon=True).start()
        try:
            for source, expected in zip(sources, translations):
                proc.stdin.write(source + "\n")
                proc.stdin.flush()
                try:
                    assert lines.get(timeout=120).rstrip("\n") == expected
                except queue.Empty:
                    log = (tmp_path / "stderr.txt").read_text()
                    pytest.fail(f"no translation of {source!r} while stdin stays open; stderr: {log}")
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0
        finally:
            proc.kill()


def test_evaluate_finds_the_tokenized_reference_of_the_test_split(
    checkpoint: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The default test set brings its tokenized reference (tok/ under data.dir) when there is one; --ref does not."""
    pytest.importorskip("sacremoses")
    data = tmp_path / "data"
    data.mkdir()
    for side in ("src", "tgt"):
        shutil.copy(corpus / f"test.{side}", data / f"test.{side}")
    loaded = load_checkpoint(checkpoint)
    config = replace(loaded.config, data=replace(loaded.config.data, dir=str(data)))
    ckpt.save(tmp_path / "moved.pt", replace(loaded.checkpoint, config=config))
    tok = tokenized_reference(data, "test", "tgt")
    tok.parent.mkdir()
    shutil.copy(corpus / "test.tgt", tok)  # lower-case words without punctuation: tokenized already
    evaluate = ["evaluate", "-c", str(tmp_path / "moved.pt"), "decode.strategy=greedy"]

    assert main(evaluate) == 0
    lines = capsys.readouterr().out.splitlines()
    report = {name: rest.split()[0] for name, rest in (line.split(" = ") for line in lines)}
    assert set(report) == {"BLEU", "chrF", "TER", "BLEU (lc, Moses-tokenized)"}
    assert report["BLEU (lc, Moses-tokenized)"] == report["BLEU"]
    assert main([*evaluate, "--ref", str(data / "test.tgt")]) == 0
    assert "Moses" not in capsys.readouterr().out


def test_from_checkpoint_overrides_are_validated(trained_run: Path) -> None:
    """Keyword overrides go through the same checks as a config file; the data section comes along for evaluate."""
    translator = Translator.from_checkpoint(trained_run / "checkpoint_best.pt", beam_size=3)
    assert translator.decode.beam_size == 3 and translator.data is not None and translator.data.tgt_lang == "tgt"
    with pytest.raises(ConfigError, match="decode.beam_size"):
        Translator.from_checkpoint(trained_run / "checkpoint_best.pt", beam_size="wide")


def test_with_decode_leaves_the_original_alone(translator: Translator) -> None:
    """Settings are frozen: a changed copy is checked again, and the translator it came from keeps its own."""
    greedy = translator.with_decode(strategy="greedy", nbest=1)
    assert greedy.decode.strategy == "greedy" and translator.decode.strategy == "beam"
    assert greedy.model is translator.model
    with pytest.raises(ConfigError, match="decode.beam_size must be at least 1"):
        translator.with_decode(beam_size=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        translator.decode.beam_size = 3  # type: ignore[misc]
