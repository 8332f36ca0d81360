"""A translation run whose encoder starts from a pretrained one (`train.init_encoder_from`).

The pretrained encoder comes from a `seq2seq pretrain` checkpoint (seq2seq.model.masked_lm; its mask token's
embedding row is dropped) or from a translation checkpoint (its encoder). What carries over: the encoder's
weights, its token embedding included (with `model.share_all_embeddings` that is the decoder's embedding and
output projection too), and the SentencePiece model(s), with which the new run's data is encoded: the pretraining
run trained (or was given) the tokenizer this translation config describes, and the vocabulary settings must
still say so. Everything else starts afresh as in any new run: the decoder, the optimizer, the schedule, the step
count. What must match is checked tensor by tensor against the model this config builds, and a difference is one
line naming the tensor and the model settings that differ. Once the run has its own checkpoint_last, starting it
again resumes it and the pretrained checkpoint is not read again.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from seq2seq.config import ExperimentConfig, config_changes, to_dict
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.model import Seq2SeqModel, Seq2SeqTransformer, build_model, on_meta
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.run_dir import RunDirectory
from seq2seq.training.finetune import VOCABULARY_KEYS

log = logging.getLogger("seq2seq.train")

TOKENS = "embedding.tokens.weight"  # the encoder's token embedding, (V, D); (V + 1, D) in a masked LM
PREFIX = "encoder."


def pretrained_path(value: str) -> Path:
    """The checkpoint named, or a run directory's checkpoint_best.pt."""
    path = Path(value)
    return path / ckpt.BEST if path.is_dir() else path


def read_pretrained(cfg: ExperimentConfig, run: RunDirectory) -> ckpt.Checkpoint | None:
    """The checkpoint `train.init_encoder_from` names, checked against this run's config (None without it)."""
    value = cfg.train.init_encoder_from
    if not value:
        return None
    path = pretrained_path(value)
    where = f"train.init_encoder_from={path}"
    if cfg.model.arch != "transformer":
        raise ConfigError(f"{where}: a pretrained encoder starts a Transformer, not model.arch {cfg.model.arch}")
    if path.resolve().parent == run.path.resolve():
        raise ConfigError(f"{where} is in train.run_dir={run.path}, where the new run writes; choose another")
    try:
        pretrained = ckpt.read(path, (ckpt.MASKED_LM, ckpt.TRANSLATION))
        ckpt.check_shapes(pretrained.config, pretrained.tokenizer, pretrained.model, pretrained.kind)
    except CheckpointError as e:
        raise CheckpointError(f"train.init_encoder_from: {e}") from None
    check_vocabulary(pretrained, cfg, where)
    check_encoder(pretrained, cfg, where)
    return pretrained


def check_vocabulary(pretrained: ckpt.Checkpoint, cfg: ExperimentConfig, where: str) -> None:
    """The run keeps the pretrained tokenizer: refuse vocabulary settings that describe another one."""
    for key, old, new in config_changes(to_dict(pretrained.config), to_dict(cfg)):
        if key in (*VOCABULARY_KEYS, "data.pairs"):
            raise ConfigError(
                f"{where}: {key} is {new}, but the pretrained encoder's tokenizer was built with {old}; "
                "the run uses that tokenizer"
            )


def encoder_weights(checkpoint: ckpt.Checkpoint) -> dict[str, torch.Tensor]:
    """The checkpoint's encoder tensors, named as in a translation model's encoder (the mask token's row
    dropped from a masked LM's embedding)."""
    weights = {name.removeprefix(PREFIX): t for name, t in checkpoint.model.items() if name.startswith(PREFIX)}
    if checkpoint.kind == ckpt.MASKED_LM:
        weights[TOKENS] = weights[TOKENS][:-1]  # (V + 1, D) -> (V, D)
    return weights


def check_encoder(pretrained: ckpt.Checkpoint, cfg: ExperimentConfig, where: str) -> None:
    """Every tensor of this config's encoder, of the same shape, in the pretrained one; one line if not."""
    tokenizer = pretrained.tokenizer
    with on_meta():
        model = build_model(cfg.model, tokenizer.src_vocab_size, tokenizer.tgt_vocab_size)
    assert isinstance(model, Seq2SeqTransformer)  # read_pretrained refuses the other architectures
    expected = model.encoder.state_dict()
    weights = encoder_weights(pretrained)
    settings = [
        f"{key} {old} -> {new}"
        for key, old, new in config_changes(to_dict(pretrained.config.model), to_dict(cfg.model), "model.")
        if "dropout" not in key and "decoder" not in key
    ]
    differ = f" (model settings that differ: {', '.join(settings)})" if settings else ""
    missing, unexpected = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unexpected:
        what = f"lacks {PREFIX}{missing[0]}" if missing else f"has {PREFIX}{unexpected[0]}, which this model lacks"
        raise ConfigError(f"{where}: the pretrained encoder {what}{differ}")
    for name, tensor in expected.items():
        if weights[name].shape != tensor.shape:
            raise ConfigError(
                f"{where}: {PREFIX}{name} is {tuple(weights[name].shape)} there, {tuple(tensor.shape)} in this "
                f"model{differ}"
            )


def initialize(model: Seq2SeqModel, pretrained: ckpt.Checkpoint, value: str) -> None:
    """Load the pretrained encoder into the freshly built model and say what was loaded."""
    assert isinstance(model, Seq2SeqTransformer)  # read_pretrained refuses the other architectures
    weights = encoder_weights(pretrained)
    model.encoder.load_state_dict(weights)
    shared = model.decoder.embedding.tokens is model.encoder.embedding.tokens
    count = sum(t.numel() for t in weights.values())
    step = pretrained.training.progress.step if pretrained.training else pretrained.step
    log.info(
        "initialized the encoder (%d tensors, %.2fM parameters%s) from %s (%s, step %s of run %s); "
        "the rest of the model, the optimizer and the schedule start afresh",
        len(weights),
        count / 1e6,
        ", its embedding shared with the decoder" if shared else "",
        pretrained_path(value),
        ckpt.KIND_NAMES[pretrained.kind],
        "unknown" if step is None else step,
        pretrained.run_id or "unknown",
    )


def note_resume(cfg: ExperimentConfig, run: RunDirectory) -> None:
    """A run that has its own checkpoint resumes it: `train.init_encoder_from` no longer applies."""
    if cfg.train.init_encoder_from:
        log.info("train.init_encoder_from=%s is ignored: %s has its own %s", cfg.train.init_encoder_from, run.path,
                 ckpt.LAST)  # fmt: skip
