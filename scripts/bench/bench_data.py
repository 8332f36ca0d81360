"""Large-corpus benchmark: prepare throughput, disk, memory and time to the first update, against the in-memory path.

    python scripts/bench/bench_data.py --pairs 1000000            # prepared path and the in-memory baseline at 1M pairs
    python scripts/bench/bench_data.py --pairs 10000000 --no-baseline

Builds a synthetic corpus of N pairs from the Multi30k training lines (copy c of
a line has one word dropped and two swapped, both chosen by c, so lines differ),
then, each in its own process with the quickstart model:

1. `seq2seq prepare`: wall time (pairs/s), bytes on disk per pair, peak RSS;
2. `seq2seq train` on the prepared data for `--updates` updates: time from the
   start of the process to the first update, peak RSS (all of it, and the
   anonymous part: memory-mapped pages are file-backed and can be dropped);
   with `--replicate K`, also on the prepared shards hard-linked K times (a
   corpus K times larger for training, without preparing it again);
3. the same training run with the code of `--baseline-ref` (the in-memory
   path: every line in Python lists, encoded at each start), same numbers.

Peak memory is sampled every 0.1 s over the process and its children (the
prepare workers, DataLoader workers, torchrun ranks).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import shutil
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
QUICKSTART = ROOT / "configs" / "quickstart.yaml"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=1_000_000)
    p.add_argument("--data", default="data/multi30k", help="Multi30k directory (train/val .de/.en)")
    p.add_argument("--work", default="/tmp/bench_data", help="scratch directory (corpus, runs, prepared data)")
    p.add_argument("--updates", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="train.threads (one: the machine is shared)")
    p.add_argument("--workers", type=int, default=0, help="prepare processes (default: one per CPU)")
    p.add_argument("--num-workers", type=int, default=1, help="train.num_workers of the prepared run")
    p.add_argument("--baseline-ref", default="fae6f17", help="git commit of the in-memory path")
    p.add_argument("--no-baseline", action="store_true")
    p.add_argument("--skip-prepare", action="store_true", help="reuse the prepared data of an earlier run")
    p.add_argument("--ranks", type=int, default=1, help="also train with this many torchrun ranks (>1)")
    p.add_argument("--replicate", type=int, default=1, help="also train on the prepared shards linked K times")
    args = p.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    corpus = make_corpus(Path(args.data), work / f"corpus{args.pairs}", args.pairs)
    print(f"CPU: {cpu_flags()}")
    common = [f"data.dir={corpus}", "train.device=cpu", "validation.bleu=false", "train.log_every=1",
              f"train.max_steps={args.updates}", "train.max_minutes=0", f"train.threads={args.threads}"]  # fmt: skip
    prepared = work / f"prepared{args.pairs}"
    common.append(f"data.prepared_dir={prepared}")
    if not args.skip_prepare:
        shutil.rmtree(prepared, ignore_errors=True)
        prep = measure([sys.executable, "-m", "seq2seq", "prepare", "--config", str(QUICKSTART), "--workers",
                        str(args.workers), *common], os.environ.copy())  # fmt: skip
        disk = sum(f.stat().st_size for f in prepared.iterdir())
        print(f"prepare: {args.pairs / prep['seconds']:,.0f} pairs/s ({prep['seconds']:.0f} s), "
              f"{disk / args.pairs:.0f} bytes/pair on disk ({disk / 2**30:.2f} GiB), "
              f"peak RSS {gib(prep['rss'])} (anonymous {gib(prep['anon'])})")  # fmt: skip
    run = work / f"run{args.pairs}"
    shutil.rmtree(run, ignore_errors=True)
    trained = measure([sys.executable, "-m", "seq2seq", "-v", "train", "--config", str(QUICKSTART), *common,
                       f"train.run_dir={run}", f"train.num_workers={args.num_workers}"], os.environ.copy())  # fmt: skip
    report("train, prepared data", trained)
    big = prepared
    if args.replicate > 1:
        big = replicate(prepared, work / f"prepared{args.pairs}x{args.replicate}", args.replicate)
        bigrun = work / f"run{args.pairs}x{args.replicate}"
        shutil.rmtree(bigrun, ignore_errors=True)
        command = [sys.executable, "-m", "seq2seq", "-v", "train", "--config", str(QUICKSTART), *common,
                   f"train.run_dir={bigrun}", f"data.prepared_dir={big}",
                   f"train.num_workers={args.num_workers}"]  # fmt: skip
        report(
            f"train, prepared data replicated to {args.pairs * args.replicate:,} pairs",
            measure(command, os.environ.copy()),
        )
    if args.ranks > 1:
        ranked = work / f"run{args.pairs}_ranks"
        shutil.rmtree(ranked, ignore_errors=True)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
                   "-m", "seq2seq", "-v", "train", "--config", str(QUICKSTART), *common, f"train.run_dir={ranked}",
                   f"data.prepared_dir={big if args.replicate > 1 else prepared}"]  # fmt: skip
        report(f"train, prepared data ({big.name}), {args.ranks} torchrun ranks", measure(command, os.environ.copy()))
    if not args.no_baseline:
        old = export(args.baseline_ref, work / "baseline_code")
        base = work / f"run{args.pairs}_baseline"
        shutil.rmtree(base, ignore_errors=True)
        env = {**os.environ, "PYTHONPATH": str(old)}
        command = [
            sys.executable,
            "-m",
            "seq2seq",
            "-v",
            "train",
            "--config",
            str(QUICKSTART),
            *common[:-1],
            f"train.run_dir={base}",
        ]  # fmt: skip (common[-1] is data.prepared_dir, which it does not know)
        baseline = measure(command, env, cwd=old)
        report(f"train, in-memory path ({args.baseline_ref})", baseline)
        first = baseline["first_update"]
        print(f"in-memory / prepared: time to first update {first / trained['first_update']:.1f}x, peak RSS of the "
              f"largest process {baseline['rss_max_process'] / trained['rss_max_process']:.1f}x")  # fmt: skip
        if not args.skip_prepare:
            print(f"prepare {args.pairs / prep['seconds']:,.0f} pairs/s vs in-memory load "
                  f"{args.pairs / first:,.0f} pairs/s (its time to the first update)")  # fmt: skip


def replicate(prepared: Path, out: Path, k: int) -> Path:
    """The prepared directory with its shards hard-linked k times: a k-times larger corpus for training."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    manifest = json.loads((prepared / "manifest.json").read_text())
    shards = []
    for _ in range(k):
        for shard in manifest["shards"]:
            name = f"shard{len(shards)}"
            for f in prepared.glob(shard["name"] + ".*"):
                os.link(f, out / (name + f.name[len(shard["name"]) :]))
            shards.append({**shard, "name": name})
    for f in prepared.glob("spm*.model"):
        os.link(f, out / f.name)
    manifest.update(shards=shards, pairs=manifest["pairs"] * k, lines=manifest["lines"] * k)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


