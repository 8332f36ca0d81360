"""Experiment configuration: nested dataclasses, YAML files and dotted overrides.

The dataclasses below are the only source of defaults. A YAML file overrides
them, and `section.key=value` arguments override the YAML. Everything is
checked here, before any tensor exists: unknown keys (with the closest valid
name), wrong types, invalid choices and inconsistent values all raise
`ConfigError` with one line that names the key and where it came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import stat
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import UnionType
from typing import Any, Literal, TypeVar, Union

import yaml

from seq2seq.errors import ConfigError

INT_LIMIT = 2**63  # every int setting reaches torch or C code as a 64-bit integer at most
MAX_THREADS = 1024  # torch.set_num_threads takes a C int; more threads than this is a typo
# Sizes far beyond any real model: larger values are typos or hostile, and would fail in an allocation.
MAX_WIDTH = 2**16  # model.d_model, model.rnn.hidden_size
MAX_FF = 2**18  # model.transformer.d_ff
MAX_HEADS = 1024  # model.transformer.n_heads
MAX_LAYERS = 256  # model.transformer.encoder_layers, model.transformer.decoder_layers, model.rnn.layers
MAX_POSITIONS = 2**16  # model.max_positions, model.transformer.max_relative_distance
MAX_BEAM = 1024  # decode.beam_size, data.sampling_nbest
MAX_LENGTH_PENALTY = 5.0  # |decode.length_penalty|: ((5 + 65536) / 6) ** 5 still fits a float32
TEMPERATURES = (1e-6, 1e6)  # decode.temperature: far outside, float32 log-probs / temperature are all -inf or NaN
MAX_TOP_K = 2**24  # decode.top_k: more than any vocabulary
MAX_CONFIG_BYTES = 2**20  # a config file is a few KB; a larger one is not a config
T = TypeVar("T")


@dataclass(frozen=True)
class DataConfig:
    """Where the parallel text lives and how it is tokenized.

    Files are `{dir}/{split}.{lang}` (format text), or one `{dir}/{split}.tsv` / `{split}.jsonl` a split;
    plain or gzipped (`.gz` is tried too).
    """

    dir: str = "data/multi30k"
    src_lang: str = "de"
    tgt_lang: str = "en"
    train: tuple[str, ...] = ("train",)  # training sets, each `name` or `name:weight` (upsampled by weight)
    valid: str = "val"
    test: str = "test_2016_flickr"
    vocab_size: int = 8000
    shared_vocab: bool = True
    spm_model_type: Literal["unigram", "bpe"] = "unigram"
    max_len: int = 128  # training pairs with more subwords on either side are dropped
    # Subword regularisation of the training pairs, a new segmentation every epoch
    # (seq2seq.tokenizer.Sampling): 0 is off; unigram models take a smoothing
    # alpha over the sampling_nbest best segmentations, BPE a dropout probability.
    sampling_alpha: float = 0.0
    sampling_nbest: int = 64  # -1: all segmentations
    spm_sample: int = 1_000_000  # sentences SentencePiece trains on at most (a uniform sample of the training text)
    prepared_dir: str = ""  # where `seq2seq prepare` writes the training data; "": {train.run_dir}/prepared
    format: Literal["text", "tsv", "jsonl"] = "text"  # tsv: source<TAB>target a line; jsonl: an object a line
    src_field: str = "src"  # format jsonl: the fields holding the two sides
    tgt_field: str = "tgt"
    # An existing SentencePiece model instead of training one (its size wins over vocab_size); without a
    # shared vocabulary, spm_model_src and spm_model_tgt instead.
    spm_model: str = ""
    spm_model_src: str = ""
    spm_model_tgt: str = ""
    pretokenized: bool = False  # the text's whitespace-split tokens are the pieces: a word vocabulary (no subwords)
    # Several language pairs in one model, each "SRC-TGT" (files {dir}/{split}.SRC and .TGT), with a
    # target-language tag <2TGT> on every source sentence (Johnson et al., 2017); needs shared_vocab.
    # (): the one pair src_lang-tgt_lang, without tags.
    pairs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _require(self.vocab_size >= 8, "data.vocab_size", "must be at least 8")
        _require(self.max_len >= 1, "data.max_len", "must be positive")
        _require(self.sampling_alpha >= 0, "data.sampling_alpha", "must be >= 0")
        _require(
            self.spm_model_type != "bpe" or self.sampling_alpha < 1,
            "data.sampling_alpha",
            "is a dropout probability for BPE and must be below 1",
        )
        _require(self.sampling_nbest == -1 or self.sampling_nbest >= 2, "data.sampling_nbest", "must be -1 or >= 2")
        _require_at_most(self.sampling_nbest, MAX_BEAM, "data.sampling_nbest")
        _require(self.spm_sample >= 2, "data.spm_sample", "must be at least 2")
        _require(self.src_lang != self.tgt_lang, "data.tgt_lang", "must differ from data.src_lang")
        for key in ("dir", "src_lang", "tgt_lang", "valid", "test", "src_field", "tgt_field"):
            _require_text(getattr(self, key), f"data.{key}")
        self._check_spm_models()
        if self.pretokenized:
            _require(not self.given_spm_models(), "data.pretokenized", "builds a vocabulary: not with data.spm_model")
            _require(self.sampling_alpha == 0, "data.sampling_alpha", "samples subwords: not with data.pretokenized")
            _require(self.spm_model_type == "unigram", "data.spm_model_type", "does not apply to data.pretokenized")
        _require(len(self.train) > 0, "data.train", "must name at least one training set")
        for name, weight in self.train_sets():
            _require_text(name, "data.train")
            _require(0 < weight < 1e6, "data.train", f"weight of {name} must be a positive number; got {weight}")
        self._check_pairs()

    def _check_pairs(self) -> None:
        """Each pair two different languages, no pair twice, one vocabulary for all of them."""
        for item in self.pairs:
            src, sep, tgt = item.partition("-")
            ok = bool(sep) and all(lang and lang.strip() == lang and "-" not in lang for lang in (src, tgt))
            _require(ok, "data.pairs", f"item {item!r} must be SRC-TGT, e.g. de-en")
            _require(src != tgt, "data.pairs", f"item {item!r} translates a language into itself")
        _require(len(set(self.pairs)) == len(self.pairs), "data.pairs", "names a pair twice")
        _require(
            not self.pairs or self.shared_vocab,
            "data.pairs",
            "needs data.shared_vocab: true (one vocabulary for all languages, which holds the target tags)",
        )
        if self.pairs:  # the tags are pieces of the vocabulary trained here, and the pairs' files are per language
            _require(self.format == "text", "data.pairs", "needs data.format: text ({split}.{lang} files)")
            _require(not self.spm_model, "data.pairs", "trains its own vocabulary with the tags: drop data.spm_model")
            _require(not self.pretokenized, "data.pairs", "does not go with data.pretokenized")

    def language_pairs(self) -> list[tuple[str, str]]:
        """(source, target) language of each pair: data.pairs, or the one pair src_lang-tgt_lang."""
        if not self.pairs:
            return [(self.src_lang, self.tgt_lang)]
        return [(src, tgt) for src, _, tgt in (item.partition("-") for item in self.pairs)]

    def target_tags(self) -> list[str]:
        """The target languages that get a tag on the source ([] for the one pair of src_lang-tgt_lang)."""
        return sorted({tgt for _, tgt in self.language_pairs()}) if self.pairs else []

    def _check_spm_models(self) -> None:
        """One given model for a shared vocabulary, one per side otherwise: a model left unused is an error."""
        per_side = bool(self.spm_model_src), bool(self.spm_model_tgt)
        if self.shared_vocab:
            _require(not any(per_side), "data.spm_model_src", "needs data.shared_vocab: false (else: data.spm_model)")
        else:
            both = "is one model for both sides: needs data.shared_vocab: true (else: spm_model_src, spm_model_tgt)"
            _require(not self.spm_model, "data.spm_model", both)
            _require(all(per_side) or not any(per_side), "data.spm_model_src", "and data.spm_model_tgt go together")

    def given_spm_models(self) -> tuple[str, ...]:
        """The SentencePiece model file(s) to use instead of training: (shared,), (source, target) or ()."""
        if self.spm_model:
            return (self.spm_model,)
        return (self.spm_model_src, self.spm_model_tgt) if self.spm_model_src else ()

    def train_sets(self) -> list[tuple[str, float]]:
        """(split name, upsampling weight) of each training set; `name:2` counts each pair twice an epoch."""
        out = []
        for item in self.train:
            name, sep, weight = item.rpartition(":") if ":" in item else (item, "", "1")
            try:
                out.append((name, float(weight)))
            except ValueError:
                raise ConfigError(f"data.train {item!r}: the weight after ':' must be a number") from None
        return out


@dataclass(frozen=True)
class TransformerConfig:
    """The Transformer's own settings (model.arch: transformer); see seq2seq/model/transformer.py."""

    n_heads: int = 4
    d_ff: int = 1024
    encoder_layers: int = 3
    decoder_layers: int = 3
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0  # inside the feed-forward block (4x wider, so 4x the RNG cost)
    activation: Literal["relu", "gelu"] = "relu"
    norm: Literal["post", "pre"] = "pre"
    norm_type: Literal["layernorm", "rmsnorm"] = "layernorm"
    positions: Literal["sinusoidal", "learned", "relative", "rope"] = "sinusoidal"
    max_relative_distance: int = 16  # positions: relative clips distances to [-k, k] (Shaw et al., 2018)

    def __post_init__(self) -> None:
        _require(self.n_heads > 0, "model.transformer.n_heads", "must be positive")
        _require_at_most(self.n_heads, MAX_HEADS, "model.transformer.n_heads")
        _require(self.d_ff > 0, "model.transformer.d_ff", "must be positive")
        _require_at_most(self.d_ff, MAX_FF, "model.transformer.d_ff")
        for key in ("encoder_layers", "decoder_layers"):
            _require(getattr(self, key) >= 1, f"model.transformer.{key}", "must be at least 1")
            _require_at_most(getattr(self, key), MAX_LAYERS, f"model.transformer.{key}")
        for key in ("attention_dropout", "activation_dropout"):
            _require(0.0 <= getattr(self, key) < 1.0, f"model.transformer.{key}", "must be in [0, 1)")
        _require(self.max_relative_distance >= 1, "model.transformer.max_relative_distance", "must be at least 1")
        _require_at_most(self.max_relative_distance, MAX_POSITIONS, "model.transformer.max_relative_distance")


