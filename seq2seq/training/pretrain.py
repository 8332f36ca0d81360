"""`seq2seq pretrain`: masked language modelling of a Transformer encoder (BERT's recipe, seq2seq.training.masking),
for `train.init_encoder_from` to start a translation model with.

A pretraining run is a training run with other parts, assembled here and trained by the same `Trainer`: the
same run directory, lock, log and sinks; the same batching (`EpochSource`, token-bucketed, exact on resume), the
same update (optimizer, schedule, precision, accumulation, clipping) and the same checkpoints, written atomically
and marked `masked-lm` (seq2seq.runs.checkpoint), which `translate`, `evaluate`, `average`, `export` and
`train.init_from` refuse in one line. What differs:

    data       the source side of `data.train` (prepared as for translation), or `pretrain.text`'s files
    tokenizer  the one this config's translation run would train (or `data.spm_model`): trained on `data.train`
               when the data is prepared, even with `pretrain.text`; the translation run with
               `train.init_encoder_from` then reuses it from the checkpoint
    model      the encoder with a masked-LM head (seq2seq.model.masked_lm)
    batches    each one masked, seeded by (seed, epoch, batch number)
    loss       cross-entropy of the selected tokens, without label smoothing or R-Drop
    validation loss, perplexity and accuracy of the masked tokens of the validation sources; the best is the
               lowest loss
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
from pathlib import Path

import torch

from seq2seq.config import DataConfig, ExperimentConfig, TrainConfig, save_config
from seq2seq.errors import ConfigError
from seq2seq.model.masked_lm import MaskedLM, build_masked_lm, require_transformer
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import Progress
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.corpus import Batch
from seq2seq.text.prepare import PreparedCorpus
from seq2seq.text.tokenizer import Tokenizer, tag_line
from seq2seq.training import distributed as dist
from seq2seq.training.assembly import LoopSettings, TrainingRun
from seq2seq.training.epochs import EpochSource, epoch_seed
from seq2seq.training.masking import MaskedValidator, Masking, encode_sources, masked_batch
from seq2seq.training.monitor import Sinks
from seq2seq.training.optim import build_optimizer, lr_schedule
from seq2seq.training.saving import Saver
from seq2seq.training.setup import (
    data_workers,
    prepared_path,
    restore,
    setup_corpus,
    setup_device,
    setup_run_dir,
    setup_sinks,
    valid_text,
    wrap_ddp,
)
from seq2seq.training.stopping import StopPolicy
from seq2seq.training.update import UpdateStep

__all__ = ["MaskedEpochs", "assemble_pretrain"]

log = logging.getLogger("seq2seq.train")

TEXT_LINKS, TEXT_PREPARED = "pretrain_text", "prepared_text"  # in the run directory, for pretrain.text


class MaskedEpochs(EpochSource):
    """The batches of `EpochSource`, their sources masked: batch j of epoch e with the seed of (seed, e, j)."""

    def __init__(
        self, masking: Masking, corpus: PreparedCorpus, d: DataConfig, t: TrainConfig, device: torch.device
    ) -> None:
        workers, bounded = data_workers(t.num_workers, device), t.compile != "off"
        super().__init__(corpus, d, t.max_tokens, t.seed, dist.rank(), dist.world_size(), workers, bounded)
        self.masking = masking

    def batch(self, epoch: int, j: int) -> Batch:
        number = int(self.batches(epoch).ids[j])  # the batch's number in the epoch, whichever rank runs it
        return masked_batch(super().batch(epoch, j), self.masking, epoch_seed(self.seed, epoch) * 1_000_003 + number)


def replace_link(link: Path, target: Path) -> None:
    """`link` pointing at `target`, replaced in one step: every rank of a run makes the same links at once."""
    if link.is_symlink() and link.resolve() == target:
        return
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(target)
    os.replace(temporary, link)


def text_data(d: DataConfig, texts: tuple[str, ...], links: Path) -> DataConfig:
    """A corpus config whose training sets are the `pretrain.text` files, each as both sides of its pairs
    (links in `links`), so that they are prepared, batched and checked as any training data."""
    links.mkdir(parents=True, exist_ok=True)
    names = []
    for k, text in enumerate(texts):
        path = Path(text).resolve()
        if not path.is_file():
            raise ConfigError(f"pretrain.text: {text} is not a file")
        for side in ("src", "tgt"):
            gz = path.suffix == ".gz"
            (links / f"set{k}.{side}{'' if gz else '.gz'}").unlink(missing_ok=True)  # a former text's other form
            replace_link(links / f"set{k}.{side}{'.gz' if gz else ''}", path)
        names.append(f"set{k}")
    return dataclasses.replace(
        d, dir=str(links), train=tuple(names), src_lang="src", tgt_lang="tgt", format="text", pairs=()
    )


def setup_pretrain_data(
    cfg: ExperimentConfig, run: RunDirectory, given: Tokenizer | None
) -> tuple[PreparedCorpus, DataConfig]:
    """The prepared training corpus (which trains the tokenizer), or with `pretrain.text` those files prepared
    with that tokenizer; and the data config that describes what is returned."""
    corpus = setup_corpus(cfg.data, prepared_path(cfg), given)
    if not cfg.pretrain.text:
        return corpus, cfg.data
    data = text_data(cfg.data, cfg.pretrain.text, run.path / TEXT_LINKS)
    return setup_corpus(data, run.path / TEXT_PREPARED, corpus.tokenizer), data


def setup_masked_validator(
    cfg: ExperimentConfig, tokenizer: Tokenizer, model: MaskedLM, masking: Masking, precision: str, device: torch.device
) -> MaskedValidator:
    """Masked-token scores on the validation sources (tagged as in training, with data.pairs)."""
    text, pairs = valid_text(cfg.data)
    tagged = [tag_line(text[0][i], p.tgt) for p in pairs for i in p.lines]
    corpus = encode_sources(tokenizer, tagged or text[0], cfg.model.max_positions - 1)
    log.info("data: %d validation sentences", len(corpus))
    budget = max(cfg.train.max_tokens, cfg.decode.max_tokens)
    return MaskedValidator(model, corpus, masking, budget, precision, device, cfg.train.seed)


def assemble_pretrain(cfg: ExperimentConfig) -> TrainingRun:
    """The parts of the pretraining run `cfg` describes, its config and tokenizer written into the run directory."""
    t, saves = cfg.train, cfg.checkpoint
    for name in ("init_from", "init_encoder_from"):
        t.require(not getattr(t, name), name, "is for `seq2seq train`; a pretraining run starts from random weights")
    require_transformer(cfg.model)  # before anything is locked
    run = RunDirectory(t.run_dir)
    with contextlib.ExitStack() as undo:
        undo.callback(dist.teardown)
        undo.callback(run.release)
        device, precision = setup_device(t, cfg.model.d_model)
        main = dist.is_main()
        resume, changes, _, _ = setup_run_dir(run, cfg, main, ckpt.MASKED_LM)
        run_id = resume.run_id if resume else run.fresh_run_id(record=main)
        corpus, data = setup_pretrain_data(cfg, run, resume.tokenizer if resume else None)
        tokenizer = corpus.tokenizer
        masking = Masking.of(cfg.pretrain, tokenizer)
        epochs = MaskedEpochs(masking, corpus, data, t, device)
        log.info("data: %d training sentences", len(corpus))
        torch.manual_seed(t.seed)
        model = build_masked_lm(cfg.model, tokenizer.src_vocab_size).to(device)
        optimizer = build_optimizer(model, cfg.optim)
        scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        validator = setup_masked_validator(cfg, tokenizer, model, masking, precision, device)
        progress = restore(resume, model, optimizer, scaler, run, changes) if resume else Progress()
        ddp = wrap_ddp(model, device)
        update = UpdateStep.from_config(t, cfg.optim, model, optimizer, scaler, device, precision, ddp)
        update = dataclasses.replace(update, label_smoothing=0.0, rdrop_alpha=0.0)
        per_epoch = math.ceil(len(epochs.batches(1)) / t.update_freq)
        if main:
            save_config(cfg, run.config)
            tokenizer.save(run.path)
        if saves.average_last:
            log.warning("checkpoint.average_last does not apply to seq2seq pretrain: nothing is averaged")
        sinks = setup_sinks(run, progress.step, main)
        undo.callback(sinks.close)
        parts = TrainingRun(
            run, main, device, tokenizer, epochs, model, update,
            lr_schedule(cfg.optim, t, cfg.model.d_model, per_epoch),
            dataclasses.replace(StopPolicy.from_config(t, cfg.validation), best_metric="loss"),
            validator, progress,
            Saver(run, cfg, tokenizer, run_id, saves.keep_last, 0, main, ckpt.MASKED_LM),
            sinks,
            LoopSettings(t.update_freq, t.log_every, cfg.validation.every, saves.every),
        )  # fmt: skip
        _log_start(sinks, progress, model, device, precision)
        undo.pop_all()
    return parts


def _log_start(sinks: Sinks, progress: Progress, model: MaskedLM, device: torch.device, precision: str) -> None:
    params = sum(p.numel() for p in model.parameters())
    sinks.write("start", progress.step, progress.epoch, parameters=params, kind=ckpt.MASKED_LM)
    log.info("masked-LM pretraining of the encoder: %.2fM parameters; %s, %s, %d process(es)", params / 1e6, device,
             precision, dist.world_size())  # fmt: skip