def make_corpus(data: Path, out: Path, n: int) -> Path:
    if (out / "train.en").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for split in ("val", "test_2016_flickr"):
        for lang in ("de", "en"):
            for suffix in ("", ".gz"):
                if (data / f"{split}.{lang}{suffix}").is_file():
                    shutil.copy(data / f"{split}.{lang}{suffix}", out / f"{split}.{lang}{suffix}")
    for lang in ("de", "en"):
        lines = read(data, "train", lang)
        with open(out / f"train.{lang}", "w", encoding="utf-8") as f:
            for i in range(n):
                f.write(vary(lines[i % len(lines)], i // len(lines)) + "\n")
    return out


def read(data: Path, split: str, lang: str) -> list[str]:
    import gzip

    path = data / f"{split}.{lang}"
    if path.is_file():
        return path.read_text(encoding="utf-8").splitlines()
    return gzip.decompress((data / f"{split}.{lang}.gz").read_bytes()).decode("utf-8").splitlines()


def vary(line: str, copy: int) -> str:
    """Copy 0 is the line; copy c drops one word and swaps two, chosen by c."""
    words = line.split()
    if copy == 0 or len(words) < 3:
        return line
    rng = random.Random(copy)
    del words[rng.randrange(len(words))]
    a, b = rng.randrange(len(words)), rng.randrange(len(words))
    words[a], words[b] = words[b], words[a]
    return " ".join(words)


def export(ref: str, dest: Path) -> Path:
    """The package as it was at `ref` (git archive), to run the in-memory path beside this one."""
    if not (dest / "seq2seq").is_dir():
        data = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "seq2seq"], check=True, capture_output=True)
        dest.mkdir(parents=True, exist_ok=True)
        tarfile.open(fileobj=io.BytesIO(data.stdout)).extractall(dest)
    return dest


def measure(command: list[str], env: dict[str, str], cwd: Path = ROOT) -> dict[str, float]:
    """Run a command; wall time, time until `step 1: loss` appears on stderr, peak RSS and anonymous RSS."""
    start = time.monotonic()
    proc = subprocess.Popen(command, cwd=cwd, env=env, stderr=subprocess.PIPE, text=True)
    peaks = {"rss": 0.0, "anon": 0.0, "rss_max_process": 0.0, "anon_max_process": 0.0}
    done = threading.Event()

    def poll() -> None:
        while not done.is_set():
            usage = [memory(pid) for pid in tree(proc.pid)]
            peaks["rss"] = max(peaks["rss"], sum(u[0] for u in usage))
            peaks["anon"] = max(peaks["anon"], sum(u[1] for u in usage))
            peaks["rss_max_process"] = max([peaks["rss_max_process"], *(u[0] for u in usage)])
            peaks["anon_max_process"] = max([peaks["anon_max_process"], *(u[1] for u in usage)])
            time.sleep(0.1)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    first = ready = 0.0
    tail: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        tail = (tail + [line])[-20:]
        if not ready and "training from step" in line:
            ready = time.monotonic() - start
        if not first and "step 1: loss" in line:
            first = time.monotonic() - start
    code = proc.wait()
    done.set()
    thread.join()
    if code != 0:
        sys.exit(f"{' '.join(command[:6])} ... failed ({code}):\n{''.join(tail)}")
    return {**peaks, "seconds": time.monotonic() - start, "first_update": first, "ready": ready}


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except OSError:
            pass
    return pids


def memory(pid: int) -> tuple[float, float]:
    """(RSS, anonymous RSS) in bytes."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0, 0.0
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    kb = lambda key: float(fields.get(key, "0 kB").split()[0]) * 1024  # noqa: E731
    return kb("VmRSS"), kb("RssAnon")


def report(name: str, m: dict[str, float]) -> None:
    print(f"{name}: data and model ready after {m['ready']:.1f} s, first update after {m['first_update']:.1f} s, "
          f"peak RSS {gib(m['rss'])} "
          f"(anonymous {gib(m['anon'])}; largest process {gib(m['rss_max_process'])}, "
          f"anonymous {gib(m['anon_max_process'])}), "
          f"{m['seconds']:.0f} s in all")  # fmt: skip


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def cpu_flags() -> str:
    info = Path("/proc/cpuinfo").read_text()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = set(next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), []))
    return f"{model}; " + ", ".join(f"{f}={'yes' if f in flags else 'no'}" for f in ["avx2", "avx512f", "avx512_bf16"])


if __name__ == "__main__":
    main()
