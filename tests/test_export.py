"""Export to CTranslate2: the engine, fed the exported model, translates as `seq2seq translate` does."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, tiny_overrides

from seq2seq.cli import main
from seq2seq.config import ModelConfig, RNNConfig, TransformerConfig
from seq2seq.decoding.translate import Translator
from seq2seq.deploy.export import _position_options
from seq2seq.model import build_model
from seq2seq.runs import checkpoint as ckpt
from seq2seq.text.vocab import BOS, EOS, PAD


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").splitlines()


ctranslate2 = pytest.importorskip("ctranslate2", reason="the export extra is not installed")
from seq2seq.deploy.exported import CTranslate2Translator  # noqa: E402  (after the skip: it needs the extra)


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
    assert "holds files seq2seq did not write there (keep.txt)" in capsys.readouterr().err
    assert (tmp_path / "full" / "keep.txt").read_text() == "mine"
    stored = ckpt.read(checkpoint)
    rnn = dataclasses.replace(stored.config, model=ModelConfig(arch="rnn", rnn=RNNConfig(hidden_size=32)))
    model = build_model(rnn.model, stored.tokenizer.src_vocab_size, stored.tokenizer.tgt_vocab_size)
    ckpt.save(tmp_path / "rnn.pt", ckpt.Checkpoint(rnn, stored.tokenizer, model.state_dict()))
    assert main(["export", str(tmp_path / "rnn.pt"), "-o", str(tmp_path / "b")]) == 1
    err = capsys.readouterr().err
    assert "model.arch=rnn does not export to CTranslate2" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "b").exists()


# Every variant the exporter maps, each value at least once and each norm type with each norm
# placement: a tiny model trained a little, exported, and run through the same text pipeline in
# both engines.
VARIANTS = {
    "pre-learned-shared-relu": [
        "model.transformer.norm=pre",
        "model.transformer.positions=learned",
        "model.transformer.activation=relu",
    ],
    "post-sinusoidal-separate-gelu": [
        "model.transformer.norm=post",
        "model.transformer.activation=gelu",
        "data.shared_vocab=false",
        "model.share_all_embeddings=false",
    ],
    "post-learned-separate-output": [
        "model.transformer.norm=post",
        "model.transformer.positions=learned",
        "data.shared_vocab=false",
        "model.share_all_embeddings=false",
        "model.share_decoder_embeddings=false",
    ],
    "pre-sinusoidal-shared-gelu": ["model.transformer.norm=pre", "model.transformer.activation=gelu"],
    "pre-rope": ["model.transformer.norm=pre", "model.transformer.positions=rope"],
    "post-rope-rmsnorm-gelu": [
        "model.transformer.norm=post",
        "model.transformer.positions=rope",
        "model.transformer.norm_type=rmsnorm",
        "model.transformer.activation=gelu",
    ],
    "pre-relative-rmsnorm": [
        "model.transformer.norm=pre",
        "model.transformer.positions=relative",
        "model.transformer.norm_type=rmsnorm",
        "model.transformer.max_relative_distance=3",  # clipped often in the test sentences
    ],
    "post-relative-separate": [
        "model.transformer.norm=post",
        "model.transformer.positions=relative",
        "data.shared_vocab=false",
        "model.share_all_embeddings=false",
    ],
    "pre-none": ["model.transformer.norm=pre", "model.transformer.positions=none"],
    "pre-t5-bias": [
        "model.transformer.norm=pre",
        "model.transformer.positions=t5_bias",
        "model.transformer.t5_buckets=8",  # the test sentences reach the logarithmic buckets and the last one
        "model.transformer.t5_max_distance=6",
    ],
    "post-t5-bias-rmsnorm-separate": [
        "model.transformer.norm=post",
        "model.transformer.positions=t5_bias",
        "model.transformer.norm_type=rmsnorm",
        "data.shared_vocab=false",
        "model.share_all_embeddings=false",
    ],
}


@pytest.fixture(scope="module")
def variants(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each variant's (checkpoint, exported directory), trained for 120 updates (one thread)."""
    out = {}
    for name, overrides in VARIANTS.items():
        run = tmp_path_factory.mktemp("variant") / name
        extra = ["train.max_steps=120", "train.threads=1", "validation.bleu=false", *overrides]
        assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run, *extra)]) == 0
        checkpoint = run / "checkpoint_last.pt"
        assert main(["export", str(checkpoint), "-o", str(run / "ct2")]) == 0
        out[name] = (checkpoint, run / "ct2")
    return out


