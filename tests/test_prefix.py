"""Prefix-constrained decoding with the trained tiny model (it reverses words): the prefix starts every
hypothesis in each strategy, is scored by the model like any other tokens, changes nothing when it is what
search would have chosen anyway, and reaches the command line as a prefix file or JSONL input.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import reversal_pairs

from seq2seq.cli import main
from seq2seq.decoding.search import length_penalty
from seq2seq.decoding.translate import Translator
from seq2seq.errors import DataError
from seq2seq.text.vocab import BOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")

STRATEGIES = ["greedy", "beam", "sample"]
LINES = reversal_pairs(8, seed=11)[0]
PREFIXES = ["sun", "moon tree", "house house house", "", "cat", "blue green red fish", "", "car"]


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


@pytest.fixture(scope="module")
def translator(checkpoint: Path) -> Translator:
    return Translator.from_checkpoint(checkpoint, beam_size=3, nbest=2)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_best_output_as_prefix_changes_nothing(translator: Translator, strategy: str) -> None:
    t = translator.with_decode(strategy=strategy, nbest=1)
    free = t.translate_full(LINES)
    forced = t.translate_full(LINES, prefixes=[r.text for r in free])
    for f, c in zip(free, forced):
        assert c.hypotheses[0].tokens == f.hypotheses[0].tokens
        assert c.hypotheses[0].token_scores == pytest.approx(f.hypotheses[0].token_scores, abs=1e-5)
        assert c.hypotheses[0].score == pytest.approx(f.hypotheses[0].score, abs=1e-5)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_any_prefix_starts_every_hypothesis(translator: Translator, strategy: str) -> None:
    t = translator.with_decode(strategy=strategy)
    results = t.translate_full(LINES, prefixes=PREFIXES)
    for result, prefix in zip(results, PREFIXES):
        ids = translator.tokenizer.encode_tgt([prefix])[0]
        assert result.hypotheses and result.prefix == prefix
        for hypothesis, text in zip(result.hypotheses, result.texts):
            assert hypothesis.tokens[: len(ids)] == ids
            assert text.startswith(prefix)
    free = t.translate_full(LINES)
    assert any(r.text != f.text for r, f in zip(results, free))  # the prefixes did change the output


@pytest.mark.parametrize("strategy", STRATEGIES)
@torch.no_grad()
def test_prefix_tokens_are_scored_by_the_model(translator: Translator, strategy: str) -> None:
    """Every token score, forced or chosen, is the model's teacher-forced log-probability."""
    t = translator.with_decode(strategy=strategy)
    result = t.translate_full(["red cat dog"], prefixes=["moon moon"])[0]
    model = translator.model
    src = torch.tensor([result.source_tokens])
    for h in result.hypotheses:
        tokens = torch.tensor([h.tokens])
        logits = model(src, src == PAD, torch.cat([torch.full_like(tokens[:, :1], BOS), tokens[:, :-1]], dim=1))
        expected = torch.log_softmax(logits.float(), dim=-1).gather(2, tokens[:, :, None]).flatten()
        assert h.token_scores == pytest.approx(expected.tolist(), abs=1e-4)
        alpha = t.decode.length_penalty
        assert h.score == pytest.approx(sum(h.token_scores) / float(length_penalty(len(h.tokens), alpha)))
    assert result.hypotheses[0].token_scores[1] < -1  # "moon moon" is not what the model would say


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_prefixes_do_not_depend_on_the_batch(translator: Translator, strategy: str) -> None:
    t = translator.with_decode(strategy=strategy)
    alone = [t.translate_full([line], prefixes=[p])[0] for line, p in zip(LINES, PREFIXES)]
    for max_tokens in (8, 6000):
        together = t.with_decode(max_tokens=max_tokens).translate_full(LINES, prefixes=PREFIXES)
        assert [[h.tokens for h in r.hypotheses] for r in together] == [[h.tokens for h in r.hypotheses] for r in alone]


def test_a_prefix_beyond_the_length_limit_is_kept_whole(translator: Translator) -> None:
    t = translator.with_decode(strategy="greedy", max_len_a=0.0, max_len_b=1)
    prefix = "red red blue blue green"
    result = t.translate_full(["cat dog"], prefixes=[prefix])[0]
    assert result.hypotheses[0].tokens == [*translator.tokenizer.encode_tgt([prefix])[0], 3]  # the prefix, EOS
    [free] = t.translate_full(["cat dog"])[0].hypotheses
    assert len(free.tokens) <= 2 and free.tokens[-1] == 3  # without it, at most one subword, then EOS


def test_bad_prefixes_are_refused(translator: Translator) -> None:
    with pytest.raises(DataError, match="2 prefixes for 1 lines"):
        translator.translate_full(["red cat"], prefixes=["a", "b"])
    too_long = " ".join(["red"] * 200)  # model.max_positions is 128
    with pytest.raises(DataError, match="the prefix of line 2 has 200 subwords; the model allows 127"):
        translator.translate_full(["red cat", "sun"], prefixes=["", too_long])


