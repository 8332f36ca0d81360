"""A training run assembled from its parts, before any update: `assemble(cfg)` is the one place that reads
the whole config; each `setup_*` function (setup.py) takes the sections it needs, and the `Trainer` gets the
parts and only loops.

    run directory   locked on rank 0, train.log attached; the checkpoint to resume, or a fine-tuning parent
    data            the prepared corpus (SentencePiece trained when needed) and its `EpochSource`
    model           weights (fresh, resumed or the parent's), optimizer and gradient scaler in an `UpdateStep`
    schedule        the learning rate of each update
    policy          `StopPolicy`: when to stop, which validation is the best
    validator       `Validator` on the valid split
    saver           `Saver`: what is saved, where, how many are kept and averaged
    sinks           TensorBoard and metrics.jsonl behind one `Sinks`

A benchmark or a test assembles the parts and changes one (`dataclasses.replace(parts.update, ...)`, another
validator) instead of patching a trainer.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass

import torch

from seq2seq.config import ExperimentConfig, save_config
from seq2seq.model import Seq2SeqModel
from seq2seq.model.masked_lm import MaskedLM
from seq2seq.runs.checkpoint import Progress
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.tokenizer import Tokenizer
from seq2seq.training import distributed as dist
from seq2seq.training import encoder_init, finetune
from seq2seq.training.budget import plan_warnings
from seq2seq.training.epochs import EpochSource
from seq2seq.training.masking import MaskedValidator
from seq2seq.training.monitor import Sinks
from seq2seq.training.optim import Schedule, lr_schedule
from seq2seq.training.saving import Saver
from seq2seq.training.setup import (
    prepared_path,
    restore,
    setup_corpus,
    setup_data,
    setup_device,
    setup_model,
    setup_run_dir,
    setup_sinks,
    setup_validator,
    wrap_ddp,
)
from seq2seq.training.stopping import StopPolicy
from seq2seq.training.update import UpdateStep
from seq2seq.training.validation import Validator

__all__ = ["LoopSettings", "TrainingRun", "assemble"]

log = logging.getLogger("seq2seq.train")


@dataclass(frozen=True)
class LoopSettings:
    """What the loop itself does on which step."""

    update_freq: int = 1  # batches an update
    log_every: int = 100  # steps between log lines
    valid_every: int = 0  # steps between validations; 0: at the end of each epoch
    save_every: int = 0  # steps between step checkpoints without validation; 0: none


@dataclass
class TrainingRun:
    """The parts of a run, ready to train; `close()` lets go of what they hold."""

    run: RunDirectory
    main: bool  # rank 0: the one that writes
    device: torch.device
    tokenizer: Tokenizer
    epochs: EpochSource
    model: Seq2SeqModel | MaskedLM  # a masked LM in a pretraining run (pretrain.py)
    update: UpdateStep  # with the optimizer and the gradient scaler
    lr: Schedule  # the learning rate of update k, so many training seconds into the run
    policy: StopPolicy
    validator: Validator | MaskedValidator
    progress: Progress  # where the run is: a fresh run's, or a resumed one's
    saver: Saver
    sinks: Sinks
    loop: LoopSettings

    @property
    def run_id(self) -> str:
        return self.saver.run_id

    def close(self) -> None:
        """Close the sinks, unlock the run directory, leave the process group."""
        self.sinks.close()
        self.run.release()
        dist.teardown()


def assemble(cfg: ExperimentConfig, tokenizer: Tokenizer | None = None) -> TrainingRun:
    """The parts of the run `cfg` describes, its config and tokenizer written into the run directory.

    `tokenizer` skips training one (a resumed run always uses its checkpoint's, a fine-tuning run its
    parent's, a run with `train.init_encoder_from` the pretraining run's). A failed start keeps neither the
    lock, the log file nor the process group.
    """
    t, saves = cfg.train, cfg.checkpoint
    run = RunDirectory(t.run_dir)
    with contextlib.ExitStack() as undo:
        undo.callback(dist.teardown)
        undo.callback(run.release)
        device, precision = setup_device(t, cfg.model.d_model)  # joins the process group under torchrun
        main = dist.is_main()
        resume, changes, parent, pretrained = setup_run_dir(run, cfg, main)
        run_id = resume.run_id if resume else run.fresh_run_id(record=main)
        origin = resume or parent or pretrained  # whose tokenizer the run keeps
        given = origin.tokenizer if origin else tokenizer
        corpus = setup_corpus(cfg.data, prepared_path(cfg), given)
        tokenizer = corpus.tokenizer
        epochs = setup_data(cfg.data, t, corpus, device)
        model, optimizer, scaler = setup_model(cfg.model, cfg.optim, t.seed, tokenizer, device, precision)
        if parent:
            finetune.initialize(model, parent, t.init_from)
        if pretrained:
            encoder_init.initialize(model, pretrained, t.init_encoder_from)
        validator = setup_validator(
            cfg.data,
            cfg.decode,
            tokenizer,
            model,
            max_positions=model.max_positions,  # a decoder-only model's: half, for each part
            max_tokens=t.max_tokens,
            label_smoothing=cfg.optim.label_smoothing,
            with_bleu=cfg.validation.bleu,
            precision=precision,
            device=device,
        )
        progress = restore(resume, model, optimizer, scaler, run, changes) if resume else Progress()
        ddp = wrap_ddp(model, device)
        update = UpdateStep.from_config(
            t, cfg.optim, model, optimizer, scaler, device, precision, ddp, source_loss(cfg)
        )
        per_epoch = math.ceil(len(epochs.batches(1)) / t.update_freq)
        if main:
            for warning in plan_warnings(t, len(corpus), per_epoch, cfg.optim.warmup_steps):
                log.warning(warning)
            save_config(cfg, run.config)
            tokenizer.save(run.path)
        sinks = setup_sinks(run, progress.step, main)
        undo.callback(sinks.close)
        parts = TrainingRun(
            run,
            main,
            device,
            tokenizer,
            epochs,
            model,
            update,
            lr_schedule(cfg.optim, t, cfg.model.d_model, per_epoch),
            StopPolicy.from_config(t, cfg.validation),
            validator,
            progress,
            Saver(run, cfg, tokenizer, run_id, saves.keep_last, saves.average_last, main),
            sinks,
            LoopSettings(t.update_freq, t.log_every, cfg.validation.every, saves.every),
        )
        params = sum(p.numel() for p in model.parameters())
        sinks.write("start", progress.step, progress.epoch, parameters=params)
        log.info(
            "model: %.2fM parameters (%s); %s, %s, %d process(es)",
            params / 1e6,
            cfg.model.arch,
            device,
            precision,
            dist.world_size(),
        )
        undo.pop_all()
    return parts


def source_loss(cfg: ExperimentConfig) -> float:
    """The weight of the source part's loss: `model.decoder_only.source_loss`, 0 for the encoder-decoders."""
    return cfg.model.decoder_only.source_loss if cfg.model.decoder_only is not None else 0.0
