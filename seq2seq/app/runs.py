"""Work on a run directory: training it, preparing its data, averaging its checkpoints."""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from seq2seq import interrupt
from seq2seq.app.files import refuse_overwriting, same_file
from seq2seq.config import MAX_THREADS, ExperimentConfig
from seq2seq.errors import UsageError, UserError

log = logging.getLogger("seq2seq")


def train(cfg: ExperimentConfig, pretrain: bool = False) -> int:
    """Train (or resume) a run, or with `pretrain` a masked-LM pretraining run of the encoder; the exit code:
    0 when it ended by itself, 128 + the signal that stopped it."""
    from seq2seq.training.assembly import assemble
    from seq2seq.training.distributed import peer_failures
    from seq2seq.training.pretrain import assemble_pretrain
    from seq2seq.training.trainer import Trainer

    try:
        with peer_failures():
            trainer = Trainer(assemble_pretrain(cfg) if pretrain else assemble(cfg))
            trainer.fit()
    except KeyboardInterrupt as e:  # before training started, or a second Ctrl-C
        return interrupt.report(e, "; checkpoint_last.pt (if any) holds the last saved state")
    if trainer.stop.received:
        print(f"seq2seq: stopped by {trainer.stop.received.name}; run the same command to resume", file=sys.stderr)
    return trainer.stop.exit_code


def prepare_data(cfg: ExperimentConfig, workers: int = 0) -> None:
    """Prepare (or check) the training data, under the run's lock; a run with a checkpoint keeps its tokenizer,
    a fine-tuning run (`train.init_from`) uses its parent's, one with `train.init_encoder_from` the pretrained
    encoder's.

    workers: encoding processes (0: one per CPU).
    """
    if not 0 <= workers <= MAX_THREADS:
        raise UsageError(f"--workers must be in [0, {MAX_THREADS}], got {workers}")
    from seq2seq.runs.run_dir import RunDirectory
    from seq2seq.text.prepare import ensure_prepared
    from seq2seq.training.encoder_init import read_pretrained
    from seq2seq.training.finetune import read_parent
    from seq2seq.training.setup import prepared_path

    run = RunDirectory(cfg.train.run_dir)
    run.acquire()  # never rebuild the data under a `train` running in this directory
    try:
        resume = run.resume_point()
        # a fine-tuning run encodes with its parent's, a run with train.init_encoder_from with the pretraining run's
        origin = resume or read_parent(cfg, run) or read_pretrained(cfg, run)
        tokenizer = origin.tokenizer if origin else None
        ensure_prepared(cfg.data, prepared_path(cfg), tokenizer, workers)
    finally:
        run.release()


def average(
    output: str | Path, checkpoints: Sequence[str | Path] = (), run_dir: str | None = None, last: int = 5
) -> list[Path]:
    """Average the weights of `checkpoints` and of the `last` step checkpoints of `run_dir` into `output`;
    the checkpoints averaged."""
    from seq2seq.runs.checkpoint import average_checkpoints
    from seq2seq.runs.run_dir import RunDirectory

    if last < 1:
        raise UsageError("average --last must be at least 1")
    paths = [Path(p) for p in checkpoints]
    if run_dir:
        if not Path(run_dir).is_dir():
            raise UserError(f"run directory not found: {run_dir}")
        found = RunDirectory(run_dir).latest(last)
        if len(found) < last:
            log.warning("--last %d: %s holds only %d step checkpoint(s) of its run; averaging those", last, run_dir,
                        len(found))  # fmt: skip
        paths += found
    if not paths:
        raise UserError("nothing to average: give checkpoints, or --run-dir with checkpoint_step*.pt files")
    refuse_twice(paths)
    refuse_overwriting(Path(output), "--output", *paths)
    refuse_replacing_a_run_checkpoint(Path(output))
    average_checkpoints(paths, output)
    return paths


def refuse_twice(paths: Sequence[Path]) -> None:
    """Each checkpoint counts once in an average: one named twice (or under two names, or both named and found
    by --run-dir) would weigh double without a word."""
    for i, path in enumerate(paths):
        for earlier in paths[:i]:
            if same_file(path, earlier):
                raise UserError(f"{path} is averaged twice (also given as {earlier}); name each checkpoint once")


def refuse_replacing_a_run_checkpoint(output: Path) -> None:
    """An average holds weights only, no training state: written over a run's checkpoint_last.pt it would leave
    the run nothing to resume from, and over its checkpoint_best.pt or a step checkpoint it would destroy weights
    only that run can give. A new file under one of those names is the user's to make."""
    from seq2seq.runs.checkpoint import BEST, LAST
    from seq2seq.runs.run_dir import step_number

    if output.exists() and (output.name in (LAST, BEST) or step_number(output) is not None):
        raise UserError(
            f"--output {output} is a training run's own checkpoint, which the average would replace "
            "(and a run cannot resume from an average): choose another file"
        )
