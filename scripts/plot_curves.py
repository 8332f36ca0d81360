"""Plot validation BLEU and loss against training time from runs' TensorBoard logs.

python scripts/plot_curves.py runs/m30k_de_en runs/m30k_en_de -o docs/curves.png
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402


def read_scalars(run_dir: Path) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over all event files of a run (a resumed run has several)."""
    scalars: dict[str, dict[int, float]] = {}
    for events in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(events), size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars


def curve(scalars: dict[str, dict[int, float]], tag: str) -> tuple[list[float], list[float]]:
    """(minutes, values) of a validation scalar, timed by the `valid/minutes` scalar of the same step."""
    minutes = scalars.get("valid/minutes", {})
    points = sorted((minutes[s], v) for s, v in scalars.get(tag, {}).items() if s in minutes)
    return [p[0] for p in points], [p[1] for p in points]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args()
    fig, (ax_bleu, ax_loss) = plt.subplots(1, 2, figsize=(11, 4))
    for run in args.runs:
        scalars = read_scalars(run)
        ax_bleu.plot(*curve(scalars, "valid/bleu"), marker=".", label=run.name)
        ax_loss.plot(*curve(scalars, "valid/loss"), marker=".", label=run.name)
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
