"""Fine-tuning: a fresh run that starts from another run's weights and tokenizer (`train.init_from`).

What carries over from the parent checkpoint: the weights, and the SentencePiece model(s), with which
the new training data is encoded (no tokenizer is trained). What starts afresh, as in any new run: the
run id, the step count, the optimizer's state, the learning-rate schedule (warm-up included), the epochs,
the best score, the patience count and the training time. What must match, because the weights or the
vocabulary depend on it: every `model.*` setting but the dropout probabilities, and the `data.*` settings
that define the vocabulary. Once the new run has saved its own checkpoint_last, starting it again
resumes it and the parent is not read again. The parent's file is only ever read.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from seq2seq.config import ExperimentConfig, config_changes, to_dict
from seq2seq.errors import CheckpointError, ConfigError
from seq2seq.runs import checkpoint as ckpt
from seq2seq.runs.run_dir import RunDirectory

log = logging.getLogger("seq2seq.train")

# The weights do not depend on these: a fine-tuning run may change them.
FREE_MODEL_KEYS = ("model.dropout", "model.transformer.attention_dropout", "model.transformer.activation_dropout")
# The parent's tokenizer was trained with these: a different value would ask for another vocabulary.
VOCABULARY_KEYS = (
    "data.vocab_size",
    "data.shared_vocab",
    "data.spm_model_type",
    "data.spm_model",
    "data.spm_model_src",
    "data.spm_model_tgt",
    "data.pretokenized",
)


def parent_path(init_from: str) -> Path:
    """The parent checkpoint: the file named, or a run directory's checkpoint_best.pt."""
    path = Path(init_from)
    return path / ckpt.BEST if path.is_dir() else path


def read_parent(cfg: ExperimentConfig, run: RunDirectory) -> ckpt.Checkpoint | None:
    """The checkpoint `train.init_from` names, checked against the config (None without init_from)."""
    if not cfg.train.init_from:
        return None
    path = parent_path(cfg.train.init_from)
    if path.resolve().parent == run.path.resolve():
        raise ConfigError(
            f"train.init_from={path} is in train.run_dir={run.path}, where the new run writes its checkpoints; "
            "choose another train.run_dir"
        )
    try:
        parent = ckpt.read(path)
        ckpt.check_shapes(parent.config, parent.tokenizer, parent.model)
    except CheckpointError as e:
        raise CheckpointError(f"train.init_from: {e}") from None
    check_compatible(parent, cfg, path)
    return parent


def check_compatible(parent: ckpt.Checkpoint, cfg: ExperimentConfig, path: Path) -> None:
    """Refuse a model setting the weights depend on, or a vocabulary setting, that differs from the parent's."""
    for key, old, new in config_changes(to_dict(parent.config), to_dict(cfg)):
        if key.startswith("model.") and key not in FREE_MODEL_KEYS:
            raise ConfigError(
                f"train.init_from={path}: {key} is {new}, but the parent model was trained with {old} "
                "and its weights depend on it"
            )
        if key in VOCABULARY_KEYS:
            raise ConfigError(
                f"train.init_from={path}: {key} is {new}, but the parent's tokenizer was built with {old}; "
                "a fine-tuning run keeps the parent's tokenizer"
            )


def initialize(model: torch.nn.Module, parent: ckpt.Checkpoint, init_from: str) -> None:
    """Load the parent's weights into the freshly built model and say so in the log."""
    model.load_state_dict(parent.model)
    step = parent.training.progress.step if parent.training else parent.step
    log.info(
        "initialized from %s (step %s of run %s); optimizer, learning-rate schedule and step count start afresh",
        parent_path(init_from),
        "unknown" if step is None else step,
        parent.run_id or "unknown",
    )


def note_resume(cfg: ExperimentConfig, run: RunDirectory) -> None:
    """A run that has its own checkpoint resumes it: `train.init_from` no longer applies."""
    if cfg.train.init_from:
        log.info("train.init_from=%s is ignored: %s has its own %s", cfg.train.init_from, run.path, ckpt.LAST)
