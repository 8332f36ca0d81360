"""Plot validation BLEU and loss against training time from runs' metrics.jsonl.

python scripts/plot_curves.py runs/m30k_de_en runs/m30k_en_de -o docs/curves.png
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure  # drawn off screen, without pyplot's GUI backends

from seq2seq.training.monitor import read_metrics


def validations(run_dir: Path) -> list[dict[str, Any]]:
    """The "valid" records of a run (a resumed run's last record of each step); one line and exit 1 if none."""
    if not run_dir.is_dir():
        raise SystemExit(f"plot_curves: {run_dir} is not a run directory")
    records = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["event"] == "valid"]
    if not records:
        raise SystemExit(f"plot_curves: {run_dir / 'metrics.jsonl'} holds no validation (train with this version)")
    return records


def curve(records: list[dict[str, Any]], name: str) -> tuple[list[float], list[float]]:
    """(minutes of training, values) of one validation score."""
    points = [(r["minutes"], r[name]) for r in records if r.get(name) is not None and r.get("minutes") is not None]
    return [p[0] for p in points], [p[1] for p in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    runs = {run: validations(run) for run in args.runs}  # every run checked before drawing
    fig = Figure(figsize=(11, 4))
    ax_bleu, ax_loss = fig.subplots(1, 2)
    for run, records in runs.items():
        ax_bleu.plot(*curve(records, "bleu"), marker=".", label=run.name)
        ax_loss.plot(*curve(records, "loss"), marker=".", label=run.name)
    ax_bleu.set(xlabel="training minutes", ylabel="valid BLEU (sacreBLEU, greedy)", title="Validation BLEU")
    ax_loss.set(xlabel="training minutes", ylabel="valid loss (label-smoothed, nats)", title="Validation loss")
    for ax in (ax_bleu, ax_loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=110)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
