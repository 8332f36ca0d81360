"""The helper scripts run end to end on the tiny trained run, through their command lines, in seconds."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, single_thread_env

from seq2seq import errors, metrics
from seq2seq.decoding.translate import Translator

SCRIPTS = ROOT / "scripts"


def start_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """Run scripts/`name` to its end, one thread, its output captured."""
    return subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=cwd,
        env=single_thread_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def run_script(name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    proc = start_script(name, *args, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    return proc


def test_plot_curves_draws_a_png_from_the_runs_metrics(trained_run: Path, tmp_path: Path) -> None:
    output = tmp_path / "plots" / "curves.png"  # a directory that does not exist yet
    proc = run_script("plot_curves.py", str(trained_run), "-o", str(output), cwd=tmp_path)
    assert str(output) in proc.stdout
    assert output.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.parametrize("what", ["missing", "empty"])
def test_plot_curves_without_metrics_is_one_line(what: str, tmp_path: Path) -> None:
    run = tmp_path / "run"
    if what == "empty":
        run.mkdir()
        (run / "metrics.jsonl").write_text('{"event": "start", "step": 0, "epoch": 1, "parameters": 10}\n')
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "plot_curves.py"), str(run), "-o", str(tmp_path / "c.png")],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1 and len(proc.stderr.splitlines()) == 1 and str(run) in proc.stderr
    assert not (tmp_path / "c.png").exists()


@pytest.mark.usefixtures("one_thread")  # as the script's --threads 1
def test_decode_grid_prints_one_row_per_beam_and_one_column_per_alpha(
    trained_run: Path, corpus: Path, tmp_path: Path
) -> None:
    checkpoint = str(trained_run / "checkpoint_best.pt")
    args = [checkpoint, "--beams", "1", "2", "--alphas", "0.6", "1.4", "--threads", "1"]
    table = [
        line for line in run_script("bench/decode_grid.py", *args, cwd=tmp_path).stdout.splitlines() if "|" in line
    ]
    assert table[0] == "| beam | alpha 0.6 | alpha 1.4 |" and table[1] == "|---|---|---|"
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table[2:]]
    assert [row[0] for row in rows] == ["1", "2"]
    scores = [[float(cell) for cell in row[1:]] for row in rows]
    assert scores[0][0] == scores[0][1]  # greedy search has no length penalty
    translator = Translator.from_checkpoint(checkpoint, strategy="beam", nbest=1)
    src, refs = (corpus / "val.src").read_text().splitlines(), (corpus / "val.tgt").read_text().splitlines()
    for beam, row in zip((1, 2), scores):  # each cell: the val BLEU of the checkpoint so decoded, whatever it learnt
        for alpha, score in zip((0.6, 1.4), row):
            hyps = translator.with_decode(beam_size=beam, length_penalty=alpha).translate(src)
            assert score == round(metrics.bleu(hyps, refs).score, 2), (beam, alpha)


def test_bench_decode_reports_speed_ratios_and_identical_outputs(
    trained_run: Path, corpus: Path, tmp_path: Path
) -> None:
    results = tmp_path / "bench.json"
    args = ["-c", str(trained_run / "checkpoint_best.pt"), "--src", str(corpus / "test.src"), "-n", "12"]
    args += ["--rounds", "1", "--modes", "greedy,beam", "--beam", "2", "--threads", "1", "--json", str(results)]
    proc = run_script("bench/bench_decode.py", *args, cwd=tmp_path)
    assert "differ" not in proc.stderr  # the cached search gives the uncached search's tokens
    ratio_lines = [line for line in proc.stdout.splitlines() if "cached / uncached speed = " in line]
    assert [line.split(":")[0] for line in ratio_lines] == ["greedy", "beam"]
    summary = json.loads(results.read_text(encoding="utf-8"))
    assert set(summary["runs"]) == {"greedy cached", "greedy uncached", "beam2 cached", "beam2 uncached"}
    assert all(len(ratios) == 1 and ratios[0] > 0 for ratios in summary["ratios"].values())


@pytest.mark.usefixtures("one_thread")  # as the script's --threads 1
def test_bench_decode_compares_engines(trained_run: Path, corpus: Path, tmp_path: Path) -> None:
    """This code against an earlier commit's (here HEAD: the same outputs) and the CTranslate2 export, on the
    checkpoint and on a random-weight model of the peer benchmark's smaller shape."""
    results = tmp_path / "engines.json"
    systems = "before,pytorch" + (",ct2-float32" if importlib.util.find_spec("ctranslate2") else "")
    args = ["--compare", "engines", "-c", str(trained_run / "checkpoint_best.pt"), "--systems", systems]
    args += ["--src", str(corpus / "test.src"), "--ref", str(corpus / "test.tgt"), "-n", "8", "--rounds", "1"]
    args += ["--beam", "2", "--threads", "1", "--baseline-rev", "HEAD", "--shapes", "checkpoint,tiny"]
    args += ["--shape-length", "3", "--json", str(results)]
    proc = run_script("bench/bench_decode.py", *args, cwd=tmp_path)
    assert "first call" in proc.stdout
    summary = json.loads(results.read_text(encoding="utf-8"))
    assert set(summary["results"]) == {"checkpoint greedy", "checkpoint beam2", "tiny greedy", "tiny beam2"}
    for table in summary["results"].values():
        assert set(table) == set(systems.split(","))
        assert table["before"]["same_as_pytorch"] == 1.0
        assert all(r["sent_per_s"][0] > 0 and r["first_call_s"] > 0 for r in table.values())
    checkpoint = summary["results"]["checkpoint greedy"]
    translator = Translator.from_checkpoint(trained_run / "checkpoint_best.pt", strategy="greedy", beam_size=2)
    src, refs = (corpus / "test.src").read_text().splitlines()[:8], (corpus / "test.tgt").read_text().splitlines()[:8]
    assert checkpoint["pytorch"]["bleu"] == metrics.bleu(translator.translate(src), refs).score  # of its outputs
    if "ct2-float32" in checkpoint:
        assert checkpoint["ct2-float32"]["same_as_pytorch"] >= 0.8  # the same model in another engine


