"""Hugging Face Marian (OPUS-MT) directories: import, equivalence with `transformers`, export, refusals.

Offline: every Marian model here is a random `MarianMTModel` built by the test
(seq2seq.hf.toy) with SentencePiece models trained on the toy corpus, saved
with `save_pretrained` like a downloaded OPUS-MT directory.

Search settings on both sides: HF's `min_new_tokens=1` is our `decode.min_len: 1`
(no EOS first); our `max_len_b: N` with `max_len_a: 0` is HF's
`max_new_tokens=N + 1` (EOS forced after N tokens). Beam search is compared with
length_penalty 0 on both sides: HF divides a hypothesis' summed log-probability
by len ** alpha and we by the GNMT ((5 + len) / 6) ** alpha, which rank
hypotheses alike only at alpha 0; and HF scores a forced EOS 0 where we keep the
model's log-probability, so the random models get an EOS bias that ends their
sentences well before the limit (which the test checks).
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import TINY, reversal_pairs, tiny_overrides, write_corpus

from seq2seq.cli import main
from seq2seq.config import replace_checked
from seq2seq.decoding.translate import Translator
from seq2seq.errors import UserError
from seq2seq.runs import checkpoint as ckpt

transformers = pytest.importorskip("transformers")

from seq2seq.hf.files import import_marian  # noqa: E402  (after the skip: safetensors comes with the extra)
from seq2seq.hf.toy import Shape, write_random_marian  # noqa: E402

SHAPES = {
    "shared-swish-scaled": Shape(eos_bias=3.0),
    "separate-relu-unscaled-untied": Shape(
        shared=False, activation="relu", scale_embedding=False, tied_output=False, eos_bias=3.0
    ),
    "shared-gelu-unscaled-d64": Shape(activation="gelu", scale_embedding=False, d_model=64, eos_bias=2.0),
}
LIMIT = 40  # tokens before a forced EOS


@pytest.fixture(scope="module")
def lines() -> tuple[list[str], list[str]]:
    return reversal_pairs(500, 0)


@pytest.fixture(scope="module")
def marian_dirs(tmp_path_factory: pytest.TempPathFactory, lines: tuple[list[str], list[str]]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("marian")
    return {
        name: write_random_marian(root / name, *lines, shape, seed=i) for i, (name, shape) in enumerate(SHAPES.items())
    }


def hf_model(directory: Path) -> tuple[Any, Any]:
    model = transformers.MarianMTModel.from_pretrained(directory).eval()
    return model, transformers.MarianTokenizer.from_pretrained(directory)


def ours_translator(stored: ckpt.Checkpoint, **decode: object) -> Translator:
    settings = {"max_len_a": 0.0, "max_len_b": LIMIT, "min_len": 1, "length_penalty": 0.0, **decode}
    return Translator(stored.build_model(), stored.tokenizer, replace_checked(stored.config.decode, settings, "t", ""))


def marian_ids(stored: ckpt.Checkpoint, tokenizer: Any, text: list[str], target: bool) -> list[list[int]]:
    """Our token ids of some text, as Marian ids through the mapping the import chose (EOS appended)."""
    side = stored.tokenizer.tgt if target else stored.tokenizer.src
    vocab = tokenizer.target_encoder if target and tokenizer.separate_vocabs else tokenizer.encoder
    ours = stored.tokenizer.encode_tgt(text) if target else stored.tokenizer.encode_src(text)
    return [[vocab[side.id_to_piece(i)] for i in seq] + [vocab["</s>"]] for seq in ours]


@pytest.mark.parametrize("name", SHAPES)
def test_imported_logits_match_transformers(
    name: str, marian_dirs: dict[str, Path], lines: tuple[list[str], list[str]], one_thread: None
) -> None:
    stored = import_marian(marian_dirs[name])
    model = stored.build_model()
    hf, tokenizer = hf_model(marian_dirs[name])
    src_text, tgt_text = lines[0][:6], lines[1][:6]
    batch = tokenizer(src_text, text_target=tgt_text, return_tensors="pt", padding=True)
    pad = hf.config.pad_token_id
    # the same segmentation and ids: ours, mapped to Marian's, are what MarianTokenizer gives
    for ours, theirs, mask in zip(
        marian_ids(stored, tokenizer, src_text, False), batch["input_ids"], batch["attention_mask"]
    ):
        assert ours == theirs[mask.bool()].tolist()
    for ours, theirs in zip(marian_ids(stored, tokenizer, tgt_text, True), batch["labels"]):
        assert ours == [t for t in theirs.tolist() if t != pad]
    labels = batch["labels"]
    decoder_in = torch.cat([torch.full((labels.shape[0], 1), hf.config.decoder_start_token_id), labels[:, :-1]], 1)
    with torch.no_grad():
        theirs = hf(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], decoder_input_ids=decoder_in)
        src_order, tgt_order = orders(stored, tokenizer)
        src = to_ours(batch["input_ids"], src_order)
        ours = model(src, batch["attention_mask"] == 0, to_ours(decoder_in, tgt_order))
    real = labels != pad
    assert (ours[..., 1:] - theirs.logits[..., tgt_order[1:]])[real].abs().max() < 1e-4


def orders(stored: ckpt.Checkpoint, tokenizer: Any) -> tuple[list[int], list[int]]:
    """The Marian id of each of our ids, per side (-1 for our PAD), read back from the two vocabularies."""

    def side(processor: Any, vocab: dict[str, int]) -> list[int]:
        return [-1] + [vocab[processor.id_to_piece(i)] for i in range(1, processor.get_piece_size())]

    target_vocab = tokenizer.target_encoder if tokenizer.separate_vocabs else tokenizer.encoder
    return side(stored.tokenizer.src, tokenizer.encoder), side(stored.tokenizer.tgt, target_vocab)


def to_ours(ids: torch.Tensor, order: list[int]) -> torch.Tensor:
    inverse = {m: i for i, m in enumerate(order)}
    return torch.tensor([[inverse[int(t)] for t in row] for row in ids])


@pytest.mark.parametrize("name", SHAPES)
def test_imported_greedy_and_beam_output_is_generates(
    name: str, marian_dirs: dict[str, Path], lines: tuple[list[str], list[str]], one_thread: None
) -> None:
    stored = import_marian(marian_dirs[name])
    hf, tokenizer = hf_model(marian_dirs[name])
    src = lines[0][:10]
    batch = tokenizer(src, return_tensors="pt", padding=True)
    for beams in (1, 4):
        with torch.no_grad():
            out = hf.generate(
                **batch, num_beams=beams, max_new_tokens=LIMIT + 1, min_new_tokens=1, length_penalty=0.0,
                do_sample=False, early_stopping=False,
            )  # fmt: skip
        theirs = tokenizer.batch_decode(out, skip_special_tokens=True)
        strategy = {"strategy": "greedy"} if beams == 1 else {"strategy": "beam", "beam_size": beams}
        translations = ours_translator(stored, **strategy).translate_full(src)
        assert [t.text for t in translations] == theirs
        assert all(len(t.hypotheses[0].tokens) <= LIMIT for t in translations)  # each ended by itself


def test_import_hf_writes_a_checkpoint_and_its_config_that_translate_reads(
    marian_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    out = tmp_path / "run" / "checkpoint.pt"
    assert main(["import-hf", str(marian_dirs["shared-swish-scaled"]), "-o", str(out)]) == 0
    assert out.is_file() and (tmp_path / "run" / "checkpoint.yaml").is_file()
    stored = ckpt.read(out)
    assert stored.config.model.transformer is not None and stored.config.model.transformer.activation == "swish"
    assert main(["config", "--config", str(tmp_path / "run" / "checkpoint.yaml")]) == 0
    capsys.readouterr()
    source = tmp_path / "in.txt"
    source.write_text("red cat sun\ndog blue\n", encoding="utf-8")
    assert main(["translate", "-c", str(out), "-i", str(source), "decode.strategy=greedy"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 2
    assert main(["import-hf", str(marian_dirs["shared-swish-scaled"]), "-o", str(out)]) == 0  # again: replaced
    (tmp_path / "notes.yaml").write_text("mine\n", encoding="utf-8")
    assert main(["import-hf", str(marian_dirs["shared-swish-scaled"]), "-o", str(tmp_path / "notes.pt")]) == 1
    assert "notes.yaml exists" in capsys.readouterr().err
    assert (tmp_path / "notes.yaml").read_text(encoding="utf-8") == "mine\n" and not (tmp_path / "notes.pt").exists()


def broken(directory: Path, tmp_path: Path, how: str) -> Path:
    """A copy of a Marian directory, damaged as `how` says."""
    copy = tmp_path / how
    shutil.copytree(directory, copy)
    if how == "missing-spm":
        (copy / "target.spm").unlink()
    elif how == "vocab-size":
        vocab = json.loads((copy / "vocab.json").read_text(encoding="utf-8"))
        vocab.pop(max(vocab, key=vocab.__getitem__))
        (copy / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    elif how == "truncated-safetensors":
        data = (copy / "model.safetensors").read_bytes()
        (copy / "model.safetensors").write_bytes(data[: len(data) // 2])
    elif how in ("bart", "pre-norm", "odd-activation", "no-config"):
        config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
        if how == "bart":
            config["model_type"] = "bart"
        elif how == "pre-norm":
            config["normalize_before"] = True
        elif how == "odd-activation":
            config["activation_function"] = "gelu_new"
        (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
        if how == "no-config":
            (copy / "config.json").unlink()
    elif how == "not-spm":
        (copy / "source.spm").write_bytes(b"\x00not a model")
    elif how == "no-weights":
        (copy / "model.safetensors").unlink()
    elif how == "wrong-shape":
        config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
        config["encoder_ffn_dim"] = config["decoder_ffn_dim"] = config["encoder_ffn_dim"] * 2
        (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return copy


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("missing-spm", "target.spm: missing"),
        ("vocab-size", "but config.json's vocab_size is"),
        ("truncated-safetensors", "not a readable safetensors file"),
        ("bart", "model_type is 'bart'"),
        ("pre-norm", "normalize_before is True"),
        ("odd-activation", "activation_function 'gelu_new'"),
        ("no-config", "config.json: missing"),
        ("not-spm", "source.spm: not a SentencePiece model"),
        ("no-weights", "no weights"),
        ("wrong-shape", "the config says"),
    ],
)
def test_a_broken_marian_directory_is_one_line_and_exit_1(
    how: str, message: str, marian_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = broken(marian_dirs["shared-swish-scaled"], tmp_path, how)
    assert main(["import-hf", str(directory), "-o", str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("seq2seq: error: ") and message in err, err
    assert not (tmp_path / "out.pt").exists()


def test_an_imported_model_exports_back_and_generates_what_it_did(
    marian_dirs: dict[str, Path], tmp_path: Path, lines: tuple[list[str], list[str]], one_thread: None
) -> None:
    """Import, export: `transformers` loads the export, and it translates (greedy, beam) as the original did."""
    for name, directory in marian_dirs.items():
        checkpoint = tmp_path / f"{name}.pt"
        assert main(["import-hf", str(directory), "-o", str(checkpoint)]) == 0
        exported = tmp_path / f"{name}-hf"
        assert main(["export", str(checkpoint), "--format", "hf", "-o", str(exported)]) == 0
        src = lines[0][:8]
        outputs = []
        for model_dir in (directory, exported):
            hf, tokenizer = hf_model(model_dir)
            batch = tokenizer(src, return_tensors="pt", padding=True)
            with torch.no_grad():
                out = hf.generate(**batch, num_beams=1, max_new_tokens=LIMIT + 1, min_new_tokens=1, do_sample=False)
            outputs.append(tokenizer.batch_decode(out, skip_special_tokens=True))
        assert outputs[0] == outputs[1], name


def test_an_imported_model_exports_to_ctranslate2_and_translates_alike(
    marian_dirs: dict[str, Path], tmp_path: Path, lines: tuple[list[str], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    """CTranslate2 gets the import's special pieces by id (its BOS is Marian's <pad>), swish, the unscaled
    embeddings and the logits bias: its greedy translations are ours."""
    pytest.importorskip("ctranslate2")
    source = tmp_path / "in.txt"
    source.write_text("\n".join(lines[0][:20]) + "\n", encoding="utf-8")
    settings = ["decode.strategy=greedy", "decode.max_len_a=0", f"decode.max_len_b={LIMIT}"]
    for name, directory in marian_dirs.items():
        checkpoint, exported = tmp_path / f"{name}.pt", tmp_path / f"{name}-ct2"
        assert main(["import-hf", str(directory), "-o", str(checkpoint)]) == 0
        assert main(["export", str(checkpoint), "-o", str(exported)]) == 0
        capsys.readouterr()
        outputs = []
        for model in (checkpoint, exported):
            assert main(["translate", "-c", str(model), "-i", str(source), "--threads", "1", *settings]) == 0
            outputs.append(capsys.readouterr().out)
        assert outputs[0] == outputs[1] and len(outputs[0].splitlines()) == 20, name


@pytest.mark.trains  # the shared trained model (pre-norm)
def test_export_hf_refuses_what_marian_cannot_express(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["export", str(trained_run / "checkpoint_best.pt"), "--format", "hf", "-o", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "model.transformer.norm=pre does not export to Marian" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.trains
def test_our_post_norm_model_exports_and_transformers_translates_it_alike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], one_thread: None
) -> None:
    """A model of ours (post-norm, gelu, separate vocabularies) trained a little, exported: greedy output
    in `transformers` is ours, and the extra ids of ours (PAD) and Marian's names line up."""
    corpus = write_corpus(tmp_path / "data", n_train=600)
    run = tmp_path / "run"
    overrides = tiny_overrides(
        corpus,
        run,
        "model.transformer.norm=post",
        "model.transformer.activation=gelu",
        "data.shared_vocab=false",
        "model.share_all_embeddings=false",
        "train.max_steps=30",
        "train.threads=1",
        "train.precision=fp32",
    )
    assert main(["train", "--config", str(TINY), *overrides]) == 0
    exported = tmp_path / "hf"
    assert main(["export", str(run / "checkpoint_best.pt"), "--format", "hf", "-o", str(exported)]) == 0
    stored = ckpt.read(run / "checkpoint_best.pt")
    src = reversal_pairs(12, 5)[0]
    ours = ours_translator(stored, strategy="greedy").translate(src)
    hf, tokenizer = hf_model(exported)
    with torch.no_grad():
        out = hf.generate(
            **tokenizer(src, return_tensors="pt", padding=True), num_beams=1, max_new_tokens=LIMIT + 1,
            min_new_tokens=1, do_sample=False,
        )  # fmt: skip
    assert tokenizer.batch_decode(out, skip_special_tokens=True) == ours
    capsys.readouterr()  # the export scores the run's own test split, as the checkpoint does
    assert main(["evaluate", "-c", str(exported), "--threads", "1", "decode.strategy=greedy"]) == 0
    exported_bleu = capsys.readouterr().out
    assert main(["evaluate", "-c", str(run / "checkpoint_best.pt"), "--threads", "1", "decode.strategy=greedy"]) == 0
    assert exported_bleu.startswith("BLEU = ") and exported_bleu == capsys.readouterr().out  # scored alike
    # exporting again replaces the earlier export; a directory of someone else's is refused
    assert main(["export", str(run / "checkpoint_best.pt"), "--format", "hf", "-o", str(exported)]) == 0
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep", encoding="utf-8")
    capsys.readouterr()
    assert main(["export", str(run / "checkpoint_best.pt"), "--format", "hf", "-o", str(tmp_path / "mine")]) == 1
    assert "did not write there (notes.txt)" in capsys.readouterr().err


