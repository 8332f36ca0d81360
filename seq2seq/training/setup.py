"""Set-up of a run, one part a function: device, run directory, data, model and optimizer, validation, sinks;
and what a resume may change. Each takes the config sections it needs; `assembly.assemble` calls them."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from seq2seq.config import (
    DataConfig,
    DecodeConfig,
    ExperimentConfig,
    ModelConfig,
    OptimConfig,
    TrainConfig,
    config_changes,
    to_dict,
)
from seq2seq.device import resolve_device, resolve_precision
from seq2seq.errors import TrainingError
from seq2seq.model import Seq2SeqModel, build_model, on_meta
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.checkpoint import Checkpoint, Progress
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.text.corpus import encode_corpus, read_parallel, read_split
from seq2seq.text.prepare import PreparedCorpus, ensure_prepared
from seq2seq.text.tokenizer import Tokenizer, tag_line
from seq2seq.training import distributed as dist
from seq2seq.training import encoder_init, finetune
from seq2seq.training.epochs import EpochSource
from seq2seq.training.monitor import MetricsFile, Sinks, TensorBoard
from seq2seq.training.optim import build_optimizer
from seq2seq.training.validation import Validator, ValidPair

log = logging.getLogger("seq2seq.train")

# What a resume may not change: the stored tokenizer, the encoded data and the weights depend on them.
# data.test is only read by `evaluate`; data.prepared_dir is only where the prepared data is kept.
FIXED_ON_RESUME = ("data.", "model.")
FREE_ON_RESUME = ("data.test", "data.prepared_dir", *finetune.FREE_MODEL_KEYS)  # nothing stored depends on them
BATCHING = ("train.max_tokens", "train.seed")  # what an epoch's batches are made from, besides the data


def setup_device(t: TrainConfig, width: int) -> tuple[torch.device, str]:
    """Device, precision (for a model of `width`), threads, determinism and (under torchrun) the process group."""
    device = resolve_device(t.device)
    precision = resolve_precision(t.precision, device, width)
    if t.threads:
        torch.set_num_threads(t.threads)
    dist.setup(device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())  # this rank's GPU under torchrun
    if t.deterministic:
        if device.type == "cuda":
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS refuses determinism without it
        torch.use_deterministic_algorithms(True)
    return device, precision


def prepared_path(cfg: ExperimentConfig) -> Path:
    """The prepared training data: `data.prepared_dir`, or `prepared/` in the run directory."""
    return Path(cfg.data.prepared_dir or Path(cfg.train.run_dir) / "prepared")


def setup_corpus(d: DataConfig, path: Path, tokenizer: Tokenizer | None) -> PreparedCorpus:
    """Prepare the training data at `path` on rank 0 unless it is ready (for `tokenizer`, when given); every
    rank opens it."""
    if dist.is_main():
        ensure_prepared(d, path, tokenizer)
    if dist.world_size() > 1:
        torch.distributed.barrier()
    return PreparedCorpus(path)


def data_workers(setting: int | str, device: torch.device) -> int:
    """`train.num_workers`: `auto` is 0 on the CPU and min(4, cores - 1) on CUDA.

    Why: with subword sampling a Multi30k batch of 2,048 tokens takes about 12-21 ms of encoding and
    collation (2.0 ms without sampling) on one core of the 2-core AMD EPYC. On the CPU that is about 1% of
    an update (1-2 s), while a worker process would take a core from the model's two threads; on CUDA an
    update of that size takes 10-60 ms, so encoding in the training process would leave the GPU idle for
    most of each update, and a few workers running ahead hide it.
    """
    if setting != "auto":
        return int(setting)
    if device.type != "cuda":
        return 0
    return max(0, min(4, (os.cpu_count() or 1) - 1))


def setup_data(d: DataConfig, t: TrainConfig, corpus: PreparedCorpus, device: torch.device) -> EpochSource:
    """This rank's batches of each epoch, collated by `train.num_workers` processes."""
    workers = data_workers(t.num_workers, device)
    bounded = t.compile != "off"  # a compiled model gets a few batch shapes, not one per batch
    source = EpochSource(corpus, d, t.max_tokens, t.seed, dist.rank(), dist.world_size(), workers, bounded)
    log.info("data: %d training pairs", len(corpus))
    return source


def setup_validator(
    d: DataConfig,
    decode: DecodeConfig,
    tokenizer: Tokenizer,
    model: Seq2SeqModel,
    *,
    max_positions: int,
    max_tokens: int,
    label_smoothing: float,
    with_bleu: bool,
    precision: str,
    device: torch.device,
) -> Validator:
    """Validation on the valid split (of each language pair), encoded up to the model's length with the best
    segmentation; the loss is over the tagged sources, as trained."""
    text, pairs = valid_text(d)
    tagged = [tag_line(text[0][i], p.tgt) for p in pairs for i in p.lines]
    corpus = encode_corpus(tokenizer, tagged or text[0], text[1], max_positions - 1, f"{d.dir}/{d.valid}")
    log.info("data: %d validation pairs", len(corpus))
    return Validator(
        model, tokenizer, corpus, text, decode, max_tokens, label_smoothing, precision, device, with_bleu, pairs
    )


