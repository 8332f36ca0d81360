"""Several language pairs in one model (data.pairs): a target-language tag on the source picks the output.

The toy task: one source, two target "languages" over the same words: `rev` (the
words reversed) and `same` (the sentence itself). Only the tag tells the model
which to produce, so one model translating the same line both ways reads it.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from conftest import TINY, reversal_pairs, tiny_overrides, write_multi_corpus

from seq2seq.cli import main
from seq2seq.config import DataConfig, load_config
from seq2seq.decoding.translate import Translator
from seq2seq.errors import ConfigError, DataError
from seq2seq.text.prepare import PreparedCorpus, settings

PAIRS = "data.pairs=[src-rev, src-same]"


@pytest.fixture(scope="module")
def multi_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One tiny model trained on both pairs through the CLI (one thread, fp32, as conftest's trained_run)."""
    corpus = write_multi_corpus(tmp_path_factory.mktemp("multi"))
    run_dir = tmp_path_factory.mktemp("runs") / "multi"
    extra = (PAIRS, "train.max_epochs=25", "train.threads=1", "train.precision=fp32")
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run_dir, *extra)]) == 0
    return run_dir


@pytest.fixture(scope="module")
def test_lines(multi_run: Path) -> list[str]:
    return reversal_pairs(60, 2)[0]


def share(hypotheses: list[str], references: list[str]) -> float:
    return sum(h == r for h, r in zip(hypotheses, references)) / len(references)


def translate(run: Path, *options: str) -> int:
    return main(["translate", "-c", str(run / "checkpoint_best.pt"), "--threads", "1", *options])


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.trains
def test_one_model_translates_the_same_input_into_either_language(
    multi_run: Path, test_lines: list[str], tmp_path: Path
) -> None:
    source = write_lines(tmp_path / "in.txt", test_lines)
    for lang in ("rev", "same"):
        assert translate(multi_run, "-i", str(source), "--tgt-lang", lang, "-o", str(tmp_path / lang)) == 0
    rev = (tmp_path / "rev").read_text(encoding="utf-8").splitlines()
    same = (tmp_path / "same").read_text(encoding="utf-8").splitlines()
    assert share(rev, [" ".join(reversed(line.split())) for line in test_lines]) >= 0.8
    assert share(same, test_lines) >= 0.8


@pytest.mark.trains
def test_jsonl_input_gives_each_line_its_own_target_language(
    multi_run: Path, test_lines: list[str], tmp_path: Path
) -> None:
    lines = test_lines[:20]
    langs = ["rev", "same"] * 10
    records = [json.dumps({"text": line, "tgt_lang": lang}) for line, lang in zip(lines, langs)]
    source = write_lines(tmp_path / "in.jsonl", records)
    assert translate(multi_run, "-i", str(source), "--input-format", "jsonl", "-o", str(tmp_path / "out")) == 0
    out = (tmp_path / "out").read_text(encoding="utf-8").splitlines()
    translator = Translator.from_checkpoint(multi_run / "checkpoint_best.pt")
    expected = [t.text for t in translator.translate_full(lines, tgt_langs=langs)]
    assert out == expected
    for one in ("rev", "same"):  # each line's own language reached the model, not one language for all lines
        assert out != [t.text for t in translator.translate_full(lines, tgt_langs=[one] * len(lines))]


@pytest.mark.trains
def test_training_logs_bleu_per_pair_and_their_mean(multi_run: Path) -> None:
    log = (multi_run / "train.log").read_text(encoding="utf-8")
    line = [row for row in log.splitlines() if "valid " in row][-1]
    scores = {k: float(v) for k, v in (item.split(" ") for item in line.split("valid ")[1].split(" (")[0].split(", "))}
    assert scores["bleu"] == pytest.approx((scores["bleu_src-rev"] + scores["bleu_src-same"]) / 2, abs=2e-3)


@pytest.mark.trains
def test_the_tags_are_in_the_tokenizer_and_on_the_prepared_sources(multi_run: Path) -> None:
    corpus = PreparedCorpus(multi_run / "prepared")
    assert corpus.tokenizer.target_langs == ("rev", "same")
    first, last = corpus.text(0)[0], corpus.text(len(corpus) - 1)[0]
    assert first.startswith("<2rev> ") and last.startswith("<2same> ")
    translator = Translator.from_checkpoint(multi_run / "checkpoint_best.pt")
    assert translator.tokenizer.target_langs == ("rev", "same")  # the checkpoint carries them


