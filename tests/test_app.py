"""The application layer called directly: opening a model, translating records, evaluating on a test set."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from seq2seq.app.evaluation import EvaluateOptions, evaluate
from seq2seq.app.model import ModelOptions, open_translator, with_decode_overrides
from seq2seq.app.runs import average
from seq2seq.app.streams import TranslateOptions, translate_records, translate_stream
from seq2seq.decoding.translate import Translator
from seq2seq.errors import CheckpointError, ConfigError, DataError, UserError
from seq2seq.text.inputs import Record

pytestmark = pytest.mark.usefixtures("one_thread")


def model(run: Path, *overrides: str) -> ModelOptions:
    return ModelOptions((str(run / "checkpoint_best.pt"),), device="cpu", overrides=overrides)


def test_open_a_checkpoint_with_decode_overrides(trained_run: Path) -> None:
    translator = open_translator(model(trained_run, "decode.strategy=greedy", "decode.max_tokens=77"))
    assert isinstance(translator, Translator)
    assert translator.decode.strategy == "greedy" and translator.decode.max_tokens == 77
    assert translator.data is not None and translator.data.test == "test"  # the checkpoint's own config


def test_open_a_missing_checkpoint_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="checkpoint not found"):
        open_translator(ModelOptions((str(tmp_path / "missing.pt"),), device="cpu"))


def test_only_decode_settings_change_and_are_checked(trained_run: Path) -> None:
    with pytest.raises(ConfigError, match="only decode"):
        open_translator(model(trained_run, "model.d_model=8"))
    with pytest.raises(ConfigError, match="decode.beam_size"):
        open_translator(model(trained_run, "decode.beam_size=0"))
    with pytest.raises(ConfigError, match="--threads"):
        open_translator(ModelOptions(model(trained_run).paths, threads=-1))


def test_decode_overrides_keep_the_model_limits() -> None:
    from seq2seq.config import ExperimentConfig

    config = ExperimentConfig()
    assert with_decode_overrides(config, ["decode.beam_size=2"]).decode.beam_size == 2
    with pytest.raises(ConfigError, match="model.max_positions"):
        with_decode_overrides(config, [f"decode.max_len={config.model.max_positions}"])


def test_records_become_lines_chunk_by_chunk(trained_run: Path) -> None:
    translator = open_translator(model(trained_run))
    records = [Record("red cat"), Record(""), Record("sun moon tree"), Record("blue dog"), Record("green fish")]
    chunks = list(translate_records(translator, records, TranslateOptions(), size=2))
    assert [len(chunk) for chunk in chunks] == [2, 2, 1]
    lines = [line for chunk in chunks for line in chunk]
    assert lines[1] == ""  # an empty line stays one empty line
    assert lines == translator.translate([r.text for r in records])  # chunked, each line as translated alone


def test_jsonl_lines_carry_prefix_scores_and_alignments(trained_run: Path) -> None:
    translator = open_translator(model(trained_run, "decode.nbest=2"))
    options = TranslateOptions(format="jsonl", alignment=True)
    records = [Record("sun moon tree", prefix="tree"), Record("")]
    first, empty = (json.loads(line) for chunk in translate_records(translator, records, options) for line in chunk)
    assert first["source"] == "sun moon tree" and first["prefix"] == "tree"
    assert first["translation"].startswith("tree") and len(first["nbest"]) == 2
    best = first["nbest"][0]
    assert len(best["token_logprobs"]) == len(best["tokens"]) == len(first["alignment"])  # EOS included in each
    assert first["source_pieces"] and first["word_alignment"]
    assert empty["translation"] == "" and empty["alignment"] == [] and empty["word_alignment"] == ""


def test_translate_a_file_into_a_file(trained_run: Path, tmp_path: Path) -> None:
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("red cat\n\nsun moon tree\n", encoding="utf-8")
    translate_stream(model(trained_run), TranslateOptions(input=str(source), output=str(output)))
    written = output.read_text(encoding="utf-8").split("\n")
    expected = open_translator(model(trained_run)).translate(["red cat", "", "sun moon tree"])
    assert written == [*expected, ""]  # one line per input line, the empty one kept, a newline at the end


def test_an_output_that_is_the_input_is_refused_before_it_is_emptied(trained_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("red cat\n", encoding="utf-8")
    (tmp_path / "link.txt").symlink_to(source)
    with pytest.raises(UserError, match="is the input file"):
        translate_stream(model(trained_run), TranslateOptions(input=str(source), output=str(tmp_path / "link.txt")))
    assert source.read_text(encoding="utf-8") == "red cat\n"


def test_options_that_do_not_go_together_are_refused(trained_run: Path) -> None:
    with pytest.raises(ConfigError, match="--alignment needs --format jsonl"):
        translate_stream(model(trained_run), TranslateOptions(alignment=True))


def test_evaluate_a_checkpoint_on_a_tiny_test_set(trained_run: Path, tmp_path: Path) -> None:
    src, ref, save = tmp_path / "t.src", tmp_path / "t.ref", tmp_path / "t.hyp"
    src.write_text("red cat\nsun moon tree\nblue dog green\n", encoding="utf-8")
    ref.write_text("cat red\ntree moon sun\ngreen dog blue\n", encoding="utf-8")
    options = EvaluateOptions(src=str(src), ref=str(ref), save=str(save))
    evaluation = evaluate(options, model(trained_run, "decode.strategy=greedy"))
    assert save.read_text(encoding="utf-8") == "".join(h + "\n" for h in evaluation.hypotheses)
    assert len(evaluation.hypotheses) == 3  # too short for BLEU's 4-grams: chrF tells whether they are right
    assert evaluation.report.chrf.score > 50 and evaluation.report.tokenized_bleu is None  # --ref given: no default
    assert [line.split(" = ")[0] for line in evaluation.lines()] == ["BLEU", "chrF", "TER"]


def test_evaluate_defaults_to_the_config_test_split(trained_run: Path, corpus: Path) -> None:
    evaluation = evaluate(EvaluateOptions(), model(trained_run, "decode.strategy=greedy"))
    references = (corpus / "test.tgt").read_text(encoding="utf-8").splitlines()
    assert len(evaluation.hypotheses) == len(references) == 100
    assert sum(h == r for h, r in zip(evaluation.hypotheses, references)) >= 90


def test_evaluate_a_hypothesis_file(tmp_path: Path) -> None:
    hyps, refs = tmp_path / "hyp.txt", tmp_path / "ref.txt"
    hyps.write_text("a dog runs .\ntwo cats\n", encoding="utf-8")
    refs.write_text("a dog runs .\ntwo cats\n", encoding="utf-8")
    evaluation = evaluate(EvaluateOptions(hypotheses=str(hyps), ref=str(refs), lowercase=True))
    assert evaluation.report.bleu.score == pytest.approx(100)
    assert evaluation.report.lowercase_bleu is not None
    refs.write_text("a dog runs .\n", encoding="utf-8")
    with pytest.raises(DataError, match="2 hypotheses but 1 references"):
        evaluate(EvaluateOptions(hypotheses=str(hyps), ref=str(refs)))
    refs.write_text("a dog runs .\ntwo cats\n", encoding="utf-8-sig")  # as Windows editors save it
    assert evaluate(EvaluateOptions(hypotheses=str(hyps), ref=str(refs))).report.bleu.score == pytest.approx(100)


def test_evaluate_never_saves_over_an_input(tmp_path: Path) -> None:
    refs = tmp_path / "ref.txt"
    refs.write_text("a\n", encoding="utf-8")
    with pytest.raises(UserError, match="also an input"):
        evaluate(EvaluateOptions(hypotheses=str(refs), ref=str(refs), save=str(refs)))
    assert refs.read_text(encoding="utf-8") == "a\n"


def test_evaluate_refuses_a_model_and_a_hypothesis_file(trained_run: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        evaluate(EvaluateOptions(hypotheses=str(tmp_path / "h.txt")), model(trained_run))


def test_average_refuses_before_reading_anything(tmp_path: Path) -> None:
    checkpoint = tmp_path / "a.pt"
    checkpoint.write_bytes(b"not read")
    with pytest.raises(ConfigError, match="--last must be at least 1"):
        average(tmp_path / "avg.pt", [checkpoint], last=0)
    with pytest.raises(UserError, match="run directory not found"):
        average(tmp_path / "avg.pt", run_dir=str(tmp_path / "missing"))
    with pytest.raises(UserError, match="nothing to average"):
        average(tmp_path / "avg.pt")
    with pytest.raises(UserError, match="also an input"):
        average(checkpoint, [checkpoint])
    with pytest.raises(UserError, match="averaged twice"):
        average(tmp_path / "avg.pt", [checkpoint, tmp_path / "." / "a.pt"])
    for name in ("checkpoint_last.pt", "checkpoint_best.pt", "checkpoint_step300.pt"):
        own = tmp_path / name
        own.write_bytes(b"a run's own")
        with pytest.raises(UserError, match="a training run's own checkpoint"):
            average(own, [checkpoint])
        assert own.read_bytes() == b"a run's own"
    assert checkpoint.read_bytes() == b"not read"