def _forced_logprobs(translator: Translator, source: str, tokens: list[int]) -> list[float]:
    """Our model's log-probability of each token of a hypothesis (EOS last), teacher-forced."""
    src = torch.tensor([translator.tokenizer.encode_src([source])[0] + [EOS]])
    tgt = torch.tensor([tokens])
    with torch.no_grad():
        logits = translator.model(src, src.eq(PAD), torch.cat([torch.full((1, 1), BOS), tgt[:, :-1]], dim=1))
    return logits.float().log_softmax(-1)[0].gather(-1, tgt[0, :, None])[:, 0].tolist()


@pytest.mark.trains
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
def test_every_variant_round_trips(
    variants: dict[str, tuple[Path, Path]], corpus: Path, variant: str, strategy: str
) -> None:
    """The same best hypothesis with the same token log-probabilities.

    Beam search stops a sentence only when no live hypothesis can beat its K-th best finished one
    (seq2seq.decoding.search.still_searching), so it returns the best its beam can find; CTranslate2 stops
    once K hypotheses have finished, which can miss it, so for `decode.beam_stop: exact` its beam runs on to
    the length limit (`beam_patience`) and finds the same best. The runners-up may still differ, so only
    they are let go; both engines' hypotheses must still score alike under our model.
    """
    checkpoint, exported = variants[variant]
    settings = {"strategy": strategy, "beam_size": 3, "nbest": 2 if strategy == "beam" else 1, "length_penalty": 0.0}
    ours = Translator.from_checkpoint(checkpoint, **settings)
    theirs = CTranslate2Translator.from_directory(exported, threads=1, token_scores=True, **settings)
    sources = lines(corpus / "test.src")[:40] + [""]
    for source, mine, other in zip(sources, ours.translate_full(sources), theirs.translate_full(sources)):
        assert len(mine.hypotheses) == len(other.hypotheses)  # 2 (beam), 1 (greedy), 0 (the empty line)
        if not mine.hypotheses:
            continue
        a, b = mine.hypotheses[0], other.hypotheses[0]  # the runners-up depend on each beam's stopping rule
        assert a.token_scores == pytest.approx(_forced_logprobs(ours, source, a.tokens), abs=2e-3)
        assert b.token_scores == pytest.approx(_forced_logprobs(ours, source, b.tokens), abs=2e-3)
        assert (a.tokens, mine.text) == (b.tokens, other.text), f"{strategy} search differs on {source!r}"
        assert a.score == pytest.approx(b.score, abs=2e-3)
        assert [h.score for h in other.hypotheses] == sorted((h.score for h in other.hypotheses), reverse=True)


@pytest.mark.trains
@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(
    "settings",
    [
        {"max_len_a": 0.0, "max_len_b": 3},  # every translation cut at 3 tokens
        {"min_len": 9, "max_len_a": 0.0, "max_len_b": 12},  # EOS forbidden before 9
        {"max_len_a": 0.5, "max_len_b": 1},  # a limit per source length: one call per limit
        {"no_repeat_ngram": 1, "suppress_unk": True},
    ],
    ids=["cut", "min", "per-source", "blocking"],
)
def test_length_and_blocking_settings_match_the_pytorch_path(
    variants: dict[str, tuple[Path, Path]], corpus: Path, settings: dict[str, object]
) -> None:
    checkpoint, exported = variants["pre-learned-shared-relu"]
    sources = lines(corpus / "test.src")[:40]
    ours = Translator.from_checkpoint(checkpoint, strategy="greedy", **settings).translate(sources)
    theirs = CTranslate2Translator.from_directory(exported, threads=1, strategy="greedy", **settings)
    assert theirs.translate(sources) == ours


