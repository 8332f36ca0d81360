"""A user's own data: TSV and JSONL splits, an existing SentencePiece model, pre-tokenized text,
`seq2seq config`, and the warnings for defaults that do not fit the corpus."""

from __future__ import annotations

import gzip
import io
import json
from pathlib import Path

import pytest
import sentencepiece as spm
import yaml
from conftest import TINY, reversal_pairs, tiny_overrides, write_corpus

from seq2seq.app.evaluation import eval_set
from seq2seq.cli import main
from seq2seq.config import ExperimentConfig, TrainConfig, load_config, to_dict
from seq2seq.errors import DataError
from seq2seq.runs.checkpoint import read
from seq2seq.text.corpus import read_split
from seq2seq.text.prepare import PreparedCorpus, prepare, stale_reason
from seq2seq.text.vocab import UNK
from seq2seq.training.budget import plan_warnings, planned_updates

SPLITS = (("train", 300, 0), ("val", 50, 1), ("test", 20, 2))
QUICK = ("train.threads=1", "validation.bleu=false", "train.precision=fp32")


def pair_line(fmt: str, src: str, tgt: str) -> str:
    return f"{src}\t{tgt}" if fmt == "tsv" else json.dumps({"text": src, "translation": tgt})


def write_pairs(directory: Path, fmt: str, gz: bool = False) -> Path:
    """The reversal task as one file of pairs per split; jsonl names its fields text and translation."""
    directory.mkdir(parents=True, exist_ok=True)
    for split, n, seed in SPLITS:
        data = "".join(pair_line(fmt, s, t) + "\n" for s, t in zip(*reversal_pairs(n, seed))).encode()
        path = directory / f"{split}.{fmt}"
        if gz:
            path.with_name(path.name + ".gz").write_bytes(gzip.compress(data))
        else:
            path.write_bytes(data)
    return directory


def format_overrides(fmt: str) -> list[str]:
    fields = ["data.src_field=text", "data.tgt_field=translation"] if fmt == "jsonl" else []
    return [f"data.format={fmt}", *fields]


def args(corpus: Path, run: Path, *extra: str) -> list[str]:
    return ["--config", str(TINY), *tiny_overrides(corpus, run, *QUICK, *extra)]


