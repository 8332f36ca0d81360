"""Peak memory and update times of real training runs: fp32, bf16, and bf16 without bounded row counts.

Each setting runs `seq2seq train` (the quickstart config unless --config says
otherwise) for --steps updates in its own process, one after another, while
this script samples the process's resident memory every 0.2 s. It prints, per
setting: peak RSS, RSS at a few update counts, median target tokens/s, and the
update times (from the per-update log lines' timestamps): the median, the
slowest after the first 50 updates, and how many of those took over 3x the
median. `--busy` keeps one core busy with a spinning process during the runs,
as a neighbour would. `bf16-exact-rows` is bf16 with `seq2seq.device.row_bucket`
replaced by the identity, i.e. the behaviour before `BoundedRows` existed.

    .venv/bin/python scripts/bench/bench_memory.py --steps 500
    .venv/bin/python scripts/bench/bench_memory.py --steps 300 --settings fp32 bf16 --busy
"""

from __future__ import annotations

import argparse
import datetime
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = {
    "fp32": ("fp32", False),
    "bf16": ("bf16", False),
    "bf16-exact-rows": ("bf16", True),
}
# Runs the CLI in the child; `exact` replaces the row rounding by the identity (the behaviour before it).
CHILD = """
import sys
import seq2seq.device
if sys.argv[1] == "exact":
    seq2seq.device.row_bucket = lambda rows: rows
from seq2seq.cli import main
sys.exit(main(sys.argv[2:]))
"""
QUICKSTART = ROOT / "configs" / "quickstart.yaml"
# One model in every precision: the quickstart's `by_precision` block widens d_ff to 1,024 in bf16
QUICKSTART_WIDTH = ["model.transformer.d_ff=512"]
STEP_LINE = re.compile(r"^(\S+ \S+) (?:DEBUG|INFO) step (\d+): .* ([\d.]+) tokens/s$")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--threads", type=int, default=2, help="train.threads (default 2)")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--busy", action="store_true", help="keep one core busy with a spinning process meanwhile")
    p.add_argument("overrides", nargs="*", help="further config overrides, e.g. data.dir=...")
    args = p.parse_args()
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if args.busy else None
    try:
        for name in args.settings:
            report(name, run(name, args))
    finally:
        if spinner is not None:
            spinner.kill()


def run(name: str, args: argparse.Namespace) -> tuple[list[tuple[float, int]], Path]:
    """Train one setting; returns the (time, RSS bytes) samples and the run's log."""
    precision, exact = SETTINGS[name]
    run_dir = Path(tempfile.mkdtemp(prefix=f"bench_memory_{name}_"))
    command = [sys.executable, "-c", CHILD, "exact" if exact else "bounded", "train", "--config", args.config]
    command += [
        f"train.run_dir={run_dir}",
        f"train.precision={precision}",
        f"train.max_steps={args.steps}",
        f"train.threads={args.threads}",
        "validation.every=1000000",
        "train.log_every=1",
        *(QUICKSTART_WIDTH if Path(args.config).resolve() == QUICKSTART else []),
        *args.overrides,
    ]
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    samples = []
    while child.poll() is None:
        samples.append((time.time(), _rss(child.pid)))
        time.sleep(0.2)
    if child.returncode != 0:
        sys.exit(f"{name}: seq2seq train exited with {child.returncode} (see {run_dir}/train.log)")
    return samples, run_dir / "train.log"


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def report(name: str, result: tuple[list[tuple[float, int]], Path]) -> None:
    samples, log = result
    steps = []  # (step, wall time of its log line, tokens/s)
    for line in log.read_text().splitlines():
        m = STEP_LINE.match(line)
        if m:
            when = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            steps.append((int(m.group(2)), when, float(m.group(3))))
    times = [b[1] - a[1] for a, b in zip(steps, steps[1:])]  # update k+1's duration
    later = times[50:]
    median = statistics.median(later or times)
    rss_at = []
    for mark in (50, 100, 200, 300, 500, 1000):
        at = [t for s, t, _ in steps if s == mark]
        if at:
            rss_at.append(f"{mark}: {max((r for t, r in samples if t <= at[0]), default=0) / 2**30:.2f}")
    print(
        f"{name}: peak RSS {max(r for _, r in samples) / 2**30:.2f} GB (at update {', '.join(rss_at)} GB); "
        f"median {statistics.median(s[2] for s in steps):.0f} tok/s; update time median {median:.3f} s, "
        f"slowest after 50 {max(later, default=0):.3f} s, {sum(t > 3 * median for t in later)} of "
        f"{len(later)} over 3x the median"
    )


if __name__ == "__main__":
    main()