@pytest.mark.trains
def test_without_or_with_an_unknown_target_language_is_one_line(
    multi_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_lines(tmp_path / "in.txt", ["red cat"])
    for options, problem in (
        ((), "give the target language (--tgt-lang, or tgt_lang)"),
        (("--tgt-lang", "fr"), "not fr"),
    ):
        capsys.readouterr()
        assert translate(multi_run, "-i", str(source), *options) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"seq2seq: error: line 1: this model translates into rev, same: {problem}"]


def test_a_bilingual_model_refuses_another_target_language(trained_run: Path, tmp_path: Path) -> None:
    translator = Translator.from_checkpoint(trained_run / "checkpoint_best.pt")
    assert translator.tokenizer.target_langs == ()
    assert translator.translate(["red cat"], tgt_lang="tgt") == translator.translate(["red cat"])
    with pytest.raises(DataError, match="^line 1: this model translates only into tgt, not rev$"):
        translator.translate(["red cat"], tgt_lang="rev")


@pytest.mark.trains
def test_evaluate_scores_one_pair_at_a_time(multi_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = str(multi_run / "checkpoint_best.pt")
    assert main(["evaluate", "-c", checkpoint, "--threads", "1", "--tgt-lang", "rev"]) == 0
    bleu = float(capsys.readouterr().out.split("BLEU = ")[1].split()[0])
    assert bleu > 80
    assert main(["evaluate", "-c", checkpoint, "--threads", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["seq2seq: usage error: this model translates several pairs (src-rev, src-same): give --tgt-lang"]


@pytest.mark.trains
def test_the_server_takes_a_target_language_per_request(multi_run: Path) -> None:
    pytest.importorskip("starlette")
    from test_serve import asgi_post

    from seq2seq.serve.app import create_app
    from seq2seq.serve.batcher import Batcher
    from seq2seq.serve.engine import TranslatorEngine
    from seq2seq.serve.options import ServeOptions

    translator = Translator.from_checkpoint(multi_run / "checkpoint_best.pt")
    batcher = Batcher(TranslatorEngine(translator), max_tokens=1000, max_wait=0.05, max_queue=10)
    app = create_app(batcher, ServeOptions())
    bodies = [b'{"text": ["red cat sun"], "tgt_lang": "rev"}', b'{"text": ["red cat sun"]}']

    async def run() -> list[tuple[int, bytes]]:
        batcher.start()
        try:
            return [await asgi_post(app, "/translate", body) for body in bodies]
        finally:
            await batcher.stop()

    (ok, answer), (refused, error) = asyncio.run(run())
    assert ok == 200 and json.loads(answer)["translations"] == translator.translate(["red cat sun"], tgt_lang="rev")
    assert refused == 400 and "give the target language" in json.loads(error)["error"]


def test_bad_pairs_are_one_line_config_errors() -> None:
    cases = [
        ({"pairs": ("de-en",), "shared_vocab": False}, "data.pairs needs data.shared_vocab: true"),
        ({"pairs": ("de",)}, "data.pairs item 'de' must be SRC-TGT"),
        ({"pairs": ("de-de",)}, "data.pairs item 'de-de' translates a language into itself"),
        ({"pairs": ("de-en", "de-en")}, "data.pairs names a pair twice"),
    ]
    for changes, message in cases:
        with pytest.raises(ConfigError, match=f"^{message}"):
            DataConfig(**changes)  # type: ignore[arg-type]


def test_one_pair_keeps_the_prepared_settings_of_before() -> None:
    assert "pairs" not in settings(DataConfig())
    assert settings(DataConfig(pairs=("de-en", "fr-en")))["pairs"] == ["de-en", "fr-en"]
    assert DataConfig().language_pairs() == [("de", "en")] and DataConfig().target_tags() == []


def test_the_default_test_split_is_the_one_pair_into_the_target_language() -> None:
    from seq2seq.app.evaluation import default_pair

    two = DataConfig(pairs=("src-rev", "src-same"))
    assert default_pair(two, "rev") == ("src", "rev") and default_pair(DataConfig(), "") == ("de", "en")
    with pytest.raises(ConfigError, match="^2 pairs of de-en, fr-en translate into en: give --src and --ref"):
        default_pair(DataConfig(pairs=("de-en", "fr-en")), "en")
    with pytest.raises(ConfigError, match="^no pair of src-rev, src-same translate into fr"):
        default_pair(two, "fr")


@pytest.mark.parametrize(
    "other, needle",
    [
        ("data.format=tsv", "needs data.format: text"),
        ("data.spm_model=x.model", "drop data.spm_model"),
        ("data.pretokenized=true", "data.pretokenized"),
    ],
)
def test_pairs_refuse_what_cannot_carry_their_tags(other: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_config(TINY, ["data.pairs=[src-tgt, src-tgx]", other])