@pytest.mark.trains
@pytest.mark.usefixtures("one_thread")
def test_prefixes_and_sampling(variants: dict[str, tuple[Path, Path]], corpus: Path) -> None:
    checkpoint, exported = variants["pre-sinusoidal-shared-gelu"]
    sources = lines(corpus / "test.src")[:20]
    prefixes = [s.split()[-1] if i % 2 else "" for i, s in enumerate(sources)]  # the right first word, or none
    ours = Translator.from_checkpoint(checkpoint, strategy="greedy").translate_full(sources, prefixes=prefixes)
    theirs = CTranslate2Translator.from_directory(exported, threads=1, strategy="greedy")
    assert [t.text for t in theirs.translate_full(sources, prefixes=prefixes)] == [t.text for t in ours]
    samples = []
    for seed in (7, 7, 8):  # the generator is seeded when the model loads
        sampler = CTranslate2Translator.from_directory(exported, strategy="sample", temperature=2.0, seed=seed)
        samples.append(sampler.translate(sources))
    assert samples[0] == samples[1] != samples[2]


def test_translate_and_evaluate_through_the_directory(
    trained_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint, exported = trained_run / "checkpoint_best.pt", tmp_path / "ct2"
    assert main(["export", str(checkpoint), "-o", str(exported)]) == 0
    assert (exported / "seq2seq.yaml").is_file()
    src = str(corpus / "test.src")
    outputs = {}
    for name, argv in {
        "pytorch": ["-c", str(checkpoint)],
        "directory": ["-c", str(exported)],
        "on the fly": ["-c", str(checkpoint), "--engine", "ctranslate2"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        assert main(["translate", *argv, "-i", src, "-o", str(out), "--format", "jsonl", "--threads", "1"]) == 0
        outputs[name] = [json.loads(line) for line in lines(out)]
    for name in ("directory", "on the fly"):
        assert [r["nbest"][0]["tokens"] for r in outputs[name]] == [r["nbest"][0]["tokens"] for r in outputs["pytorch"]]
        for mine, theirs in zip(outputs["pytorch"], outputs[name]):
            assert theirs["score"] == pytest.approx(mine["score"], abs=2e-3)
    capsys.readouterr()
    scores = []
    for model in (checkpoint, exported):  # the config's own test set, found through the stored data section
        assert main(["evaluate", "-c", str(model), "--threads", "1"]) == 0
        scores.append(capsys.readouterr().out.splitlines()[0])
    assert scores[0] == scores[1] and scores[0].startswith("BLEU = ")


def test_bad_requests_to_the_engine(trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint, exported = str(trained_run / "checkpoint_best.pt"), tmp_path / "ct2"
    assert main(["export", checkpoint, "-o", str(exported)]) == 0
    capsys.readouterr()
    translate = ["translate", "-c", str(exported), "-i", str(trained_run / "config.yaml")]
    cases = [
        ([*translate, "--engine", "torch"], 2, "is a CTranslate2 model directory"),
        (["translate", "-c", str(exported), "-c", checkpoint], 2, "CTranslate2 runs one model"),
        ([*translate, "--format", "jsonl", "--alignment"], 2, "need the PyTorch engine"),
        ([*translate, "decode.beam_size=0"], 2, "decode.beam_size"),
        ([*translate, "--device", "cuda"] if ctranslate2.get_cuda_device_count() == 0 else [], 1, "cannot load"),
    ]
    for argv, code, message in cases:
        if argv:
            assert main(argv) == code, argv
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
    (exported / "seq2seq.yaml").unlink()
    assert main(translate) == 1
    assert "has no seq2seq.yaml" in capsys.readouterr().err


@pytest.mark.trains
@pytest.mark.usefixtures("one_thread")
def test_the_server_runs_an_exported_model(variants: dict[str, tuple[Path, Path]], corpus: Path) -> None:
    from seq2seq.serve.engine import TranslatorEngine

    _, exported = variants["pre-learned-shared-relu"]
    translator = CTranslate2Translator.from_directory(exported, threads=1, strategy="greedy")
    engine = TranslatorEngine(translator)
    assert engine.describe()["engine"] == "ctranslate2"
    sources = lines(corpus / "test.src")[:10]
    settings = engine.settings({"strategy": "beam", "beam_size": 2, "length_penalty": 0.0})
    answers = [t.text for t in engine.translate(sources, settings)]
    assert answers == translator.with_decode(strategy="beam", beam_size=2, length_penalty=0.0).translate(sources)
    assert translator.decode.strategy == "greedy"  # a request's settings do not leak into the defaults


@pytest.mark.trains
def test_a_setting_that_cannot_be_honoured_is_said_once(
    variants: dict[str, tuple[Path, Path]], caplog: pytest.LogCaptureFixture
) -> None:
    _, exported = variants["pre-learned-shared-relu"]
    with caplog.at_level("WARNING", logger="seq2seq.deploy.exported"):
        greedy = CTranslate2Translator.from_directory(exported, threads=1, strategy="greedy")
        assert not caplog.records
        beam = greedy.with_decode(strategy="beam", length_penalty=1.0)  # the change brings the penalty: said
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["decode.length_penalty=1"]
        beam.with_decode(beam_size=2)  # what a server does per request: nothing new to say
        beam.with_decode(strategy="sample", seed=beam.seed + 1)  # a new seed cannot reach the engine
        assert len(caplog.records) == 2 and caplog.records[1].getMessage().startswith("decode.seed=")
    caplog.clear()
    with caplog.at_level("WARNING", logger="seq2seq.deploy.exported"):
        default = CTranslate2Translator.from_directory(exported, threads=1)  # the exported settings: quiet
        assert default.decode.strategy == "beam" and default.decode.length_penalty != 0 and not caplog.records
        CTranslate2Translator.from_directory(exported, threads=1, overrides=["decode.length_penalty=0.6"])
        assert [r.getMessage().split(":")[0] for r in caplog.records] == ["decode.length_penalty=0.6"]


def test_rotary_settings_are_read_from_the_model() -> None:
    """CTranslate2's rotary defaults (interleaved pairs) are not ours: the layout and base are set explicitly."""
    model = build_model(ModelConfig(d_model=32, transformer=TransformerConfig(positions="rope")), 40, 40)
    assert _position_options(model) == {"rotary_dim": 0, "rotary_interleave": False, "rotary_base": 10000.0}
    for module in model.modules():
        if getattr(module, "rotary", None) is not None:
            module.rotary.base = 500.0
    assert _position_options(model)["rotary_base"] == 500.0
    relative = build_model(ModelConfig(d_model=32, transformer=TransformerConfig(positions="relative")), 40, 40)
    assert _position_options(relative) == {"relative_position": True}
    t5 = build_model(ModelConfig(d_model=32, transformer=TransformerConfig(positions="t5_bias")), 40, 40)
    assert _position_options(t5) == {"relative_attention_bias": True}


def test_ctranslate2_keeps_its_own_openmp_runtime_beside_torch() -> None:
    """A process with both engines: CTranslate2's OpenMP calls bind to the libgomp its wheel ships, not to
    torch's (which would make one runtime of both, throttled once it counts more threads than CPUs)."""
    import os
    import subprocess
    import sys

    libs = Path(ctranslate2.__file__).parent.parent / "ctranslate2.libs"
    if not hasattr(os, "RTLD_DEEPBIND") or not any(p.name.startswith("libgomp") for p in libs.glob("*")):
        pytest.skip("needs Linux and a CTranslate2 wheel with its own libgomp")
    code = "import torch; from seq2seq.deploy.exported import import_ctranslate2; import_ctranslate2()"
    env = {**os.environ, "LD_DEBUG": "bindings"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    bindings = [line for line in done.stderr.splitlines() if "libctranslate2" in line and "GOMP_parallel" in line]
    assert bindings, "no binding of CTranslate2's GOMP_parallel was logged"
    assert all("ctranslate2.libs/libgomp" in line for line in bindings), bindings


def test_the_beam_stopping_rule_reaches_ctranslate2_as_its_patience() -> None:
    from seq2seq.config import DecodeConfig
    from seq2seq.deploy.exported import beam_patience

    assert beam_patience(DecodeConfig(strategy="beam", beam_stop="first_k"), 40) == 1.0  # its own rule
    assert beam_patience(DecodeConfig(strategy="greedy"), 40) == 1.0
    exact = beam_patience(DecodeConfig(strategy="beam", beam_size=4), 40)  # never K * patience finished sooner
    assert exact * 4 > 2 * 4 * 40