def test_pytorch_model_bin_imports_alike_and_a_pickle_with_code_is_refused(
    marian_dirs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from safetensors.torch import load_file

    directory = marian_dirs["separate-relu-unscaled-untied"]
    copy = tmp_path / "bin"
    shutil.copytree(directory, copy)
    torch.save(load_file(str(copy / "model.safetensors")), copy / "pytorch_model.bin")
    (copy / "model.safetensors").unlink()
    expected, got = import_marian(directory).model, import_marian(copy).model
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)
    torch.save({"weights": torch.zeros(2), "code": Shape()}, copy / "pytorch_model.bin")  # a class: not weights
    assert main(["import-hf", str(copy), "-o", str(tmp_path / "out.pt")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pytorch_model.bin: not a readable weights file" in err


def test_an_imported_model_is_served_with_its_attention(marian_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The server and its explorer take an imported checkpoint like one of ours."""
    pytest.importorskip("starlette")
    from test_explorer import translate

    checkpoint = tmp_path / "opus.pt"
    assert main(["import-hf", str(marian_dirs["shared-swish-scaled"]), "-o", str(checkpoint)]) == 0
    translator = Translator.from_checkpoint(checkpoint, strategy="greedy")
    status, body = translate(translator, {"text": ["red cat dog"], "options": {"attention": True}})
    assert status == 200, body
    [answer] = body["translations"]
    assert answer["text"] == translator.translate(["red cat dog"])[0]
    [picture] = answer["attention"]
    assert picture["layers"] == ["layer 2"] and picture["source"] == ["▁red", "▁cat", "▁dog", "</s>"]
    assert picture["target"][-1] == "</s>" and len(picture["alignment"]) == len(picture["target"])


def test_translate_and_evaluate_read_a_marian_directory_as_is(
    marian_dirs: dict[str, Path], tmp_path: Path, lines: tuple[list[str], list[str]], capsys: pytest.CaptureFixture[str]
) -> None:
    directory = marian_dirs["shared-gelu-unscaled-d64"]
    checkpoint = tmp_path / "opus.pt"
    assert main(["import-hf", str(directory), "-o", str(checkpoint)]) == 0
    source, reference = tmp_path / "in.txt", tmp_path / "ref.txt"
    source.write_text("\n".join(lines[0][:10]) + "\n", encoding="utf-8")
    reference.write_text("\n".join(lines[1][:10]) + "\n", encoding="utf-8")
    capsys.readouterr()
    outputs = []
    for model in (checkpoint, directory):
        assert main(["translate", "-c", str(model), "-i", str(source), "--threads", "1"]) == 0
        args = ["evaluate", "-c", str(model), "--src", str(source), "--ref", str(reference), "--threads", "1"]
        assert main(args) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "BLEU = " in outputs[0]


def test_sharded_safetensors_import_alike(marian_dirs: dict[str, Path], tmp_path: Path) -> None:
    directory = marian_dirs["shared-swish-scaled"]
    model, _ = hf_model(directory)
    copy = tmp_path / "sharded"
    model.save_pretrained(copy, max_shard_size="20KB")
    assert (copy / "model.safetensors.index.json").is_file() and not (copy / "model.safetensors").exists()
    for name in ("source.spm", "target.spm", "vocab.json", "tokenizer_config.json"):
        shutil.copy(directory / name, copy / name)
    expected, got = import_marian(directory).model, import_marian(copy).model
    assert expected.keys() == got.keys() and all(torch.equal(expected[k], got[k]) for k in expected)


def test_spm_pieces_the_vocabulary_lacks_are_a_warning_and_most_of_them_an_error(
    marian_dirs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """OPUS-MT vocabularies come from segmented text, so a piece its text never produced may be missing."""
    copy = tmp_path / "fewer"
    shutil.copytree(marian_dirs["separate-relu-unscaled-untied"], copy)
    vocab = json.loads((copy / "vocab.json").read_text(encoding="utf-8"))
    rare = max(vocab, key=vocab.__getitem__)  # the last piece: renumbering nothing else
    del vocab[rare]
    (copy / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    config = json.loads((copy / "config.json").read_text(encoding="utf-8"))
    config["vocab_size"] -= 1
    (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    from safetensors.torch import load_file, save_file

    weights = load_file(str(copy / "model.safetensors"))
    weights["model.encoder.embed_tokens.weight"] = weights["model.encoder.embed_tokens.weight"][:-1].clone()
    save_file(weights, str(copy / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="seq2seq"):
        stored = import_marian(copy)
    assert f"(e.g. {rare!r})" in caplog.text and "<unk>" in caplog.text
    assert rare not in [stored.tokenizer.src.id_to_piece(i) for i in range(stored.tokenizer.src_vocab_size)]
    keep = {p: i for i, p in enumerate(["</s>", "<unk>", "<pad>", *list(vocab)[3:6]])}
    (copy / "vocab.json").write_text(json.dumps(keep), encoding="utf-8")
    config["vocab_size"] = len(keep)
    (copy / "config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(UserError, match="do not belong together"):
        import_marian(copy)