@dataclass(frozen=True)
class RNNConfig:
    """The recurrent encoder-decoder's own settings (model.arch: rnn); see seq2seq/model/rnn.py."""

    cell: Literal["lstm", "gru"] = "lstm"
    layers: int = 2  # encoder and decoder alike: the bridge maps layer to layer
    hidden_size: int = 512  # the decoder's state; a bidirectional encoder has half per direction
    bidirectional: bool = True
    attention: Literal["none", "dot", "general", "mlp"] = "general"  # Luong et al. (2015), with input feeding
    # attention: none only. Cho et al. (2014): the context vector enters every decoder step and the readout
    context_every_step: bool = False

    def __post_init__(self) -> None:
        _require(self.layers >= 1, "model.rnn.layers", "must be at least 1")
        _require(self.hidden_size >= 2, "model.rnn.hidden_size", "must be at least 2")
        _require_at_most(self.layers, MAX_LAYERS, "model.rnn.layers")
        _require_at_most(self.hidden_size, MAX_WIDTH, "model.rnn.hidden_size")
        _require(
            not self.bidirectional or self.hidden_size % 2 == 0,
            "model.rnn.hidden_size",
            f"({self.hidden_size}) must be even with model.rnn.bidirectional (half per direction)",
        )
        _require(
            not self.context_every_step or self.attention == "none",
            "model.rnn.context_every_step",
            f"needs model.rnn.attention: none (with attention: {self.attention} every step already reads "
            "its own context from the encoder states)",
        )


