"""What a run saves: its checkpoints (best, step, last) and, at the end, the average of its last ones."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from seq2seq.config import ExperimentConfig
from seq2seq.runs.checkpoint import TRANSLATION, Checkpoint, Progress, TrainingState
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.tokenizer import Tokenizer

log = logging.getLogger("seq2seq.train")


@dataclass
class Saver:
    """Writes this run's checkpoints into its directory, on rank 0 only (`main`)."""

    run: RunDirectory
    config: ExperimentConfig  # recorded in every checkpoint, as the run was configured
    tokenizer: Tokenizer
    run_id: str
    keep_last: int = 0  # step checkpoints kept (checkpoint.keep_last); 0: all
    average_last: int = 0  # step checkpoints averaged at the end; 0: none
    main: bool = True
    kind: str = TRANSLATION  # what the checkpoints hold (seq2seq.runs.checkpoint)

    def save(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scaler: torch.amp.GradScaler,
        progress: Progress,
        improved: bool = False,
        keep: bool = False,
    ) -> None:
        """checkpoint_best (if improved), a step checkpoint (if keep) and, last, checkpoint_last, the commit
        point of a resume."""
        if not self.main:
            return
        state = TrainingState(progress, optimizer.state_dict(), scaler.state_dict())
        checkpoint = Checkpoint(
            self.config, self.tokenizer, model.state_dict(), self.run_id, state, step=progress.step, kind=self.kind
        )
        self.run.save(checkpoint, best=improved, keep_last=self.keep_last if keep else 0)

    def average(self) -> None:
        """Average this run's last `average_last` step checkpoints into checkpoint_average (rank 0)."""
        if not self.main or self.average_last <= 0:
            return
        paths = self.run.average_last(self.average_last, run_id=self.run_id)
        log.info("averaged %d checkpoints into %s", len(paths), self.run.average)
        if len(paths) < self.average_last:
            log.warning("checkpoint.average_last=%d, but this run kept %d step checkpoints (checkpoint.keep_last=%d)",
                        self.average_last, len(paths), self.keep_last)  # fmt: skip