def test_a_prefix_the_vocabulary_cannot_spell_is_warned_about(
    translator: Translator, caplog: pytest.LogCaptureFixture
) -> None:
    [spelled, unspellable] = translator.translate_full(["red cat", "sun moon"], prefixes=["sun", "moon ξζ"])
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "the prefix of line 2 has characters the target vocabulary lacks: the translation starts with the rest of it"
    ]
    assert spelled.text.startswith("sun") and unspellable.text.startswith("moon")


# The command line.


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def translate(checkpoint: Path, *options: str) -> int:
    return main(["translate", "-c", str(checkpoint), "--threads", "1", *options, "decode.beam_size=3"])


def test_prefix_file_and_jsonl_input_give_the_librarys_output(
    checkpoint: Path, translator: Translator, tmp_path: Path
) -> None:
    lines, prefixes = [*LINES[:3], ""], [*PREFIXES[:2], "", "sun"]
    source, prefix_file = write_lines(tmp_path / "in.txt", lines), write_lines(tmp_path / "prefix.txt", prefixes)
    assert translate(checkpoint, "-i", str(source), "--prefix-file", str(prefix_file), "-o", str(tmp_path / "a")) == 0
    expected = [r.text for r in translator.with_decode(nbest=1).translate_full(lines, prefixes=prefixes)]
    assert (tmp_path / "a").read_text(encoding="utf-8").splitlines() == expected
    records = [json.dumps({"text": line, "prefix": p}) for line, p in zip(lines, prefixes)]
    jsonl = write_lines(tmp_path / "in.jsonl", [*records[:2], json.dumps({"text": lines[2]}), ""])
    options = ["-i", str(jsonl), "--input-format", "jsonl", "--format", "jsonl", "-o", str(tmp_path / "b")]
    assert translate(checkpoint, *options) == 0
    out = [json.loads(line) for line in (tmp_path / "b").read_text(encoding="utf-8").splitlines()]
    assert [r["translation"] for r in out] == [*expected[:3], ""]
    assert [r.get("prefix") for r in out] == [prefixes[0], prefixes[1], None, None]


def test_misaligned_prefix_file_is_one_line_and_writes_nothing(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, prefix_file = write_lines(tmp_path / "in.txt", LINES[:3]), write_lines(tmp_path / "p.txt", ["a", "b"])
    output = tmp_path / "out.txt"
    assert translate(checkpoint, "-i", str(source), "--prefix-file", str(prefix_file), "-o", str(output)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [f"seq2seq: error: misaligned --prefix-file: {prefix_file} has 2 lines but {source} has 3"]
    assert not output.exists()


@pytest.mark.parametrize(
    "record, message",
    [
        ("not json", "in.jsonl:2: not JSON"),
        ('["red cat"]', 'in.jsonl:2: each line must be a JSON object with a "text" string'),
        ('{"prefix": "a"}', 'in.jsonl:2: "text" must be a string'),
        ('{"text": "red", "prefix": 3}', 'in.jsonl:2: "prefix" must be a string'),
        ('{"text": "red", "id": 3}', "in.jsonl:2: unknown field 'id' (fields: text, prefix, tgt_lang)"),
        ('{"text": "red\\ncat"}', 'in.jsonl:2: "text" contains a line break'),
        ('{"text": "red \\ud800 cat"}', 'in.jsonl:2: "text" holds invalid UTF-8 (a lone surrogate escape)'),
        ('{"text": "red", "prefix": "\\udfff"}', 'in.jsonl:2: "prefix" holds invalid UTF-8'),
    ],
)
def test_bad_jsonl_input_is_one_line_after_the_lines_before_it(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], record: str, message: str
) -> None:
    source = write_lines(tmp_path / "in.jsonl", ['{"text": "red cat"}', record, '{"text": "sun"}'])
    output = tmp_path / "out.txt"
    assert translate(checkpoint, "-i", str(source), "--input-format", "jsonl", "-o", str(output)) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("seq2seq: error: ") and message in err[0]
    before = Translator.from_checkpoint(checkpoint).translate(["red cat"])  # the line before the bad one
    assert output.read_text(encoding="utf-8").splitlines() == before


def test_prefix_file_with_jsonl_input_is_a_config_error(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source, prefix_file = write_lines(tmp_path / "in.jsonl", []), write_lines(tmp_path / "p.txt", [])
    assert translate(checkpoint, "-i", str(source), "--input-format", "jsonl", "--prefix-file", str(prefix_file)) == 2
    assert capsys.readouterr().err.splitlines() == [
        'seq2seq: usage error: give prefixes in the JSONL input ("prefix") or with --prefix-file, not both'
    ]