MISSING = "nowhere"  # a file name the cases below give a script, in a directory that does not hold it
CHECKPOINT = "<the trained checkpoint>"
NO_DATA = f"missing data file: {MISSING}"


@pytest.mark.parametrize(
    ("script", "args", "said"),
    [
        (
            "bench/bench_decode.py",
            ["-c", CHECKPOINT, "--compare", "cache", "--src", MISSING],
            NO_DATA,
        ),
        (
            "bench/bench_decode.py",
            ["-c", CHECKPOINT, "--compare", "engines", "--src", MISSING],
            NO_DATA,
        ),
        ("bench/decode_grid.py", [MISSING], f"checkpoint not found: {MISSING}"),
        ("bench/export_fidelity.py", [f"a={MISSING}"], f"checkpoint not found: {MISSING}"),
        (
            "bench/bench_serve.py",
            ["-c", CHECKPOINT, "-i", MISSING],
            f"[Errno 2] No such file or directory: '{MISSING}'",
        ),
    ],
)
def test_a_script_names_a_missing_file_in_one_line(
    trained_run: Path, tmp_path: Path, script: str, args: list[str], said: str
) -> None:
    """As the CLI does: one line `script: message`, exit code 1, no traceback (`seq2seq.errors.run_script`)."""
    args = [str(trained_run / "checkpoint_best.pt") if arg == CHECKPOINT else arg for arg in args]
    proc = start_script(script, *args, cwd=tmp_path)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    name = Path(script).stem
    assert proc.stderr.strip().splitlines() == [f"{name}: {said}"]


def test_run_script_exits_as_the_cli_does(capsys: pytest.CaptureFixture[str]) -> None:
    def bad_key() -> None:
        raise errors.ConfigError("unknown key: train.lr_max")

    with pytest.raises(SystemExit) as stopped:
        errors.run_script("a_script", bad_key)
    assert stopped.value.code == 2
    assert capsys.readouterr().err == "a_script: unknown key: train.lr_max\n"
    errors.run_script("a_script", lambda: None)  # a main that returns: nothing said, no exit