ARCHITECTURES = ("transformer", "rnn")  # model.arch, and the name of the section of its own settings


@dataclass(frozen=True)
class ModelConfig:
    """The settings both architectures share, and the section of the chosen one's own settings.

    Only the section `arch` names exists (the other is None, and a config file
    that sets it is refused): a setting the model would ignore is a mistake.
    """

    arch: Literal["transformer", "rnn"] = "transformer"
    d_model: int = 256  # the embeddings, and the Transformer's width
    dropout: float = 0.1  # on the embeddings and between layers
    max_positions: int = 512  # the longest sequence the model takes
    share_decoder_embeddings: bool = True  # output projection = decoder input embedding
    share_all_embeddings: bool = True  # encoder embedding too; needs data.shared_vocab
    transformer: TransformerConfig | None = None  # model.arch: transformer; None: the defaults
    rnn: RNNConfig | None = None  # model.arch: rnn; None: the defaults

    def __post_init__(self) -> None:
        _require(self.d_model > 0, "model.d_model", "must be positive")
        _require_at_most(self.d_model, MAX_WIDTH, "model.d_model")
        _require(0.0 <= self.dropout < 1.0, "model.dropout", "must be in [0, 1)")
        _require(self.max_positions >= 8, "model.max_positions", "must be at least 8")
        _require_at_most(self.max_positions, MAX_POSITIONS, "model.max_positions")
        other = "rnn" if self.arch == "transformer" else "transformer"
        _require(getattr(self, other) is None, f"model.{other}", f"does not apply to model.arch: {self.arch}")
        if getattr(self, self.arch) is None:  # frozen: the chosen section's defaults are filled in once, here
            object.__setattr__(self, self.arch, TransformerConfig() if self.arch == "transformer" else RNNConfig())
        if self.transformer is not None:
            _check_heads(self.d_model, self.transformer)

    def dropouts(self) -> tuple[float, ...]:
        """Every dropout probability of the chosen architecture."""
        t = self.transformer
        return (self.dropout,) if t is None else (self.dropout, t.attention_dropout, t.activation_dropout)