@pytest.mark.trains
@pytest.mark.parametrize("fmt, gz", [("tsv", False), ("tsv", True), ("jsonl", False)])
def test_each_format_prepares_like_text_trains_translates_and_evaluates(
    tmp_path: Path, fmt: str, gz: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, run = write_pairs(tmp_path / "pairs", fmt, gz), tmp_path / "run"
    own = load_config(TINY, tiny_overrides(corpus, run, *format_overrides(fmt))).data
    text = load_config(TINY, tiny_overrides(write_corpus(tmp_path / "text", n_train=300), run)).data
    a, b = prepare(own, tmp_path / "own"), prepare(text, tmp_path / "text_prepared")
    assert a["tokenizer"] == b["tokenizer"] and a["pairs"] == b["pairs"] == 300  # the same data, one pipeline
    assert PreparedCorpus(tmp_path / "own").text(7) == PreparedCorpus(tmp_path / "text_prepared").text(7)
    assert read_split(own, "val") == tuple(reversal_pairs(50, 1))
    assert main(["train", *args(corpus, run, *format_overrides(fmt), "train.max_steps=3")]) == 0
    source = tmp_path / "in.txt"
    source.write_text("red cat\nblue dog sun\n", encoding="utf-8")
    checkpoint = str(run / "checkpoint_last.pt")
    output = tmp_path / "out.txt"
    assert main(["translate", "-c", checkpoint, "-i", str(source), "-o", str(output), "--threads", "1"]) == 0
    assert len(output.read_text(encoding="utf-8").splitlines()) == 2
    capsys.readouterr()
    assert main(["evaluate", "-c", checkpoint, "--threads", "1", "decode.beam_size=1"]) == 0  # the test split's pairs
    assert "BLEU" in capsys.readouterr().out


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("train.tsv", b"a b\tb a\nno tab here\n", r"train.tsv:2: no tab; each line must be source<TAB>target"),
        ("train.tsv", b"a b\tb a\tc\n", r"train.tsv:1: 2 tabs"),
        ("train.tsv", b"\n", r"train.tsv:1: no tab"),
        ("train.tsv.gz", b"a\tb\n\xff\tc\n", r"train.tsv.gz:2: invalid UTF-8"),
        ("train.jsonl", b'{"src": "a", "tgt": "b"}\n{"src": "a",\n', r"train.jsonl:2: invalid JSON"),
        ("train.jsonl", b'["a", "b"]\n', r"train.jsonl:1: a JSON object with 'src' and 'tgt' expected"),
        ("train.jsonl", b'{"src": "a"}\n', r"train.jsonl:1: no 'tgt' field"),
        ("train.jsonl", b'{"src": 1, "tgt": "b"}\n', r"train.jsonl:1: field 'src' is int, not a string"),
        ("train.jsonl", b'{"src": null, "tgt": "b"}\n', r"train.jsonl:1: field 'src' is NoneType, not a string"),
        ("train.jsonl", b'{"src": "\xff", "tgt": "b"}\n', r"train.jsonl:1: invalid UTF-8"),
        ("train.jsonl", b'{"src": "\\ud800", "tgt": "b"}\n', r"train.jsonl:1: field 'src' holds invalid UTF-8"),
        ("train.jsonl", b'{"src": " ", "tgt": "b"}\n', r"train.jsonl has no line pair with text on both sides"),
        ("train.jsonl", b'{"src": ' + b"1" * 5000 + b', "tgt": "b"}\n', r"train.jsonl:1: a number too long to read"),
        ("train.jsonl", b"[" * 100_000 + b"\n", r"train.jsonl:1: invalid JSON \(nested too deeply\)"),
    ],
)
def test_a_malformed_line_is_one_error_naming_file_and_line(
    tmp_path: Path, name: str, data: bytes, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    fmt = name.split(".")[1]
    corpus = write_pairs(tmp_path / "pairs", fmt)
    (corpus / f"train.{fmt}").unlink()
    (corpus / name).write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    run = tmp_path / "run"
    assert main(["prepare", *args(corpus, run, f"data.format={fmt}")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seq2seq: error: ")
    assert re_search(message, err)
    assert not list(run.glob("prepared*"))  # nothing half-written is left


@pytest.mark.parametrize("fmt", ["tsv", "jsonl"])
def test_a_line_longer_than_1_mib_in_a_file_of_pairs_drops_that_pair(
    tmp_path: Path, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_pairs(tmp_path / "pairs", fmt)
    path = corpus / f"train.{fmt}"
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(b"".join([lines[0], pair_line(fmt, "red " * (1 << 19), "x").encode() + b"\n", *lines[1:]]))
    run = tmp_path / "run"
    assert main(["prepare", *args(corpus, run, *format_overrides(fmt))]) == 0
    assert f"{path}:2: line longer than 1 MiB; its pair is dropped" in capsys.readouterr().err
    manifest = json.loads((run / "prepared" / "manifest.json").read_text())
    assert (manifest["lines"], manifest["pairs"], manifest["dropped"]["too_long"]) == (301, 300, 1)


def re_search(pattern: str, text: str) -> bool:
    import re

    return re.search(pattern, text) is not None


def test_validation_and_test_splits_are_checked_the_same_way(tmp_path: Path) -> None:
    corpus = write_pairs(tmp_path / "pairs", "tsv")
    (corpus / "val.tsv").write_text("a\tb\nc d\n", encoding="utf-8")
    (corpus / "test.tsv").write_text("a\tb\tc\n", encoding="utf-8")
    d = load_config(TINY, tiny_overrides(corpus, tmp_path / "run", "data.format=tsv")).data
    with pytest.raises(DataError, match=r"val.tsv:2: no tab"):
        read_split(d, "val")
    with pytest.raises(DataError, match=r"test.tsv:1: 2 tabs"):
        eval_set(d)
    assert eval_set(d, ref=str(corpus / "train.tsv"), src=str(corpus / "train.tsv")).sources[0].count("\t") == 1
    with pytest.raises(DataError, match=r"missing data file: .*missing.tsv"):
        read_split(d, "missing")


def spm_model(path: Path, vocab_size: int, **ids: int) -> bytes:
    """A SentencePiece model trained outside seq2seq on the task's sentences (special ids as given)."""
    src, tgt = reversal_pairs(300, 7)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(src + tgt), model_writer=model, vocab_size=vocab_size, minloglevel=2, **ids
    )
    path.write_bytes(model.getvalue())
    return model.getvalue()


SEQ2SEQ_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


@pytest.mark.trains
def test_an_existing_sentencepiece_model_is_used_instead_of_training_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, run = write_corpus(tmp_path / "corpus", n_train=300), tmp_path / "run"
    given = spm_model(tmp_path / "given.model", 30, **SEQ2SEQ_IDS)
    model = f"data.spm_model={tmp_path / 'given.model'}"
    assert main(["train", *args(corpus, run, model, "data.vocab_size=8000", "train.max_steps=2")]) == 0
    assert (run / "spm.model").read_bytes() == given == (run / "prepared" / "spm.model").read_bytes()
    err = capsys.readouterr().err
    assert "30 pieces (its size, not data.vocab_size=8000)" in err and "SentencePiece built" not in err
    d = load_config(TINY, tiny_overrides(corpus, run, "data.vocab_size=8000")).data
    expected = f"changed: data.spm_model {str(tmp_path / 'given.model')!r} -> ''"
    assert stale_reason(run / "prepared", d, None) == expected  # training one instead: rebuilt
    src, tgt = tmp_path / "src.model", tmp_path / "tgt.model"
    per_side = (spm_model(src, 24, **SEQ2SEQ_IDS), spm_model(tgt, 28, **SEQ2SEQ_IDS))
    sides = ("data.shared_vocab=false", "model.share_all_embeddings=false")
    both = (f"data.spm_model_src={src}", f"data.spm_model_tgt={tgt}")
    assert main(["prepare", *args(corpus, tmp_path / "run2", *sides, *both)]) == 0
    prepared = PreparedCorpus(tmp_path / "run2" / "prepared")
    assert (prepared.tokenizer.src_proto, prepared.tokenizer.tgt_proto) == per_side


def test_a_sentencepiece_model_that_does_not_fit_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus, run = write_corpus(tmp_path / "corpus", n_train=50), tmp_path / "run"
    spm_model(tmp_path / "default_ids.model", 30)  # SentencePiece's own ids: unk 0, bos 1, eos 2, no pad
    (tmp_path / "garbage.model").write_bytes(b"not a model")
    cases = [
        ([f"data.spm_model={tmp_path / 'default_ids.model'}"], 1, "its special ids are pad=-1 unk=0 bos=1 eos=2"),
        ([f"data.spm_model={tmp_path / 'garbage.model'}"], 1, "garbage.model: not a SentencePiece model"),
        ([f"data.spm_model={tmp_path / 'none.model'}"], 1, "none.model: SentencePiece model not found"),
        ([f"data.spm_model={tmp_path}"], 1, "SentencePiece model not found (or not a regular file)"),
        (["data.spm_model=a.model", "data.shared_vocab=false", "model.share_all_embeddings=false"], 2, "both sides"),
        (["data.spm_model_src=a.model"], 2, "data.spm_model_src needs data.shared_vocab: false"),
        (["data.spm_model_src=a", "data.shared_vocab=false", "model.share_all_embeddings=false"], 2, "go together"),
    ]
    for overrides, code, message in cases:
        assert main(["prepare", *args(corpus, run, *overrides)]) == code
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (overrides, err)
        assert not list(run.glob("prepared*"))


def test_pretokenized_text_gets_a_word_vocabulary(tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=300)
    d = load_config(TINY, tiny_overrides(corpus, tmp_path / "run", "data.pretokenized=true")).data
    prepare(d, tmp_path / "p")
    tokenizer = PreparedCorpus(tmp_path / "p").tokenizer
    assert tokenizer.src_vocab_size == 4 + 12  # the special pieces and the task's twelve words
    [red_cat, unknown] = tokenizer.encode_src(["red cat", "red zebra cat"])
    assert tokenizer.src_pieces(red_cat) == ["▁red", "▁cat"] and unknown == [red_cat[0], UNK, red_cat[1]]
    for bad in ("data.sampling_alpha=0.1", "data.spm_model=x.model", "data.spm_model_type=bpe"):
        with pytest.raises(Exception, match="data.pretokenized"):
            load_config(TINY, tiny_overrides(corpus, tmp_path / "run", "data.pretokenized=true", bad))


def test_config_prints_the_resolved_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["train.max_steps=7", "data.format=jsonl"]
    assert main(["config", "--config", str(TINY), *overrides]) == 0
    out = capsys.readouterr().out
    printed = yaml.safe_load(out)
    assert printed == to_dict(load_config(TINY, overrides))
    assert printed["train"]["max_steps"] == 7 and printed["data"]["src_field"] == "src"  # defaults filled in
    assert printed["model"]["transformer"]["norm"] == "pre"
    (tmp_path / "resolved.yaml").write_text(out, encoding="utf-8")
    assert load_config(tmp_path / "resolved.yaml") == load_config(TINY, overrides)
    assert main(["config"]) == 0 and yaml.safe_load(capsys.readouterr().out)["data"]["vocab_size"] == 8000
    assert main(["config", "--config", str(TINY), "data.formt=tsv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown key 'data.formt' (did you mean 'data.format'?)" in err


def test_plan_warnings_name_the_limit_that_does_not_fit() -> None:
    fits = TrainConfig(max_epochs=0, max_steps=100)
    assert planned_updates(fits, per_epoch=10) == 100 and plan_warnings(fits, 300, per_epoch=10, warmup_steps=50) == []
    assert planned_updates(TrainConfig(max_epochs=3, max_steps=0), per_epoch=10) == 30
    assert planned_updates(TrainConfig(max_epochs=0, max_minutes=5), per_epoch=10) == 0
    [warmup] = plan_warnings(TrainConfig(max_epochs=0, max_steps=100), 300, per_epoch=10, warmup_steps=51)
    assert warmup.startswith("optim.warmup_steps=51 is more than half of the 100 planned updates (300 pairs")
    [epochs] = plan_warnings(TrainConfig(max_epochs=2, max_steps=25), 300, per_epoch=10, warmup_steps=1)
    assert "train.max_epochs=2 stops the run after about 20 updates" in epochs and "max_steps=25" in epochs
    with pytest.raises(Exception, match="train.max_epochs 0 .* needs train.max_steps"):
        ExperimentConfig(train=TrainConfig(max_epochs=0))


@pytest.mark.trains
def test_training_warns_about_settings_that_do_not_fit_the_corpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    corpus = write_corpus(tmp_path / "corpus", n_train=100)
    misfit = ("data.vocab_size=8000", "train.max_epochs=1", "train.max_steps=1000", "optim.warmup_steps=50")
    assert main(["train", *args(corpus, tmp_path / "misfit", *misfit)]) == 0
    err = capsys.readouterr().err
    assert "data.vocab_size asked for 8000 pieces, but SentencePiece built 34" in err
    assert "optim.warmup_steps=50 is more than half of the" in err
    assert "train.max_epochs=1 stops the run after about" in err
    fit = ("data.vocab_size=34", "train.max_epochs=0", "train.max_steps=6", "optim.warmup_steps=2")
    assert main(["train", *args(corpus, tmp_path / "fit", *fit)]) == 0
    err = capsys.readouterr().err
    assert "SentencePiece built" not in err and "warmup_steps" not in err and "max_epochs" not in err
    assert "training finished at step 6" in err  # no epoch limit: max_steps ends the run
    training = read(tmp_path / "fit" / "checkpoint_last.pt").training
    assert training is not None and training.progress.epoch > 2  # several epochs ran
