"""`decode.quantize: int8`: the model's linears in int8 on the CPU, a decode-time change of a float32 model.

int8 changes the numbers, so it is tested against float32 loosely (most translations of the trained tiny model
the same) and against itself exactly where float32 is exact: a cached session against one started again for every
step over the whole prefix, and a sentence alone against the same sentence in a batch (every row is quantized on
its own, `seq2seq.model.packed.int8_linear`).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import reversal_pairs
from test_model import source_batch, target_batch, tiny_model, variant
from torch import Tensor

from seq2seq.cli import main
from seq2seq.config import DecodeConfig
from seq2seq.decoding.search import Hypothesis, search
from seq2seq.decoding.translate import Translator
from seq2seq.errors import ConfigError
from seq2seq.model import Seq2SeqTransformer, packed
from seq2seq.model.packed import fbgemm_int8_linear, int8_available, int8_linear, onednn_int8_linear
from seq2seq.model.record import AttentionRecord
from seq2seq.runs.checkpoint import load_checkpoint
from seq2seq.text.corpus import pad
from seq2seq.text.vocab import EOS, PAD

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not int8_available(), reason="this PyTorch has no int8 matrix multiply on the CPU"),
]


class RestartedSession:
    """A session that starts the model's decoding again at every step and replays the whole prefix through it: the
    int8 plan with a cache that never reorders or drops a row, the reference a searched int8 session (whose cache
    follows the beams) is compared with."""

    def __init__(self, model: Seq2SeqTransformer, src: Tensor, src_pad_mask: Tensor) -> None:
        self.model, self.src, self.mask = model, src, src_pad_mask
        self.tokens = torch.zeros(src.shape[0], 0, dtype=torch.long)
        self.attention: AttentionRecord | None = None

    def step(self, tokens: Tensor) -> Tensor:
        self.tokens = torch.cat([self.tokens, tokens], dim=1)
        session = self.model.start(self.src, self.mask)
        return [session.step(self.tokens[:, t : t + 1]) for t in range(self.tokens.shape[1])][-1]

    def reorder(self, index: Tensor) -> None:
        self.tokens = self.tokens.index_select(0, index)

    def select(self, index: Tensor) -> None:
        self.reorder(index)
        self.src, self.mask = self.src.index_select(0, index), self.mask.index_select(0, index)


class Restarted:
    def __init__(self, model: Seq2SeqTransformer) -> None:
        self.model = model

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> RestartedSession:
        return RestartedSession(self.model, src, src_pad_mask)


def tokens(results: list[list[Hypothesis]]) -> list[list[list[int]]]:
    return [[h.tokens for h in hyps] for hyps in results]


# int8 rounds every input of a linear to one of about 255 levels. The cached and the restarted pass compute
# the same inputs through different float operations, a few 1e-7 apart, which now and then moves one input
# across a level's boundary: one level of one input, about 1e-3 to 1e-2 in a score (measured: 3 cases of 192
# random models, both int8 GEMMs). Batch invariance is exact: a row's inputs are the same bits either way.
ONE_LEVEL = 0.05


def assert_same(a: list[list[Hypothesis]], b: list[list[Hypothesis]], abs: float) -> None:
    assert tokens(a) == tokens(b)
    for x, y in zip(itertools.chain(*a), itertools.chain(*b)):
        assert x.token_scores == pytest.approx(y.token_scores, abs=abs)


# The int8 linear.


LINEARS = {
    "int8_linear": int8_linear,
    "onednn_int8_linear": onednn_int8_linear,
    "fbgemm_int8_linear": fbgemm_int8_linear,
}


@torch.no_grad()
@pytest.mark.parametrize("relu", [False, True])
@pytest.mark.parametrize("make", LINEARS)  # this CPU's int8 GEMM, and each of the two wherever this PyTorch has it
def test_an_int8_linear_is_close_to_float32_and_each_row_its_own(make: str, relu: bool) -> None:
    if make == "fbgemm_int8_linear" and not packed._fbgemm_available():
        pytest.skip("this PyTorch has no FBGEMM")
    if make == "onednn_int8_linear" and not packed.int_mm_available():
        pytest.skip("this PyTorch has no torch._int_mm on the CPU")
    g = torch.Generator().manual_seed(0)
    weight, bias, x = torch.randn(48, 32, generator=g), torch.randn(48, generator=g), torch.randn(5, 3, 32, generator=g)
    x[1, 2] = 0.0  # a row of zeros: its bias alone
    linear = LINEARS[make](weight, bias, relu)
    expected = F.linear(x, weight, bias)
    expected = expected.relu() if relu else expected
    y = linear(x)
    assert y.shape == (5, 3, 48) and (not relu or bool((y >= 0).all()))
    assert (y - expected).abs().max() < 0.05 * expected.abs().max()
    assert torch.equal(y[1, 2], expected[1, 2])
    for i in range(5):  # a row's output does not depend on the others: integer sums are exact
        assert torch.equal(linear(x[i : i + 1]), y[i : i + 1])
    assert linear(x[:0]).shape == (0, 3, 48)


@torch.no_grad()
def test_int8_decoding_is_a_view_of_the_float32_model() -> None:
    model = tiny_model(**variant("post"))
    assert isinstance(model, Seq2SeqTransformer)
    int8 = model.quantized("int8")
    assert model.quantized("none") is model
    assert int8 is not model and int8.decoder is model.decoder and int8.plan is not model.plan
    assert int8.state_dict().keys() == model.state_dict().keys()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    src, mask = source_batch()
    tgt = target_batch(length=5)
    session, reference = int8.start(src, mask), model.start(src, mask)
    for t in range(tgt.shape[1]):
        a, b = session.step(tgt[:, t : t + 1]), reference.step(tgt[:, t : t + 1])
        assert not torch.equal(a, b)
        torch.testing.assert_close(a.log_softmax(-1), b.log_softmax(-1), atol=0.1, rtol=0.0)
    assert int8.start(src, mask).plan is int8.plan.session(int8.encode(src, mask))  # quantized once, kept


@pytest.mark.parametrize("name", ["post", "pre", "post-learned-gelu-untied"])
@torch.no_grad()
def test_int8_encodes_in_int8_and_projects_the_cross_keys_in_int8(name: str) -> None:
    """The encoder pass that starts an int8 session runs the encoder's linears in int8 (made once and kept while the
    weights stay), and so does the projection of its output to the cross-attention keys and values: both close to
    float32 and not equal to it, and a sentence encodes alike alone and in a batch (each row quantized alone)."""
    model = tiny_model(**variant(name))
    assert isinstance(model, Seq2SeqTransformer)
    int8 = model.quantized("int8")
    src, mask = source_batch()
    memory, reference = int8.encode(src, mask), model.encode(src, mask)  # (B, S, D), zeros at padding
    assert not torch.equal(memory, reference)
    assert (memory - reference).abs().max() < 0.05 * reference.abs().max()
    assert torch.equal(memory[mask], torch.zeros_like(memory[mask]))
    for i in range(src.shape[0]):
        length = int((~mask[i]).sum())
        alone = int8.encode(src[i : i + 1, :length], mask[i : i + 1, :length])
        assert torch.equal(alone[0], memory[i, :length])
    assert int8.plan.encoder_linears() is int8.plan.encoder_linears() and model.plan.encoder_linears() == {}
    plan = int8.plan.session(memory)
    kv, float_kv = plan.memory(memory[~mask]), model.plan.session(memory).memory(memory[~mask])  # (n, L * 2D)
    assert not torch.equal(kv, float_kv)
    assert (kv - float_kv).abs().max() < 0.05 * float_kv.abs().max()
    next(model.encoder.parameters()).add_(1.0)  # the weights change: the int8 copies are made again
    assert not torch.equal(int8.encode(src, mask), memory)


@pytest.mark.parametrize(
    "name", ["post", "pre", "post-learned-gelu-untied", "relative", "rope", "rmsnorm-pre", "t5_bias", "none"]
)
@pytest.mark.parametrize("strategy", ["greedy", "beam"])
@torch.no_grad()
def test_int8_cached_equals_restarted_and_batch_invariant_random(name: str, strategy: str) -> None:
    model = tiny_model(**variant(name))
    assert isinstance(model, Seq2SeqTransformer)
    int8 = model.quantized("int8")
    src, mask = source_batch()
    decode = DecodeConfig(strategy=strategy, beam_size=3, nbest=3 if strategy == "beam" else 1)  # type: ignore[arg-type]
    cached = search(int8, src, mask, decode, 20)
    assert_same(cached, search(Restarted(int8), src, mask, decode, 20), abs=ONE_LEVEL)
    alone = [search(int8, src[i : i + 1], mask[i : i + 1], decode, 20)[0] for i in range(3)]
    assert_same(cached, alone, abs=1e-5)


def test_int8_is_refused_in_one_line_where_it_cannot_run() -> None:
    rnn = tiny_model(**variant("rnn-lstm-dot"))
    with pytest.raises(ConfigError, match="not an RNN"):
        Translator(rnn, None, DecodeConfig(quantize="int8"))  # type: ignore[arg-type]
    model = tiny_model(**variant("post"))
    assert isinstance(model, Seq2SeqTransformer)
    with pytest.raises(ConfigError, match="CPU only, not meta"):
        model.to("meta").quantized("int8")
    with pytest.raises(ConfigError, match="float32 model, not torch.bfloat16"):
        tiny_model(**variant("post")).to(torch.bfloat16).quantized("int8")  # type: ignore[operator]


# The trained tiny model.


@pytest.fixture(scope="module")
def trained(trained_run: Path) -> tuple[Seq2SeqTransformer, Tensor, Tensor]:
    loaded = load_checkpoint(trained_run / "checkpoint_best.pt")
    lines, _ = reversal_pairs(24, seed=42)
    src = pad([ids + [EOS] for ids in loaded.tokenizer.encode_src(lines)])
    assert isinstance(loaded.model, Seq2SeqTransformer)
    return loaded.model.eval(), src, src == PAD


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
@torch.no_grad()
def test_int8_translates_most_sentences_as_float32(
    trained: tuple[Seq2SeqTransformer, Tensor, Tensor], strategy: str
) -> None:
    model, src, mask = trained
    decode = DecodeConfig(strategy=strategy, beam_size=4)  # type: ignore[arg-type]
    fp32 = tokens(search(model, src, mask, decode, 100))
    int8 = tokens(search(model.quantized("int8"), src, mask, decode, 100))
    same = sum(a[0] == b[0] for a, b in zip(fp32, int8))
    assert same >= 0.9 * len(fp32), (same, len(fp32))


@pytest.mark.parametrize("strategy", ["greedy", "beam"])
@torch.no_grad()
def test_int8_cached_equals_restarted_and_batch_invariant_trained(
    trained: tuple[Seq2SeqTransformer, Tensor, Tensor], strategy: str
) -> None:
    model, src, mask = trained
    int8 = model.quantized("int8")
    src, mask = src[:8], mask[:8]
    decode = DecodeConfig(strategy=strategy, beam_size=4, nbest=4 if strategy == "beam" else 1)  # type: ignore[arg-type]
    cached = search(int8, src, mask, decode, 100)
    assert_same(cached, search(Restarted(int8), src, mask, decode, 100), abs=ONE_LEVEL)
    alone = [search(int8, src[i : i + 1], mask[i : i + 1], decode, 100)[0] for i in range(len(src))]
    assert_same(cached, alone, abs=1e-5)


def test_translate_and_evaluate_run_int8_from_the_cli(
    trained_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    source = corpus / "test.src"
    outputs = {}
    for quantize in ("none", "int8"):
        out = tmp_path / f"{quantize}.txt"
        args = ["translate", "-c", checkpoint, "--threads", "1", "-i", str(source), "-o", str(out)]
        assert main([*args, f"decode.quantize={quantize}"]) == 0
        outputs[quantize] = out.read_text(encoding="utf-8").splitlines()
    same = sum(a == b for a, b in zip(outputs["none"], outputs["int8"]))
    assert len(outputs["int8"]) == len(outputs["none"]) and same >= 0.9 * len(outputs["none"])
    translator = Translator.from_checkpoint(checkpoint, quantize="int8")
    assert translator.engine_info()["quantize"] == "int8" and translator.float_model is not translator.model
    assert translator.with_decode(quantize="none").model is translator.float_model
    capsys.readouterr()
    ref = corpus / "test.tgt"
    args = ["evaluate", "-c", checkpoint, "--threads", "1", "--src", str(source), "--ref", str(ref), "--format", "json"]
    assert main([*args, "decode.quantize=int8"]) == 0
    assert '"bleu"' in capsys.readouterr().out.lower()


def test_a_bad_quantize_value_is_one_line(trained_run: Path, corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    code = main(["translate", "-c", checkpoint, "-i", str(corpus / "test.src"), "decode.quantize=int4"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "decode.quantize" in err and "int8" in err and len(err.splitlines()) == 1


def test_serve_answers_int8_as_translate_does(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    pytest.importorskip("starlette", reason="seq2seq serve needs the serve extra")
    from test_serve import Server

    checkpoint = trained_run / "checkpoint_best.pt"
    lines = (corpus / "test.src").read_text(encoding="utf-8").splitlines()[:20]
    source, output = tmp_path / "in.txt", tmp_path / "out.txt"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    args = ["translate", "-c", str(checkpoint), "--threads", "1", "-i", str(source), "-o", str(output)]
    assert main([*args, "decode.quantize=int8"]) == 0
    expected = output.read_text(encoding="utf-8").splitlines()
    server = Server(checkpoint, "decode.quantize=int8")
    try:
        info = server.get("/info")[1]["model"]
        assert info["quantize"] == "int8" and info["decode"]["quantize"] == "int8"
        assert server.post({"text": lines}) == (200, {"translations": expected})
    finally:
        assert server.stop() == 143, server.lines


def test_an_export_translates_with_ctranslate2_int8(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    """decode.quantize=int8 with a CTranslate2 model loads it with compute type int8; changing it later is a
    warning (the engine cannot)."""
    pytest.importorskip("ctranslate2")
    from seq2seq.deploy.export import export_ctranslate2
    from seq2seq.deploy.exported import CTranslate2Translator

    exported = export_ctranslate2(trained_run / "checkpoint_best.pt", tmp_path / "ct2")
    lines = (corpus / "test.src").read_text(encoding="utf-8").splitlines()[:20]
    fp32 = CTranslate2Translator.from_directory(exported, threads=1)
    int8 = CTranslate2Translator.from_directory(exported, threads=1, overrides=["decode.quantize=int8"])
    assert fp32.engine_info()["compute_type"] == "float32" and int8.engine_info()["compute_type"].startswith("int8")
    same = sum(a == b for a, b in zip(fp32.translate(lines), int8.translate(lines)))
    assert same >= 0.9 * len(lines)
    assert "quantize" in [key for key, _ in fp32.with_decode(quantize="int8")._unhonoured()]
    assert "quantize" not in [key for key, _ in int8._unhonoured()]


def test_bench_decode_compares_int8_with_float32(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    import json

    from test_scripts import run_script

    results = tmp_path / "bench.json"
    args = ["--compare", "quantize", "-c", str(trained_run / "checkpoint_best.pt"), "--src", str(corpus / "test.src")]
    args += ["-n", "8", "--rounds", "1", "--beam", "2", "--threads", "1", "--json", str(results)]
    proc = run_script("bench/bench_decode.py", *args, cwd=tmp_path)
    ratios = [line.split(":")[0] for line in proc.stdout.splitlines() if "int8 / fp32 speed = " in line]
    assert ratios == ["greedy", "beam"]
    summary = json.loads(results.read_text(encoding="utf-8"))
    assert set(summary["runs"]) == {"greedy int8", "greedy fp32", "beam2 int8", "beam2 fp32"}


def test_the_int8_gemm_is_onednns_where_the_cpu_multiplies_8_bits_natively_else_fbgemms(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without VNNI or AMX, PyTorch runs `torch._int_mm` as a plain loop (30-40x slower than float32)."""
    for flags, expected in [({"avx2"}, "fbgemm"), ({"avx2", "avx512_vnni"}, "onednn"), ({"avx_vnni"}, "onednn")]:
        monkeypatch.setattr(packed, "cpu_fields", lambda flags=flags: frozenset(flags))
        monkeypatch.setattr(packed, "_fbgemm_available", lambda: True)
        packed.int8_gemm.cache_clear()
        assert packed.int8_gemm() == expected
        monkeypatch.setattr(packed, "_fbgemm_available", lambda: False)
        packed.int8_gemm.cache_clear()
        assert packed.int8_gemm() == "onednn"  # no FBGEMM: `_int_mm`, slow or not
    monkeypatch.undo()
    packed.int8_gemm.cache_clear()


def test_a_process_limited_below_vnni_quantizes_weights_to_7_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN capped at AVX2 (as scripts/cpu_kinds.sh runs an AVX2-only CPU) saturates 8-bit products in int16."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    packed.has_vnni.cache_clear()
    try:
        assert not packed.has_vnni()
    finally:
        monkeypatch.undo()
        packed.has_vnni.cache_clear()