def _check_heads(d_model: int, t: TransformerConfig) -> None:
    """The heads split model.d_model evenly, and rotary positions rotate pairs of a head's dimensions."""
    _require(
        d_model % t.n_heads == 0,
        "model.d_model",
        f"({d_model}) must be divisible by model.transformer.n_heads ({t.n_heads})",
    )
    _require(
        t.positions != "rope" or (d_model // t.n_heads) % 2 == 0,
        "model.transformer.positions",
        f"rope rotates pairs of dimensions: model.d_model / model.transformer.n_heads ({d_model // t.n_heads}) "
        "must be even",
    )


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation, checkpointing and validation."""

    run_dir: str = "runs/default"
    seed: int = 1
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int = 0  # CPU threads for torch; 0 keeps torch's default
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "fp32"
    max_tokens: int = 4096  # token budget of one batch (padded, the larger side)
    update_freq: int = 1  # batches accumulated into one optimizer step
    max_epochs: int = 20
    max_steps: int = 0  # 0: no limit
    max_minutes: float = 0.0  # training-time budget, counted across resumes; 0: no limit
    optimizer: Literal["adam", "adamw"] = "adam"
    lr: float = 7e-4
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-9
    weight_decay: float = 0.0
    schedule: Literal["inverse_sqrt", "noam", "cosine", "constant"] = "inverse_sqrt"
    warmup_steps: int = 1000
    label_smoothing: float = 0.1
    rdrop_alpha: float = 0.0  # R-Drop: weight of the KL between two dropout passes (2.5x the CPU time); 0: off
    clip_norm: float = 1.0  # 0: no clipping
    valid_every: int = 0  # steps between validations; 0: once per epoch
    valid_bleu: bool = True  # decode the validation set for BLEU at each validation
    best_metric: Literal["bleu", "loss"] = "bleu"
    patience: int = 0  # validations without improvement before stopping; 0: never stop
    save_every: int = 0  # steps between saves besides validations (checkpoint_last and a step checkpoint); 0: off
    keep_last: int = 5  # epoch/step checkpoints kept besides checkpoint_last and _best
    average_last: int = 0  # average this many last checkpoints at the end of training; 0: off
    log_every: int = 50
    max_bad_steps: int = 20  # consecutive non-finite losses before giving up
    deterministic: bool = False
    # DataLoader processes collating batches while the model trains; 0: in this process; auto: 0 on the CPU,
    # up to 4 on CUDA (seq2seq.training.setup.data_workers says why)
    num_workers: int | Literal["auto"] = "auto"
    # Fine-tuning: a checkpoint file, or a run directory (its checkpoint_best.pt), whose weights and tokenizer
    # start this run; everything else starts afresh (seq2seq/training/finetune.py). "": random weights.
    init_from: str = ""

    def __post_init__(self) -> None:
        _require_text(self.run_dir, "train.run_dir")
        _require(self.num_workers == "auto" or 0 <= self.num_workers <= 64, "train.num_workers", "must be in [0, 64]")
        _require_seed(self.seed, "train.seed")
        _require(self.max_tokens >= 16, "train.max_tokens", "must be at least 16")
        _require(self.update_freq >= 1, "train.update_freq", "must be at least 1")
        _require(self.max_epochs >= 0, "train.max_epochs", "must be >= 0")
        _require(
            bool(self.max_epochs or self.max_steps or self.max_minutes or self.patience),
            "train.max_epochs",
            "0 (no epoch limit) needs train.max_steps, train.max_minutes or train.patience to end the run",
        )
        _require(self.max_steps >= 0, "train.max_steps", "must be >= 0")
        _require(self.max_minutes >= 0, "train.max_minutes", "must be >= 0")
        _require(self.lr > 0, "train.lr", "must be positive")
        _require(all(0.0 <= b < 1.0 for b in self.betas), "train.betas", f"{list(self.betas)} must be in [0, 1)")
        _require(self.eps > 0, "train.eps", "must be positive")
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0")
        _require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        _require(
            self.schedule != "noam" or self.warmup_steps > 0,
            "train.warmup_steps",
            "must be positive for the noam schedule",
        )
        _require(0.0 <= self.label_smoothing < 1.0, "train.label_smoothing", "must be in [0, 1)")
        _require(self.rdrop_alpha >= 0, "train.rdrop_alpha", "must be >= 0")
        _require(self.clip_norm >= 0, "train.clip_norm", "must be >= 0")
        _require(self.valid_every >= 0, "train.valid_every", "must be >= 0")
        _require(self.patience >= 0, "train.patience", "must be >= 0")
        _require(self.save_every >= 0, "train.save_every", "must be >= 0")
        _require(self.keep_last >= 0, "train.keep_last", "must be >= 0")
        _require(self.average_last >= 0, "train.average_last", "must be >= 0")
        _require(
            self.average_last <= self.keep_last,
            "train.average_last",
            f"({self.average_last}) must not exceed train.keep_last ({self.keep_last}): "
            "only the kept step checkpoints can be averaged",
        )
        _require(self.log_every >= 1, "train.log_every", "must be at least 1")
        _require(0 <= self.threads <= MAX_THREADS, "train.threads", f"must be in [0, {MAX_THREADS}]")
        _require(self.max_bad_steps >= 1, "train.max_bad_steps", "must be at least 1")


@dataclass(frozen=True)
class DecodeConfig:
    """Search settings for `translate`, `evaluate` and validation BLEU."""

    strategy: Literal["beam", "greedy", "sample"] = "beam"
    beam_size: int = 5
    length_penalty: float = 1.0  # GNMT alpha: score / ((5 + len) / 6) ** alpha
    max_len_a: float = 1.5  # tokens allowed before EOS = floor(a * source length + b) ...
    max_len_b: int = 10  # (source length in subwords, its EOS included)
    max_len: int = 256  # ... capped at this
    min_len: int = 1  # tokens required before EOS
    nbest: int = 1
    no_repeat_ngram: int = 0  # 0: off
    suppress_unk: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int = 1
    max_tokens: int = 6000  # source tokens per decoding batch
    max_input_len: int = 0  # subwords (EOS included); longer inputs are truncated with a warning; 0: model limit
    valid_strategy: Literal["beam", "greedy"] = "greedy"  # used for validation BLEU

    def __post_init__(self) -> None:
        _require(self.beam_size >= 1, "decode.beam_size", "must be at least 1")
        _require_at_most(self.beam_size, MAX_BEAM, "decode.beam_size")
        _require(self.max_len >= 1, "decode.max_len", "must be at least 1")
        _require_at_most(self.max_len, MAX_POSITIONS, "decode.max_len")
        _require(0 <= self.max_len_a <= MAX_POSITIONS, "decode.max_len_a", f"must be in [0, {MAX_POSITIONS}]")
        _require(self.max_len_b >= 0, "decode.max_len_b", "must be >= 0")
        _require_at_most(self.max_len_b, MAX_POSITIONS, "decode.max_len_b")
        _require(
            abs(self.length_penalty) <= MAX_LENGTH_PENALTY,  # also false for NaN
            "decode.length_penalty",
            f"must be in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]; got {self.length_penalty:g}",
        )
        _require(
            self.max_len_a > 0 or self.max_len_b > 0,
            "decode.max_len_b",
            "must be positive when decode.max_len_a is 0 (every translation would be cut to decode.min_len tokens)",
        )
        _require(self.min_len >= 0, "decode.min_len", "must be >= 0")
        _require(self.min_len <= self.max_len, "decode.min_len", "must not exceed decode.max_len")
        _require(self.nbest >= 1, "decode.nbest", "must be at least 1")
        _require_at_most(self.nbest, MAX_BEAM, "decode.nbest")
        _require(
            self.strategy != "beam" or self.nbest <= self.beam_size,
            "decode.nbest",
            f"({self.nbest}) must not exceed decode.beam_size ({self.beam_size})",
        )
        _require(self.no_repeat_ngram >= 0, "decode.no_repeat_ngram", "must be >= 0")
        _require_at_most(self.no_repeat_ngram, MAX_POSITIONS, "decode.no_repeat_ngram")
        low, high = TEMPERATURES
        _require(
            low <= self.temperature <= high,  # also false for NaN
            "decode.temperature",
            f"must be in [{low:g}, {high:g}]; got {self.temperature:g}",
        )
        _require(self.top_k >= 0, "decode.top_k", "must be >= 0")
        _require_at_most(self.top_k, MAX_TOP_K, "decode.top_k")
        _require(0.0 < self.top_p <= 1.0, "decode.top_p", "must be in (0, 1]")
        _require(self.max_tokens >= 1, "decode.max_tokens", "must be positive")
        _require(self.max_input_len >= 0, "decode.max_input_len", "must be >= 0")
        _require_at_most(self.max_input_len, MAX_POSITIONS, "decode.max_input_len")
        _require_seed(self.seed, "decode.seed")


@dataclass(frozen=True)
class ExperimentConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)

    def __post_init__(self) -> None:
        _require(
            self.train.rdrop_alpha == 0 or max(self.model.dropouts()) > 0,
            "train.rdrop_alpha",
            "compares two dropout passes, so it needs some dropout in model",
        )
        _require(
            not self.model.share_all_embeddings or self.data.shared_vocab,
            "model.share_all_embeddings",
            "needs data.shared_vocab: true (one vocabulary for both languages)",
        )
        _require(
            self.data.max_len < self.model.max_positions,
            "data.max_len",
            f"({self.data.max_len}) must be below model.max_positions ({self.model.max_positions})",
        )
        _require(
            self.decode.max_len < self.model.max_positions,
            "decode.max_len",
            f"({self.decode.max_len}) must be below model.max_positions ({self.model.max_positions})",
        )


def _require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key} {message}")


def _require_at_most(value: int, limit: int, key: str) -> None:
    """An upper bound on a size: far beyond any real model, a value above it is a typo (or hostile)."""
    _require(value <= limit, key, f"must be at most {limit}; got {value}")


def _require_text(value: str, key: str) -> None:
    """Paths and names: an empty one would silently mean the current directory or a file like `.de`."""
    _require(bool(value.strip()), key, "must not be empty")


def _require_seed(seed: int, key: str) -> None:
    """torch.manual_seed takes [-2**63, 2**64); the seeds derived from it (micro_batch_seed) are in [0, 2**63)."""
    _require(0 <= seed < INT_LIMIT, key, f"must be in [0, 2**63); got {seed}")


def to_dict(cfg: Any) -> dict[str, Any]:
    """A plain nested dict (tuples become lists), as written to YAML and checkpoints."""
    return yaml.safe_load(yaml.safe_dump(_plain(dataclasses.asdict(cfg))))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):  # the section of the architecture not chosen (None) is left out
        return {k: _plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def dotted(raw: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested config dict as {"section.key": value}, the names a config's settings go by."""
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict):
            out.update(dotted(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, old value, new value) of each setting that differs between two config dicts, in key order."""
    a, b = dotted(old, prefix), dotted(new, prefix)
    return [(key, a.get(key), b.get(key)) for key in sorted(a.keys() | b.keys()) if a.get(key) != b.get(key)]


def from_dict(raw: dict[str, Any], source: str = "<dict>") -> ExperimentConfig:
    """Build and validate a config from a nested dict (e.g. one stored in a checkpoint)."""
    raw = {**raw}
    if isinstance(raw.get("model"), dict):
        raw["model"] = _architecture_sections(migrate_model(raw["model"], source), source)
    return _build(ExperimentConfig, raw, source, prefix="")


FLAT_TRANSFORMER_KEYS = tuple(f.name for f in dataclasses.fields(TransformerConfig))


def migrate_model(model: dict[str, Any], source: str) -> dict[str, Any]:
    """The model section in today's layout, from the flat one of configs and checkpoints written before
    model.transformer existed (the Transformer's keys at model.*, both architectures' settings always there).

    The flat layout is read as it was then: the settings the chosen architecture ignored are dropped.
    Today's layout comes back unchanged; a mix of the two is refused, naming the first flat key.
    """
    flat = [key for key in FLAT_TRANSFORMER_KEYS if key in model]
    if not flat:
        return model
    if "transformer" in model:
        raise ConfigError(
            f"{source}: model.{flat[0]} is a Transformer setting: write it as model.transformer.{flat[0]} "
            "(a config cannot mix model.transformer with the flat layout of earlier versions)"
        )
    out = {key: value for key, value in model.items() if key not in flat}
    out["transformer"] = {key: model[key] for key in flat}
    ignored = "transformer" if model.get("arch") == "rnn" else "rnn"
    out.pop(ignored, None)
    return out


def _architecture_sections(model: dict[str, Any], source: str) -> dict[str, Any]:
    """The model section without empty architecture sections (`model.transformer=null` on the command line
    drops a file's); a section for the architecture not chosen would be ignored: refused, naming its first key."""
    model = {key: value for key, value in model.items() if not (key in ARCHITECTURES and value is None)}
    arch = model.get("arch", ModelConfig.arch)
    if arch not in ARCHITECTURES:
        return model  # _build names the valid choices
    for section in ARCHITECTURES:
        if section != arch and section in model:
            keys = model[section]
            key = f"model.{section}.{next(iter(keys))}" if isinstance(keys, dict) and keys else f"model.{section}"
            raise ConfigError(
                f"{source}: {key} does not apply to model.arch: {arch} (it is a setting of model.arch: {section}; "
                f"drop it with model.{section}=null, or switch with model.arch={section} model.{arch}=null)"
            )
    return model


def load_config(path: str | Path | None, overrides: list[str] | tuple[str, ...] = ()) -> ExperimentConfig:
    """Read a YAML file (or start from the defaults) and apply `a.b=value` overrides."""
    raw: dict[str, Any] = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        data = _read_config_file(path)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ConfigError(
                f"{path}:{line}: invalid UTF-8 (byte 0x{data[e.start]:02x}); save the file as UTF-8"
            ) from None
        try:
            raw = _parse_yaml(text) or {}
        except AliasError as e:
            raise ConfigError(
                f"{path}:{e.line}: YAML aliases (*name) are not supported; write the values out"
            ) from None
        except DuplicateKeyError as e:
            raise ConfigError(f"{path}:{e.line}: {e.key!r} is given twice in the same section") from None
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}: invalid YAML{where}") from None
        except RecursionError:  # PyYAML's composer recurses once per nesting level
            raise ConfigError(f"{path}: invalid YAML (nested too deeply)") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: a config file must be a mapping of sections")
        if isinstance(raw.get("model"), dict):  # before the overrides, which use today's names
            raw["model"] = migrate_model(raw["model"], source)
    for item in overrides:
        _apply_override(raw, item)
    where = source if not overrides else f"{source} + command line"
    return from_dict(raw, where)


def _read_config_file(path: str | Path) -> bytes:
    """A config file's bytes, read only if it is a file or a pipe (not /dev/zero, not a directory) of sane size."""
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode)):  # a pipe: `--config <(...)`
                raise ConfigError(f"{path}: not a regular file")
            data = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config file ({e.strerror})") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB; not a config file")
    return data