def test_bench_decode_says_when_two_ctranslate2_engines_share_a_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two CTranslate2 engines on the CPU in one run slow each other, so such a run says so; one does not."""
    spec = importlib.util.spec_from_file_location("bench_engines", SCRIPTS / "bench" / "bench_engines.py")
    assert spec is not None and spec.loader is not None
    engines = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_engines", engines)  # its dataclasses look their module up
    spec.loader.exec_module(engines)
    note = engines.shared_runtime_note(["pytorch", "ct2-float32", "ct2-int8"], "cpu")
    assert note is not None and "ct2-float32 and ct2-int8" in note
    assert engines.shared_runtime_note(["pytorch", "ct2-float32", "hf"], "cpu") is None
    assert engines.shared_runtime_note(["ct2-float32", "ct2-int8"], "cuda") is None


def test_bench_decode_compares_with_hf_generate_in_the_same_batches(
    trained_run: Path, corpus: Path, tmp_path: Path
) -> None:
    """The Marian export decoded by transformers' `generate` beside this code, both given the same batches
    of sentences: on a post-norm shape the same model, so greedy translates alike; a model Marian cannot
    hold is left out of the hf column with a line saying why."""
    pytest.importorskip("transformers")
    results = tmp_path / "engines.json"
    args = ["--compare", "engines", "-c", str(trained_run / "checkpoint_best.pt"), "--systems", "pytorch,hf"]
    args += ["--src", str(corpus / "test.src"), "--ref", str(corpus / "test.tgt"), "-n", "10", "--rounds", "1"]
    args += ["--beam", "2", "--threads", "1", "--shapes", "checkpoint,tiny", "--shape-length", "4"]
    args += ["--batch-sentences", "4", "--json", str(results)]
    proc = run_script("bench/bench_decode.py", *args, cwd=tmp_path)
    summary = json.loads(results.read_text(encoding="utf-8"))
    assert "batches of 4 sentences" in proc.stdout
    for mode in ("greedy", "beam2"):
        table = summary["results"][f"tiny {mode}"]
        assert set(table) == {"pytorch", "hf"}
        assert all(r["sent_per_s"][0] > 0 for r in table.values())
    assert summary["results"]["tiny greedy"]["hf"]["same_as_pytorch"] >= 0.8  # one model, two engines
    checkpoint = summary["results"]["checkpoint greedy"]
    assert "hf" in checkpoint or "hf: checkpoint_best.pt is left out" in proc.stderr
    translator = Translator.from_checkpoint(trained_run / "checkpoint_best.pt", strategy="greedy", beam_size=2)
    src, refs = (corpus / "test.src").read_text().splitlines()[:10], (corpus / "test.tgt").read_text().splitlines()[:10]
    assert checkpoint["pytorch"]["bleu"] == metrics.bleu(translator.translate(src), refs).score  # in input order


@pytest.mark.trains  # the script runs training updates in a child process
@pytest.mark.parametrize(
    ("compare", "first", "second"),
    [("rdrop", "plain", "rdrop"), ("batching", "longer-side", "both-sides")],
)
def test_bench_train_times_two_update_settings_round_by_round(
    corpus: Path, trained_run: Path, tmp_path: Path, compare: str, first: str, second: str
) -> None:
    """A comparison runs real training updates of both settings, round by round, and reports a ratio."""
    args = ["--data", str(corpus), "--langs", "src,tgt", "--spm", str(trained_run / "spm.model"), "--models", "tiny"]
    args += ["--rounds", "2", "--steps", "1", "--threads", "1", "--max-tokens", "256", "--compare", compare]
    out = run_script("bench/bench_train.py", *args, cwd=tmp_path).stdout
    rounds = [line for line in out.splitlines() if line.strip().startswith("round ")]
    assert len(rounds) == 2 and all(f"{first} " in r and f"{second}/{first}" in r for r in rounds)
    assert "ratio median" in out
    if compare == "batching":  # both orders' padding over the whole epoch
        assert "longer side only:" in out and "trainer's (both sides):" in out and "of the target positions" in out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize(
    ("compare", "first", "second"), [("gpu-precision", "fp32", "bf16"), ("gpu-attention", "pytorch", "efficient")]
)
def test_bench_train_times_updates_on_the_gpu(
    corpus: Path, trained_run: Path, tmp_path: Path, compare: str, first: str, second: str
) -> None:
    args = ["--data", str(corpus), "--langs", "src,tgt", "--spm", str(trained_run / "spm.model"), "--models", "tiny"]
    args += ["--rounds", "2", "--steps", "1", "--max-tokens", "256", "--compare", compare, "--device", "cuda"]
    out = run_script("bench/bench_train.py", *args, cwd=tmp_path).stdout
    assert "GPU: " in out and f"{second}/{first} ratio median" in out


def test_bench_train_refuses_a_gpu_comparison_on_the_cpu(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPTS / "bench/bench_train.py"), "--compare", "gpu-attention"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 2 and "--compare gpu-attention needs --device cuda" in done.stderr


@pytest.mark.trains  # three updates of an untrained model, and a bound on their loss
def test_peer_adapter_runs_the_projects_update_and_search() -> None:
    """The bridge the peer benchmark suite calls: real updates, and decodes of exactly the forced length."""
    import importlib.util

    import torch

    from seq2seq.text.vocab import BOS, PAD

    spec = importlib.util.spec_from_file_location("peer_adapter", SCRIPTS / "peer_adapter.py")
    assert spec is not None and spec.loader is not None
    adapter = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(adapter)
    shape = dict(enc_layers=1, dec_layers=1, d_model=32, ffn=64, heads=4, vocab=50, dropout=0.1, label_smoothing=0.1)
    generator = torch.Generator().manual_seed(0)
    tgt = torch.randint(4, 50, (8, 6), generator=generator)
    tgt_out = torch.cat([tgt, torch.full((8, 1), 3)], dim=1)  # EOS = 3
    batch = {"src": tgt.flip(1), "tgt_in": torch.cat([torch.full((8, 1), BOS), tgt], 1), "tgt_out": tgt_out}
    batch["n_tgt"] = int((tgt_out != PAD).sum())
    step, info = adapter.build_train_step(shape, [batch], "fp32")
    losses = [step(batch) for _ in range(3)]
    assert all(4.0 < loss < 5.0 for loss in losses)  # about log(50) for an untrained model, and finite
    assert info["clip_norm"] == 1.0 and info["norm"] == "post" and info["optimizer"] == "Adam"
    run, expected = adapter.build_decode(shape, 2, batch["src"], 5)
    assert run() == [expected] * 8 == [6] * 8


def test_profile_train_reports_bucket_shares(tmp_path: Path) -> None:
    args = ["--models", "quickstart", "--steps", "1", "--threads", "1", "--vocab", "100", "--sentences", "4"]
    out = run_script("bench/profile_train.py", *args, "--length", "8", cwd=tmp_path).stdout
    shares = {line.split()[0]: float(line.split()[1].rstrip("%")) for line in out.splitlines() if line.endswith("%")}
    assert {"matmul", "rest"} <= set(shares) and sum(shares.values()) == pytest.approx(100, abs=0.5)
    rates = [float(word) for word in out.split("matmul rate:")[1].split() if word.replace(".", "").isdigit()]
    assert len(rates) == 2 and all(rate > 0 for rate in rates)


@pytest.mark.parametrize("format", ["json", "text"])  # text: the scores files of runs from before --format json
def test_lectures_table_reads_a_run_and_its_scores(
    trained_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], format: str
) -> None:
    from seq2seq.cli import main

    run = tmp_path / "tiny"
    run.mkdir()
    (run / "metrics.jsonl").write_text((trained_run / "metrics.jsonl").read_text())
    checkpoint = str(trained_run / "checkpoint_best.pt")
    assert main(["evaluate", "-c", checkpoint, "--threads", "1", "--format", format]) == 0
    scores = capsys.readouterr().out
    (run / "test_scores.txt").write_text(scores)
    if format == "json":
        bleu, chrf = (str(s["score"]) for s in json.loads(scores)["scores"][:2])
    else:
        bleu, chrf = (line.split()[2] for line in scores.splitlines()[:2])

    proc = run_script("lectures_table.py", str(run), "--decode-seconds", "tiny=20", cwd=tmp_path)
    header, _, row = proc.stdout.splitlines()
    cells = [c.strip() for c in row.strip("|").split("|")]
    columns = dict(zip([c.strip() for c in header.strip("|").split("|")], cells))
    params = (trained_run / "train.log").read_text().split("model: ")[1].split("M parameters")[0]
    assert columns["run"] == "tiny" and columns["parameters"] == f"{float(params):.1f}M"
    assert columns["decoding sent/s"] == "50"  # 1,000 test sentences in 20 s
    records = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
    minutes = [r["minutes"] for r in records if "minutes" in r]
    assert columns["train min"] == f"{max(minutes):.0f}"  # the training wall time at its last validation
    assert columns["test sacreBLEU"] == f"{float(bleu):.2f}" and columns["chrF"] == f"{float(chrf):.2f}"
    assert columns["same, greedy"] == "-"  # no test_scores_greedy.txt

    (run / "metrics.jsonl").write_text("")  # a run that never finished training is named, not skipped
    failed = subprocess.run(
        [sys.executable, str(SCRIPTS / "lectures_table.py"), str(run)], capture_output=True, text=True
    )
    assert failed.returncode != 0 and f"{run}: metrics.jsonl has no finished training" in failed.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole CUDA check")
def test_gpu_check_says_there_is_no_cuda_device_and_succeeds() -> None:
    done = subprocess.run(["bash", str(SCRIPTS / "gpu_check.sh")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "no CUDA device: nothing to check" in done.stdout


def test_cpu_kinds_runs_marked_tests_as_another_cpu_kind_and_names_failures(tmp_path: Path) -> None:
    """One quick marked test as a CPU without vector kernels would run it (not marked itself: the script runs
    the marked tests, this one among them it would start itself again)."""
    env = {**single_thread_env(), "CPU_KINDS_LOGS": str(tmp_path / "logs")}
    test = "tests/test_training.py::test_a_nan_loss_skips_the_update_with_a_warning"
    script = ["bash", str(SCRIPTS / "cpu_kinds.sh")]
    done = subprocess.run([*script, "default", "--", test], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ATEN_CPU_CAPABILITY=default" in done.stdout and "every kind passed" in done.stdout.splitlines()[-1]
    assert "1 passed" in (tmp_path / "logs" / "default.log").read_text()
    failing = subprocess.run(
        [*script, "default", "--", test, "-k", "nan", "--deselect", test], cwd=ROOT, env=env, capture_output=True
    )
    assert failing.returncode == 1 and b"failed: default" in failing.stdout  # nothing ran: pytest's exit 5
    unknown = subprocess.run([*script, "sse9"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert unknown.returncode == 2 and "cannot run kind 'sse9'" in unknown.stderr


def test_bench_long_attention_writes_a_table_and_a_plot_and_skips_what_would_take_too_long(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    table, picture = tmp_path / "long.md", tmp_path / "long.png"
    args = ["--lengths", "32", "64", "--kinds", "full", "local_global", "--d-model", "16", "--heads", "2"]
    args += ["--window", "4", "--repeats", "1", "--max-seconds", "1e-9", "--table", str(table), "--plot", str(picture)]
    run_script("bench/bench_long_attention.py", *args, cwd=tmp_path)
    rows = [line for line in table.read_text().splitlines() if line.startswith("| 32 ") or line.startswith("| 64 ")]
    assert len(rows) == 2 and "skipped" not in rows[0] and "skipped: ~" in rows[1].split("|")[2]
    assert rows[1].split("|")[3].count("/") == 1  # local_global measured at both lengths: seconds / MB
    assert picture.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