def valid_text(d: DataConfig) -> tuple[tuple[list[str], list[str]], list[ValidPair]]:
    """(sources, references) of the valid split; with data.pairs, each pair's one after another, and where."""
    if not d.pairs:
        return read_split(d, d.valid), []
    sources: list[str] = []
    references: list[str] = []
    pairs = []
    for src, tgt in d.language_pairs():
        src_lines, tgt_lines = read_parallel(d.dir, d.valid, src, tgt)
        pairs.append(ValidPair(f"{src}-{tgt}", tgt, range(len(sources), len(sources) + len(src_lines))))
        sources += src_lines
        references += tgt_lines
    return (sources, references), pairs


def setup_model(
    m: ModelConfig, optim: OptimConfig, seed: int, tokenizer: Tokenizer, device: torch.device, precision: str
) -> tuple[Seq2SeqModel, torch.optim.Optimizer, torch.amp.GradScaler]:
    """A fresh model (the same initial weights on every rank), its optimizer and its gradient scaler."""
    torch.manual_seed(seed)
    model = build_model(m, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size).to(device)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    return model, build_optimizer(model, optim), scaler


def restore(
    resume: Checkpoint,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    run: RunDirectory,
    changes: list[str],
) -> Progress:
    """Load a checkpoint's weights and training state into a freshly built model; returns its progress."""
    assert resume.training is not None  # check_resumable refuses a checkpoint without it
    resume.check_resumable_into(optimizer, scaler, str(run.last))
    model.load_state_dict(resume.model)
    optimizer.load_state_dict(resume.training.optimizer)
    scaler.load_state_dict(resume.training.scaler)
    for change in changes:
        log.info("config changed since the checkpoint: %s", change)
    p = resume.training.progress
    log.info("resuming %s at step %d (epoch %d, batch %d)", run.path, p.step, p.epoch, p.batch_in_epoch)
    return p


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> DistributedDataParallel | None:
    if dist.world_size() == 1:
        return None
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def setup_run_dir(
    run: RunDirectory, cfg: ExperimentConfig, main: bool, kind: str = ckpt.TRANSLATION
) -> tuple[Checkpoint | None, list[str], Checkpoint | None, Checkpoint | None]:
    """Lock the run directory (rank 0), check what is there (or the parent of a fine-tuning run, the pretrained
    encoder of `train.init_encoder_from`), then log into it: a refused start writes nothing. Returns the
    checkpoint (of `kind`) to resume, its changes, the parent and the pretrained encoder's checkpoint."""
    if main:
        run.acquire()
    else:
        logging.getLogger("seq2seq").setLevel(logging.WARNING)
    resume = run.resume_point(kind)
    changes = check_resumable(resume, cfg, run) if resume else []
    fresh_translation = resume is None and kind == ckpt.TRANSLATION
    parent = finetune.read_parent(cfg, run) if fresh_translation else None
    pretrained = encoder_init.read_pretrained(cfg, run) if fresh_translation else None
    if main:
        run.attach_log()
    if resume:
        finetune.note_resume(cfg, run)
        encoder_init.note_resume(cfg, run)
    return resume, changes, parent, pretrained


def setup_sinks(run: RunDirectory, resume_step: int, main: bool) -> Sinks:
    """TensorBoard and metrics.jsonl on rank 0; nothing elsewhere."""
    if not main:
        return Sinks()
    return Sinks(TensorBoard(run.tensorboard, resume_step), MetricsFile(run.metrics))


def check_resumable(resume: Checkpoint, cfg: ExperimentConfig, run: RunDirectory) -> list[str]:
    """Refuse a changed setting the stored tokenizer, data or weights depend on; return the harmless changes."""
    if resume.training is None:
        raise TrainingError(f"{run.last} has no training state to resume from")
    changes = config_changes(to_dict(resume.config), to_dict(cfg))
    fixed_keys = (*FIXED_ON_RESUME, "pretrain.") if resume.kind == ckpt.MASKED_LM else FIXED_ON_RESUME
    fixed = [(key, old, new) for key, old, new in changes if key.startswith(fixed_keys) and key not in FREE_ON_RESUME]
    if fixed:
        key, old, new = fixed[0]
        others = f" (and {', '.join(k for k, _, _ in fixed[1:])})" if fixed[1:] else ""
        raise TrainingError(
            f"cannot resume {run.path}: the config does not match its checkpoint: {key} is {new}, but the run "
            f"was started with {old} and its tokenizer, data and weights depend on it{others}; for a new run with "
            "these settings, choose another train.run_dir"
        )
    p = resume.training.progress
    moved = [(key, old, new) for key, old, new in changes if key in BATCHING]
    if p.batch_in_epoch and moved:
        key, old, new = moved[0]
        raise TrainingError(
            f"cannot resume {run.path} in the middle of epoch {p.epoch} with {key} changed from {old} to {new}: the "
            f"checkpoint is at batch {p.batch_in_epoch} of the epoch's batches as {old} made them, and with {new} the "
            f"rest of the epoch would be other batches (pairs trained twice or not at all); resume with {key}={old}"
        )
    with on_meta():  # the model and optimizer being resumed, without memory: refuse before any log
        model = ckpt.build_kind(resume.kind, cfg, resume.tokenizer)
    resume.check_resumable_into(build_optimizer(model, cfg.optim), None, str(run.last))
    return [f"{key}: {old} -> {new}" for key, old, new in changes]