class AliasError(yaml.YAMLError):
    """A YAML alias: a few repeated `*name` can expand a small file into gigabytes (a "billion laughs")."""

    def __init__(self, line: int) -> None:
        super().__init__(f"alias at line {line}")
        self.line = line


class DuplicateKeyError(yaml.YAMLError):
    """A key given twice in one mapping: YAML keeps the last silently, so an edit to the first does nothing."""

    def __init__(self, line: int, key: object) -> None:
        super().__init__(f"{key!r} again at line {line}")
        self.line, self.key = line, key


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing aliases (anchors alone are harmless) and keys given twice."""

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:
        if self.check_event(yaml.AliasEvent):
            raise AliasError(self.peek_event().start_mark.line + 1)
        return super().compose_node(parent, index)

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, str | int | float | bool) and key in seen:
                raise DuplicateKeyError(key_node.start_mark.line + 1, key)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _parse_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506 (a SafeLoader)


def _apply_override(raw: dict[str, Any], item: str) -> None:
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"command line: override {item!r} must look like section.key=value")
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or an empty section in the YAML file
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"command line: {key}: {part!r} is not a section")
        node = child
    try:
        node[parts[-1]] = _parse_yaml(text) if text.strip() else ""
    except (yaml.YAMLError, RecursionError):  # not YAML: keep the text as it was typed
        node[parts[-1]] = text


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if raw is None:  # an empty section (`data:` with nothing below) keeps the defaults
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            # Compare bare names: a shared `section.` prefix would make every key look close.
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f" (valid keys: {', '.join(names)})"
            raise ConfigError(f"{source}: unknown key '{prefix}{key}'{hint}")
        kind = hints[key]
        section = _section_type(kind)
        if section is not None:
            kwargs[key] = _build(section, value, source, prefix=f"{prefix}{key}.")
        else:
            kwargs[key] = _convert(value, kind, f"{prefix}{key}", source)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from None


def _section_type(kind: Any) -> type | None:
    """The dataclass of a section field (`RNNConfig`, or `RNNConfig | None`); None for a plain setting."""
    options = (
        [a for a in typing.get_args(kind) if a is not type(None)]
        if typing.get_origin(kind) in (Union, UnionType)
        else [kind]
    )
    if len(options) == 1 and isinstance(options[0], type) and dataclasses.is_dataclass(options[0]):
        return options[0]
    return None


def _options(kind: Any) -> list[Any]:
    """The plain types and literal values a union field takes, in order."""
    found: list[Any] = []
    for option in typing.get_args(kind):
        found += list(typing.get_args(option)) if typing.get_origin(option) is Literal else [option]
    return found


def _convert(value: Any, kind: Any, key: str, source: str) -> Any:
    """Check `value` against a field type, allowing the lossless conversions YAML needs."""
    origin = typing.get_origin(kind)
    if origin in (Union, UnionType):  # e.g. `int | Literal["auto"]`: the first that takes the value
        for option in typing.get_args(kind):
            try:
                return _convert(value, option, key, source)
            except ConfigError:
                pass
        names = [repr(a) if isinstance(a, str) else getattr(a, "__name__", str(a)) for a in _options(kind)]
        raise ConfigError(f"{source}: {key} must be {' or '.join(names)}; got {value!r}")
    if origin is Literal:
        choices = typing.get_args(kind)
        if value not in choices:
            raise ConfigError(f"{source}: {key} must be one of {', '.join(map(str, choices))}; got {value!r}")
        return value
    if origin is tuple and typing.get_args(kind)[1:] == (Ellipsis,):  # any length; one value is a list of one
        items = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_convert(v, typing.get_args(kind)[0], key, source) for v in items)
    if origin is tuple:
        args = typing.get_args(kind)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{source}: {key} must be a list of {len(args)} values; got {value!r}")
        return tuple(_convert(v, a, key, source) for v, a in zip(value, args))
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, int) and not isinstance(value, bool):
            if not -INT_LIMIT <= value < INT_LIMIT:  # torch would fail with "Overflow when unpacking long"
                raise ConfigError(f"{source}: {key} is out of range; got {value}")
            return value
    elif kind is float:
        number: float | None = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str):  # PyYAML reads `1e-3` as a string
            try:
                number = float(value)
            except ValueError:
                pass
        if number is not None:
            if not math.isfinite(number):  # `.inf`/`nan` would slip past every range check
                raise ConfigError(f"{source}: {key} must be a finite number; got {value!r}")
            return number
    elif kind is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return str(value)
    else:
        raise AssertionError(f"unsupported config type {kind} for {key}")
    name = getattr(kind, "__name__", str(kind))
    hint = ""
    if kind is str and (value is None or isinstance(value, bool)):  # YAML 1.1: no, on, ~ ... are not strings
        hint = " (YAML reads no/yes/on/off/null/~ as booleans or null: quote the value)"
    raise ConfigError(f"{source}: {key} must be {name}; got {value!r}{hint}")


def apply_overrides(cfg: ExperimentConfig, overrides: list[str], source: str = "command line") -> ExperimentConfig:
    """A copy of `cfg` with `a.b=value` overrides applied and validated."""
    raw = to_dict(cfg)
    for item in overrides:
        _apply_override(raw, item)
    return from_dict(raw, source)


def replace_checked(section: T, changes: Mapping[str, Any], source: str, prefix: str) -> T:
    """`dataclasses.replace` with the changed values checked as a config file's are: names, types, ranges."""
    return typing.cast(T, _build(type(section), {**to_dict(section), **changes}, source, prefix))


def config_yaml(cfg: ExperimentConfig) -> str:
    """The config as YAML, every default filled in: what `seq2seq config` prints and a run's config.yaml holds."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)


def save_config(cfg: ExperimentConfig, path: str | Path) -> None:
    Path(path).write_text(config_yaml(cfg), encoding="utf-8")
