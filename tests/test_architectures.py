"""Every architecture through the real CLI: train, translate (beam, n-best, sampling), evaluate, average, resume.

The model-level proofs (padding, causality, cache == forward, shifts) are in test_model.py;
search-level ones (beam 1 == greedy, batch invariance) in test_search.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, decodes_and_evaluates, tiny_overrides

from seq2seq.cli import main
from seq2seq.decoding.translate import Translator
from seq2seq.model import Seq2SeqRNN
from seq2seq.runs.checkpoint import load_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

# A small RNN with attention, two epochs: enough to exercise every command (~8 s on one thread);
# learning the task takes longer and is proven by the slow test below.
RNN = (
    "model.arch=rnn",
    "model.transformer=null",
    "model.d_model=32",
    "model.rnn.hidden_size=64",
    "model.rnn.attention=general",
    "train.max_epochs=2",
    "validation.bleu=false",
    "validation.best_metric=loss",
    "train.threads=1",
    "checkpoint.keep_last=2",
)
# Overrides of configs/tiny.yaml, and the share of test sentences each must reverse exactly after 20 epochs.
# The fixed-vector RNN has the whole sentence in one state and gets less (0.81-0.88 when measured) than the
# models that attend (0.92 and more): the point of the second lecture, on a toy. Measured on one machine as
# three CPU kinds (AVX-512, AVX2, no vector kernels): what a run learns moves with the kernels, so each
# bound leaves room below the lowest value seen.
ARCHITECTURES: dict[str, tuple[tuple[str, ...], float]] = {
    "rnn-lstm-general": (
        ("model.arch=rnn", "model.transformer=null", "model.rnn.attention=general", "model.rnn.hidden_size=64"),
        0.9,
    ),
    "rnn-lstm-none": (
        ("model.arch=rnn", "model.transformer=null", "model.rnn.attention=none", "model.rnn.hidden_size=128"),
        0.75,  # 0.81-0.88 when measured
    ),
    "rnn-gru-none-context": (
        (
            "model.arch=rnn",
            "model.transformer=null",
            "model.rnn.cell=gru",
            "model.rnn.attention=none",
            "model.rnn.context_every_step=true",
            "model.rnn.hidden_size=128",
        ),
        0.75,  # 0.85 when measured on each kind, about the LSTM's without the context at every step
    ),
    "rnn-gru-dot": (
        (
            "model.arch=rnn",
            "model.transformer=null",
            "model.rnn.cell=gru",
            "model.rnn.attention=dot",
            "model.rnn.hidden_size=64",
        ),
        0.9,
    ),
    "rnn-lstm-mlp": (
        ("model.arch=rnn", "model.transformer=null", "model.rnn.attention=mlp", "model.rnn.hidden_size=64"),
        0.9,
    ),
    "transformer-rope-rmsnorm": (
        ("model.transformer.positions=rope", "model.transformer.norm_type=rmsnorm"),
        0.85,  # 0.92-0.98 when measured
    ),
    "transformer-relative-post": (
        (
            "model.transformer.positions=relative",
            "model.transformer.norm=post",
            "model.transformer.max_relative_distance=8",
        ),
        0.9,
    ),
    "transformer-t5-bias": (
        ("model.transformer.positions=t5_bias",),
        0.7,  # 0.80 when measured (one run): below rope and relative positions at this budget
    ),
    # one stack of 2 + 2 layers; measured once, on an AVX-512 kind only, so the bars leave more room
    "decoder_only-prefix": (("model.arch=decoder_only", "model.max_positions=256"), 0.65),  # 0.83 when measured
    "decoder_only-causal": (
        ("model.arch=decoder_only", "model.max_positions=256", "model.decoder_only.prefix=causal"),
        0.6,  # 0.79 when measured
    ),
}


def exact_matches(checkpoint: Path, corpus: Path, **decode: object) -> float:
    translator = Translator.from_checkpoint(checkpoint).with_decode(**decode)
    src = (corpus / "test.src").read_text(encoding="utf-8").splitlines()
    ref = (corpus / "test.tgt").read_text(encoding="utf-8").splitlines()
    return sum(h == r for h, r in zip(translator.translate(src), ref)) / len(ref)


@pytest.fixture(scope="module")
def rnn_run(corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "rnn"
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run_dir, *RNN)]) == 0
    return run_dir


@pytest.mark.trains
def test_rnn_translates_evaluates_averages_and_resumes(
    rnn_run: Path, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert isinstance(load_checkpoint(rnn_run / "checkpoint_best.pt").model, Seq2SeqRNN)
    best = str(rnn_run / "checkpoint_best.pt")
    source = tmp_path / "in.txt"
    source.write_text("red cat dog\nblue sun\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    argv = ["translate", "-c", best, "-i", str(source), "-o", str(out)]
    assert main([*argv, "--format", "jsonl", "decode.nbest=3", "decode.beam_size=3"]) == 0
    records = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [len(r["nbest"]) for r in records] == [3, 3]
    assert main([*argv[:-1], str(tmp_path / "sampled.txt"), "decode.strategy=sample", "decode.top_k=3"]) == 0
    assert main(["evaluate", "-c", best]) == 0
    assert "BLEU" in capsys.readouterr().out
    averaged = tmp_path / "avg.pt"
    assert main(["average", "--run-dir", str(rnn_run), "--last", "2", "-o", str(averaged)]) == 0
    assert isinstance(load_checkpoint(averaged).model, Seq2SeqRNN)
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, rnn_run, *RNN, "train.max_epochs=3")]) == 0
    assert "resuming" in (rnn_run / "train.log").read_text(encoding="utf-8")


@pytest.mark.trains
@pytest.mark.parametrize("positions", ["t5_bias", "none"])
def test_positions_inside_attention_or_none_train_translate_evaluate_and_resume(
    positions: str, corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """T5's bias and NoPos through the CLI: train, translate (greedy, beam with n-best), evaluate, resume."""
    run = tmp_path / "run"
    settings = (
        f"model.transformer.positions={positions}",
        "model.d_model=32",
        "train.max_epochs=2",
        "train.threads=1",
        "validation.bleu=false",
        "validation.best_metric=loss",
    )
    assert main(["train", "--config", str(TINY), *tiny_overrides(corpus, run, *settings)]) == 0
    decodes_and_evaluates(str(run / "checkpoint_best.pt"), tmp_path, capsys, strategies=("greedy",))
    resumed = tiny_overrides(corpus, run, *settings, "train.max_epochs=3")
    assert main(["train", "--config", str(TINY), *resumed]) == 0
    assert "resuming" in (run / "train.log").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.trains
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_every_architecture_learns_to_reverse(name: str, corpus: Path, tmp_path: Path) -> None:
    """The tiny config's budget for each architecture (~1-2 minutes each on one shared core)."""
    overrides, threshold = ARCHITECTURES[name]
    extra = (*overrides, "train.max_epochs=20", "train.threads=1", "validation.bleu=false")
    assert (
        main(["train", "--config", str(TINY), *tiny_overrides(corpus, tmp_path, *extra, "validation.best_metric=loss")])
        == 0
    )
    assert exact_matches(tmp_path / "checkpoint_best.pt", corpus, strategy="greedy") >= threshold
