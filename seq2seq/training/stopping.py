"""When training stops, and which validation is the best so far."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from seq2seq.config import TrainConfig, ValidationConfig
from seq2seq.runs.checkpoint import Progress

log = logging.getLogger("seq2seq.train")


@dataclass(frozen=True)
class StopPolicy:
    max_epochs: int  # 0: no limit
    max_steps: int = 0  # 0: no limit
    max_minutes: float = 0.0  # 0: no limit
    patience: int = 0  # validations without improvement; 0: never stop early
    best_metric: str = "bleu"  # bleu (higher is better) or loss

    @classmethod
    def from_config(cls, t: TrainConfig, v: ValidationConfig) -> StopPolicy:
        return cls(t.max_epochs, t.max_steps, t.max_minutes, v.patience, v.best_metric)

    def out_of_time(self, elapsed_seconds: float) -> bool:
        return bool(self.max_minutes) and elapsed_seconds >= 60 * self.max_minutes

    def reason(self, progress: Progress, signalled: bool, out_of_time: bool) -> str:
        """Why training must stop now ('' if it need not), most urgent first."""
        if signalled:
            return "signal"
        if self.max_steps and progress.step >= self.max_steps:
            return "max_steps"
        if out_of_time:
            return "max_minutes"
        if self.patience and progress.bad_validations >= self.patience:
            return "patience"
        if self.max_epochs and progress.epoch > self.max_epochs:  # 0: no epoch limit
            return "max_epochs"
        return ""

    def record(self, progress: Progress, scores: dict[str, float]) -> bool:
        """Update the best score and the early-stopping count; True if this validation is the best yet.

        BLEU is compared when asked for and measured, the loss otherwise.
        """
        p = progress
        key = "bleu" if self.best_metric == "bleu" and "bleu" in scores else "loss"
        value = scores[key]
        if p.best_metric != key:  # a new run, or the metric changed on resume
            p.best, p.best_metric = None, key
        improved = p.best is None or (value > p.best if key == "bleu" else value < p.best)
        if improved:
            p.best, p.bad_validations = value, 0
        else:
            p.bad_validations += 1
        shown = ", ".join(f"{k} {v:.3f}" for k, v in scores.items())
        waiting = f", {p.bad_validations} without improvement" if p.bad_validations else ""
        log.info("step %d: valid %s (best %s %.3f%s)", p.step, shown, key, p.best, waiting)
        return improved
