"""Summarise finished runs into the markdown table of docs/lectures.md.

    python scripts/lectures_table.py runs/lectures/* [--decode-seconds NAME=SECONDS ...]

Reads each run directory as `seq2seq train` and `seq2seq evaluate --format json > RUN/test_scores.txt`
left it: `metrics.jsonl` (parameters, updates, the median training tokens/s,
the best greedy val BLEU) and `test_scores.txt` (the
evaluate output with the config's beam, JSON or the text lines of older runs: sacreBLEU, chrF, and the lower-cased
tokenized BLEU when the dataset's tokenized references are there), and
`test_scores_greedy.txt` when there is one (the same with `decode.beam_size=1`,
the decoding of published tutorial numbers). Decoding speed is
not in a run directory: pass the wall time of each run's `evaluate` (1,000
test sentences) as NAME=SECONDS.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from dataclasses import dataclass
from pathlib import Path

from seq2seq.training.monitor import read_metrics

SCORE = re.compile(r"^(.+?) = ([\d.]+)")  # evaluate's lines: NAME = VALUE  (signature)
TOKENIZED = "BLEU (lc, Moses-tokenized)"
TEST_SENTENCES = 1000  # test_2016_flickr


@dataclass
class Run:
    name: str
    params: float
    updates: int
    epochs: int
    tokens_per_s: float
    minutes: float  # training wall time across resumes, at the last validation
    best_valid_bleu: float
    scores: dict[str, float]
    greedy: dict[str, float]


def read_scores(path: Path) -> dict[str, float]:
    """The scores `seq2seq evaluate --format json` printed into `path` (none if there is no such file);
    a file from before that option holds evaluate's text lines, read as they were printed."""
    if not path.exists():
        return {}
    text = path.read_text()
    if text.lstrip().startswith("{"):
        return {s["name"]: float(s["score"]) for s in json.loads(text)["scores"]}
    return {m.group(1): float(m.group(2)) for line in text.splitlines() if (m := SCORE.match(line))}


def read_run(run_dir: Path) -> Run:
    records = read_metrics(run_dir / "metrics.jsonl")
    starts = [r for r in records if r["event"] == "start"]
    finished = [r for r in records if r["event"] == "finish"]
    if not starts or not finished:
        raise SystemExit(f"{run_dir}: metrics.jsonl has no finished training")
    rates = [r["tokens_per_s"] for r in records if r["event"] == "train" and r.get("tokens_per_s") is not None]
    valid = [r["bleu"] for r in records if r["event"] == "valid" and r.get("bleu") is not None]
    scores = read_scores(run_dir / "test_scores.txt")
    if not scores:
        raise SystemExit(f"{run_dir}: no scores in test_scores.txt (seq2seq evaluate ... > RUN/test_scores.txt)")
    return Run(
        name=run_dir.name,
        params=starts[-1]["parameters"] / 1e6,
        updates=finished[-1]["step"],
        epochs=finished[-1]["epoch"] - 1,  # the epoch it was in: completed ones are before it
        tokens_per_s=statistics.median(rates) if rates else float("nan"),
        minutes=max((r["minutes"] for r in records if r["event"] == "valid" and "minutes" in r), default=float("nan")),
        best_valid_bleu=max(valid, default=float("nan")),
        scores=scores,
        greedy=read_scores(run_dir / "test_scores_greedy.txt"),
    )


def score(scores: dict[str, float], name: str) -> str:
    return f"{scores[name]:.2f}" if name in scores else "-"


def table(runs: list[Run], decode_seconds: dict[str, float]) -> str:
    rows = [
        "| run | parameters | updates (in epoch) | train min | training tok/s | decoding sent/s | best val BLEU | "
        "test sacreBLEU | chrF | test lc tok BLEU | same, greedy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        seconds = decode_seconds.get(r.name)
        speed = f"{TEST_SENTENCES / seconds:.0f}" if seconds else "-"
        rows.append(
            f"| {r.name} | {r.params:.1f}M | {r.updates} ({r.epochs}) | {r.minutes:.0f} | "
            f"{r.tokens_per_s:.0f} | {speed} | "
            f"{r.best_valid_bleu:.2f} | {score(r.scores, 'BLEU')} | {score(r.scores, 'chrF')} | "
            f"{score(r.scores, TOKENIZED)} | {score(r.greedy, TOKENIZED)} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--decode-seconds", nargs="*", default=[], metavar="NAME=SECONDS")
    args = parser.parse_args()
    seconds = {}
    for item in args.decode_seconds:
        name, _, value = item.partition("=")
        seconds[name] = float(value)
    print(table([read_run(r) for r in args.runs], seconds))


if __name__ == "__main__":
    main()
