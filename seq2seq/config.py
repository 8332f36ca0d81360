"""Experiment configuration: nested dataclasses, YAML files and dotted overrides.

The dataclasses below are the only source of defaults. A YAML file overrides
them, and `section.key=value` arguments override the YAML. Everything is
checked here, before any tensor exists: unknown keys (with the closest valid
name), wrong types, invalid choices and inconsistent values all raise
`ConfigError` with one line that names the key and where it came from.

Each setting is declared once, with `setting(default, help, bounds...)`: its
bounds are checked generically (`Spec`, `Section`), the key in a message is the
section's place in `ExperimentConfig` plus the field's name, and the
configuration reference in docs/guide.md is generated from the same fields.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import logging
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

from seq2seq.errors import ConfigError, UserError

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
SPEC = "seq2seq.config.Spec"  # the key of a setting's Spec in its field's metadata

log = logging.getLogger("seq2seq.config")


@dataclass(frozen=True)
class Spec:
    """What a setting means and which values it takes, written once: its checks, their error messages and
    its row of the configuration reference in docs/guide.md all come from here.

    A number (each number of a tuple) must lie within the bounds, or be one of `also` (e.g. -1: all).
    `limit` caps a size far beyond any real model: a larger value is a typo or hostile, and would fail in
    an allocation. The choices of a setting are its Literal type; they need nothing here.
    """

    help: str
    min: float | None = None  # inclusive lower bound
    above: float | None = None  # exclusive lower bound
    max: float | None = None  # inclusive upper bound
    below: float | None = None  # exclusive upper bound
    limit: int | None = None
    also: tuple[int, ...] = ()
    nonempty: bool = False  # text: an empty path or name would silently mean the current directory or `.de`

    def bounds(self, with_limit: bool = False) -> str:
        """The allowed numbers in words, as error messages say them ("at least 16", "in [0, 1)"); "" if any."""
        low = self.min if self.min is not None else self.above
        high = self.max if self.max is not None else self.below
        closed = self.max is not None
        if with_limit and self.limit is not None and high is None:
            high, closed = self.limit, True
        if low is not None and high is not None:
            text = f"in {'[' if self.min is not None else '('}{_number(low)}, {_number(high)}{']' if closed else ')'}"
        elif self.above is not None:
            text = "positive" if self.above == 0 else f"above {_number(self.above)}"
        elif self.min is not None:
            text = ">= 0" if self.min == 0 else f"at least {_number(self.min)}"
        elif high is not None:
            text = f"at most {_number(high)}" if closed else f"below {_number(high)}"
        else:
            return ""
        return " or ".join([*map(str, self.also), text])

    def within(self, x: float) -> bool:
        """Whether x is allowed (the limit aside); NaN never is."""
        return x in self.also or (
            (self.min is None or x >= self.min)
            and (self.above is None or x > self.above)
            and (self.max is None or x <= self.max)
            and (self.below is None or x < self.below)
        )

    def check(self, value: Any, key: str) -> None:
        """Raise a ConfigError naming `key` if `value` breaks this Spec."""
        if self.nonempty and isinstance(value, str) and not value.strip():
            raise ConfigError(f"{key} must not be empty")
        for x in value if isinstance(value, tuple) else (value,):
            if not isinstance(x, int | float) or isinstance(x, bool):  # e.g. train.num_workers: auto
                continue
            if not self.within(x):
                raise ConfigError(f"{key} must be {self.bounds()}; got {_shown(value)}")
            if self.limit is not None and x > self.limit and x not in self.also:
                raise ConfigError(f"{key} must be at most {self.limit}; got {_shown(value)}")


def setting(
    default: T,
    help: str,
    *,
    min: float | None = None,
    above: float | None = None,
    max: float | None = None,
    below: float | None = None,
    limit: int | None = None,
    also: tuple[int, ...] = (),
    nonempty: bool = False,
) -> T:
    """A dataclass field holding a setting's default and its Spec (see Spec for the arguments)."""
    spec = Spec(help, min=min, above=above, max=max, below=below, limit=limit, also=also, nonempty=nonempty)
    return field(default=default, metadata={SPEC: spec})


def _number(x: float) -> str:
    if isinstance(x, int):
        return f"2**{x.bit_length() - 1}" if x >= 2**32 and x & (x - 1) == 0 else str(x)
    return f"{x:g}"


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(map(_shown, value)) + "]"
    return _number(value) if isinstance(value, int | float) and not isinstance(value, bool) else repr(value)


class Section:
    """A config section. Constructing one checks every field against its Spec and its choices, then the
    checks across fields (`check`); each error names the setting's dotted key, taken from where the
    section sits in ExperimentConfig."""

    def __post_init__(self) -> None:
        cls = type(self)
        hints = _hints(cls)
        for f in dataclasses.fields(typing.cast(Any, self)):
            value, kind = getattr(self, f.name), hints[f.name]
            if typing.get_origin(kind) is Literal and value not in typing.get_args(kind):
                choices = ", ".join(map(str, typing.get_args(kind)))
                raise ConfigError(f"{self.key(f.name)} must be one of {choices}; got {value!r}")
            spec = f.metadata.get(SPEC)
            if spec is not None:
                spec.check(value, self.key(f.name))
        self.check()

    def check(self) -> None:
        """The checks across settings that no Spec can express."""

    def key(self, name: str) -> str:
        """The dotted key of this section's setting `name`, e.g. train.max_tokens."""
        if name not in _hints(type(self)):
            raise AssertionError(f"{type(self).__name__} has no setting {name!r}")
        return _prefixes()[type(self)] + name

    def require(self, ok: bool, name: str, message: str) -> None:
        """Unless ok: a ConfigError "{the key of `name`} {message}"."""
        key = self.key(name)  # a misspelt name fails every construction, not just the rare one that errs
        if not ok:
            raise ConfigError(f"{key} {message}")


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """A section's resolved field types (the annotations are strings here), looked up once."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


@functools.cache
def _prefixes() -> dict[type, str]:
    """Each section class's dotted prefix ("model.transformer."), from the fields of ExperimentConfig down."""
    out: dict[type, str] = {ExperimentConfig: ""}
    for cls, prefix in _sections(ExperimentConfig, ""):
        out[cls] = prefix
    return out


def _sections(cls: type, prefix: str) -> list[tuple[type, str]]:
    """(section class, its dotted prefix) of every section below `cls`, depth first."""
    out = []
    for f in dataclasses.fields(cls):
        section = _section_type(_hints(cls)[f.name])
        if section is not None:
            out += [(section, f"{prefix}{f.name}."), *_sections(section, f"{prefix}{f.name}.")]
    return out


class Setting(typing.NamedTuple):
    key: str  # dotted, e.g. train.max_tokens
    default: Any
    kind: Any  # the field's type
    spec: Spec


def settings() -> list[Setting]:
    """Every setting of an experiment, section by section, each in the order its section declares it."""
    out = []
    for cls, prefix in [(ExperimentConfig, ""), *_sections(ExperimentConfig, "")]:
        for f in dataclasses.fields(cls):
            kind = _hints(cls)[f.name]
            if _section_type(kind) is not None:
                continue
            spec = f.metadata.get(SPEC)
            if not isinstance(spec, Spec):
                raise AssertionError(f"{prefix}{f.name} is not declared with setting(default, help, ...)")
            out.append(Setting(prefix + f.name, f.default, kind, spec))
    return out


@dataclass(frozen=True)
class DataConfig(Section):
    """Where the parallel text lives and how it is tokenized.

    Files are `{dir}/{split}.{lang}` (format text), or one `{dir}/{split}.tsv` / `{split}.jsonl` a split;
    plain or gzipped (`.gz` is tried too).
    """

    dir: str = setting(
        "data/multi30k", "directory of the data files (`{split}.{lang}[.gz]`; see `data.format`)", nonempty=True
    )
    src_lang: str = setting("de", "source language: the suffix of its files", nonempty=True)
    tgt_lang: str = setting("en", "target language: the suffix of its files", nonempty=True)
    train: tuple[str, ...] = setting(
        ("train",), "training sets, each `name` or `name:weight` (upsampled by weight; see Large corpora)"
    )
    valid: str = setting("val", "validation split", nonempty=True)
    test: str = setting("test_2016_flickr", "test split (`evaluate`'s default)", nonempty=True)
    vocab_size: int = setting(8000, "SentencePiece vocabulary size (smaller corpora get fewer)", min=8)
    shared_vocab: bool = setting(True, "one vocabulary for both languages")
    spm_model_type: Literal["unigram", "bpe"] = setting("unigram", "SentencePiece model type")
    max_len: int = setting(128, "training pairs with more subwords on either side are dropped", min=1)
    # seq2seq.text.tokenizer.Sampling
    sampling_alpha: float = setting(
        0.0,
        "subword regularisation: a new random segmentation of every training pair each epoch; unigram: "
        "smoothing over the `data.sampling_nbest` best segmentations, BPE: dropout probability; 0 is off",
        min=0,
    )
    sampling_nbest: int = setting(
        64, "unigram sampling: segmentations sampled from (-1: all)", min=2, also=(-1,), limit=MAX_BEAM
    )
    spm_sample: int = setting(
        1_000_000, "SentencePiece trains on a uniform sample of at most this many training sentences", min=2
    )
    prepared_dir: str = setting(
        "",
        'where `seq2seq prepare` writes the training data (`""`: `prepared/` in the run directory); see Large corpora',
    )
    format: Literal["text", "tsv", "jsonl"] = setting(
        "text",
        "`text`: `{split}.{lang}` files; `tsv`: one `{split}.tsv` a split, `source<TAB>target` a line; `jsonl`: "
        "one `{split}.jsonl`, an object a line (each `.gz` too); a bad line stops with `FILE:LINE`",
    )
    src_field: str = setting("src", "format `jsonl`: the field of the source side", nonempty=True)
    tgt_field: str = setting("tgt", "format `jsonl`: the field of the target side", nonempty=True)
    spm_model: str = setting(
        "",
        "an existing SentencePiece model to use instead of training one (its size wins over `data.vocab_size`); "
        "it must have pad 0, unk 1, bos 2, eos 3",
    )
    spm_model_src: str = setting("", "the same for the source side alone (`data.shared_vocab: false`)")
    spm_model_tgt: str = setting("", "the same for the target side alone (`data.shared_vocab: false`)")
    pretokenized: bool = setting(
        False,
        "the text is already tokenized: its whitespace-split tokens are the pieces of a word vocabulary "
        "(no subwords; unknown words become `<unk>`)",
    )
    pairs: tuple[str, ...] = setting(
        (),
        "several language pairs in one model, each `SRC-TGT` (files `{split}.SRC`, `{split}.TGT`), with a "
        "`<2TGT>` tag on every source sentence (Johnson et al., 2017; see Several languages); needs "
        "`data.shared_vocab`; `[]`: the one pair `data.src_lang`-`data.tgt_lang`, without tags",
    )

    def check(self) -> None:
        self.require(
            self.spm_model_type != "bpe" or self.sampling_alpha < 1,
            "sampling_alpha",
            "is a dropout probability for BPE and must be below 1",
        )
        self.require(self.src_lang != self.tgt_lang, "tgt_lang", f"must differ from {self.key('src_lang')}")
        self._check_spm_models()
        if self.pretokenized:
            pretokenized = self.key("pretokenized")
            self.require(
                not self.given_spm_models(), "pretokenized", f"builds a vocabulary: not with {self.key('spm_model')}"
            )
            self.require(self.sampling_alpha == 0, "sampling_alpha", f"samples subwords: not with {pretokenized}")
            self.require(self.spm_model_type == "unigram", "spm_model_type", f"does not apply to {pretokenized}")
        self.require(len(self.train) > 0, "train", "must name at least one training set")
        for name, weight in self.train_sets():
            self.require(bool(name.strip()), "train", "must not be empty")
            self.require(0 < weight < 1e6, "train", f"weight of {name} must be a positive number; got {weight}")
        self._check_pairs()

    def _check_pairs(self) -> None:
        """Each pair two different languages, no pair twice, one vocabulary for all of them."""
        for item in self.pairs:
            src, sep, tgt = item.partition("-")
            ok = bool(sep) and all(lang and lang.strip() == lang and "-" not in lang for lang in (src, tgt))
            self.require(ok, "pairs", f"item {item!r} must be SRC-TGT, e.g. de-en")
            self.require(src != tgt, "pairs", f"item {item!r} translates a language into itself")
        self.require(len(set(self.pairs)) == len(self.pairs), "pairs", "names a pair twice")
        self.require(
            not self.pairs or self.shared_vocab,
            "pairs",
            f"needs {self.key('shared_vocab')}: true (one vocabulary for all languages, which holds the target tags)",
        )
        if self.pairs:  # the tags are pieces of the vocabulary trained here, and the pairs' files are per language
            self.require(self.format == "text", "pairs", f"needs {self.key('format')}: text ({{split}}.{{lang}} files)")
            self.require(
                not self.spm_model, "pairs", f"trains its own vocabulary with the tags: drop {self.key('spm_model')}"
            )
            self.require(not self.pretokenized, "pairs", f"does not go with {self.key('pretokenized')}")

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
        shared, src, tgt = self.key("shared_vocab"), self.key("spm_model_src"), self.key("spm_model_tgt")
        if self.shared_vocab:
            self.require(not any(per_side), "spm_model_src", f"needs {shared}: false (else: {self.key('spm_model')})")
        else:
            both = f"is one model for both sides: needs {shared}: true (else: {src}, {tgt})"
            self.require(not self.spm_model, "spm_model", both)
            self.require(all(per_side) or not any(per_side), "spm_model_src", f"and {tgt} go together")

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
                raise ConfigError(f"{self.key('train')} {item!r}: the weight after ':' must be a number") from None
        return out


POSITIONS = ("sinusoidal", "learned", "relative", "rope", "t5_bias", "none")
# Long encoder attention: T5's bias is a dense (S, S) table; Linformer's projected keys mix positions, so no
# position can be inside its attention.
LOCAL_POSITIONS = ("sinusoidal", "learned", "relative", "rope", "none")
LINFORMER_POSITIONS = ("sinusoidal", "learned", "none")
MAX_RANDOM_LINKS = 64  # model.transformer.random_links


@dataclass(frozen=True)
class TransformerConfig(Section):
    """The Transformer's own settings (model.arch: transformer); see seq2seq/model/transformer.py."""

    n_heads: int = setting(4, "attention heads (they split `model.d_model`)", min=1, limit=MAX_HEADS)
    d_ff: int = setting(1024, "feed-forward width", min=1, limit=MAX_FF)
    encoder_layers: int = setting(3, "encoder depth", min=1, limit=MAX_LAYERS)
    decoder_layers: int = setting(3, "decoder depth", min=1, limit=MAX_LAYERS)
    attention_dropout: float = setting(0.0, "dropout on the attention weights", min=0, below=1)
    activation_dropout: float = setting(
        0.0, "dropout inside the feed-forward block (4x wider, so 4x the RNG cost)", min=0, below=1
    )
    activation: Literal["relu", "gelu", "swish"] = setting("relu", "activation of the feed-forward block")
    norm: Literal["post", "pre"] = setting(
        "pre", "`post`: x = LN(x + F(x)), the 2017 paper; `pre`: x = x + F(LN(x)), with a final LN"
    )
    norm_type: Literal["layernorm", "rmsnorm"] = setting("layernorm", "the normalisation, for pre- and post-norm alike")
    positions: Literal["sinusoidal", "learned", "relative", "rope", "t5_bias", "none"] = setting(
        "sinusoidal",
        "`sinusoidal` or `learned` (added to the embeddings), `relative` (Shaw et al., 2018), `rope` (rotary) or "
        "`t5_bias` (T5's bucketed bias on the logits, shared by a stack's layers), inside self-attention; `none` "
        "(NoPos): no position information at all",
    )
    max_relative_distance: int = setting(
        16, "`positions: relative` clips distances to [-k, k]", min=1, limit=MAX_POSITIONS
    )
    t5_buckets: int = setting(
        32,
        "`positions: t5_bias`: buckets of distances (the encoder's split between the two directions), half of a "
        "direction's exact, the rest logarithmic",
        min=4,
        limit=MAX_POSITIONS,
    )
    t5_max_distance: int = setting(
        128, "`positions: t5_bias`: distances from this one on share the last bucket", min=2, limit=MAX_POSITIONS
    )
    attention: Literal["full", "local_global", "linformer"] = setting(
        "full",
        "the encoder's self-attention (the decoder's is always full, causal): `full`; `local_global`: each "
        "position attends within +-`window`, the first `global_tokens` attend to and are attended by all, plus "
        "`random_links` (BigBird-style; linear memory on long inputs); `linformer`: keys and values projected along "
        "the sequence to `linformer_length` (Wang et al., 2020)",
    )
    window: int = setting(
        64, "`attention: local_global`: attend to positions within +-window", min=1, limit=MAX_POSITIONS
    )
    global_tokens: int = setting(
        0,
        "`attention: local_global`: the first N positions attend to and are attended by all",
        min=0,
        limit=MAX_POSITIONS,
    )
    random_links: int = setting(
        0,
        "`attention: local_global`: keys each position also attends to, chosen by a fixed hash of the position "
        "within the sentence's length (deterministic)",
        min=0,
        limit=MAX_RANDOM_LINKS,
    )
    linformer_length: int = setting(
        64,
        "`attention: linformer`: k, the length keys and values are projected to by learned (model.max_positions, "
        "k) matrices per layer; at most model.max_positions",
        min=1,
        limit=MAX_POSITIONS,
    )
    scale_embedding: bool = setting(
        True, "token embeddings multiplied by sqrt(`model.d_model`) (false: some imported Marian models)"
    )
    output_bias: bool = setting(False, "a bias on the output projection (an imported Marian model's logits bias)")

    def check(self) -> None:
        supported = {"full": POSITIONS, "local_global": LOCAL_POSITIONS, "linformer": LINFORMER_POSITIONS}
        self.require(
            self.positions in supported[self.attention],
            "attention",
            f"{self.attention} does not go with {self.key('positions')}: {self.positions} (it takes "
            f"{', '.join(supported[self.attention])})",
        )
        kind_of = {"window": "local_global", "global_tokens": "local_global", "random_links": "local_global"}
        kind_of["linformer_length"] = "linformer"
        for name, kind in kind_of.items():  # a setting of another attention would be ignored: a mistake
            self.require(
                self.attention == kind or getattr(self, name) == getattr(TransformerConfig, name),
                name,
                f"applies to {self.key('attention')}: {kind} only (the attention is {self.attention})",
            )
        self.require(self.t5_buckets % 2 == 0, "t5_buckets", f"({self.t5_buckets}) must be even (two directions)")
        self.require(
            self.t5_max_distance > self.t5_buckets // 2,
            "t5_max_distance",
            f"({self.t5_max_distance}) must exceed the exact distances, half of {self.key('t5_buckets')} "
            f"({self.t5_buckets // 2})",
        )


@dataclass(frozen=True)
class RNNConfig(Section):
    """The recurrent encoder-decoder's own settings (model.arch: rnn); see seq2seq/model/rnn.py."""

    cell: Literal["lstm", "gru"] = setting("lstm", "the recurrent cell")
    layers: int = setting(2, "encoder and decoder depth (the bridge maps layer to layer)", min=1, limit=MAX_LAYERS)
    hidden_size: int = setting(
        512, "the decoder's state (a bidirectional encoder has half per direction)", min=2, limit=MAX_WIDTH
    )
    bidirectional: bool = setting(True, "bidirectional encoder, with a learned bridge to the decoder")
    attention: Literal["none", "dot", "general", "mlp"] = setting(
        "general", "attention of Luong et al. (2015), with input feeding"
    )
    context_every_step: bool = setting(
        False,
        "`attention: none` only (refused with attention): the context vector c, the decoder's initial top-layer "
        "state, joins the input of every decoder step and the readout, tanh(W [y; d_t; c]) (Cho et al., 2014; "
        "the PyTorch tutorial's GRU); false: c is only the initial state",
    )

    def check(self) -> None:
        self.require(
            not self.bidirectional or self.hidden_size % 2 == 0,
            "hidden_size",
            f"({self.hidden_size}) must be even with {self.key('bidirectional')} (half per direction)",
        )
        self.require(
            not self.context_every_step or self.attention == "none",
            "context_every_step",
            f"needs {self.key('attention')}: none (with attention: {self.attention} every step already reads "
            "its own context from the encoder states)",
        )


@dataclass(frozen=True)
class DecoderOnlyConfig(Section):
    """The decoder-only translator's own settings (model.arch: decoder_only; see seq2seq/model/decoder_only.py):
    one causal stack over `source target`, whose layers are model.transformer's: as many as the encoder's and
    the decoder's together (`encoder_layers` + `decoder_layers`), each like an encoder layer."""

    prefix: Literal["bidirectional", "causal"] = setting(
        "bidirectional",
        "`bidirectional`: a prefix LM, the source attends to all of itself and the target causally to everything "
        "before it; `causal`: a plain language model over the whole sequence",
    )
    source_loss: float = setting(
        0.0, "weight of the loss on predicting the source tokens (0: the target part only)", min=0
    )


ARCHITECTURES = ("transformer", "rnn", "decoder_only")  # model.arch, and the name of the section of its own settings
ARCH_SECTIONS = {"transformer": ("transformer",), "rnn": ("rnn",), "decoder_only": ("transformer", "decoder_only")}
"""The sections each architecture reads: the decoder-only stack's layers are the Transformer's."""


@dataclass(frozen=True)
class ModelConfig(Section):
    """The settings both architectures share, and the section of the chosen one's own settings.

    Only the section `arch` names exists (the other is None, and a config file
    that sets it is refused): a setting the model would ignore is a mistake.
    """

    arch: Literal["transformer", "rnn", "decoder_only"] = setting(
        "transformer",
        "the architecture (see Architectures); only its own section, `model.transformer.*` or `model.rnn.*`, "
        "may be set (`decoder_only`: `model.decoder_only.*` and `model.transformer.*`)",
    )
    d_model: int = setting(256, "embedding width (and the Transformer's)", min=1, limit=MAX_WIDTH)
    dropout: float = setting(0.1, "residual and embedding dropout (the RNN's between layers too)", min=0, below=1)
    max_positions: int = setting(512, "the longest sequence the model takes", min=8, limit=MAX_POSITIONS)
    share_decoder_embeddings: bool = setting(True, "output projection tied to the target embedding")
    share_all_embeddings: bool = setting(True, "source embedding tied too (needs `data.shared_vocab`)")
    transformer: TransformerConfig | None = None  # model.arch: transformer; None: the defaults
    rnn: RNNConfig | None = None  # model.arch: rnn; None: the defaults
    decoder_only: DecoderOnlyConfig | None = None  # model.arch: decoder_only (with model.transformer)

    def check(self) -> None:
        sections = ARCH_SECTIONS[self.arch]
        for other in ARCHITECTURES:
            if other not in sections:
                self.require(getattr(self, other) is None, other, f"does not apply to {self.key('arch')}: {self.arch}")
        defaults = {"transformer": TransformerConfig, "rnn": RNNConfig, "decoder_only": DecoderOnlyConfig}
        for section in sections:  # frozen: the chosen sections' defaults are filled in once, here
            if getattr(self, section) is None:
                object.__setattr__(self, section, defaults[section]())
        t = self.transformer
        if self.decoder_only is not None:
            self.require(
                self.share_all_embeddings,
                "share_all_embeddings",
                "must be true for model.arch: decoder_only (one sequence, one embedding: needs data.shared_vocab)",
            )
        if self.decoder_only is not None and t is not None:
            t.require(
                t.attention == "full",
                "attention",
                f"{t.attention} is the encoder's self-attention; model.arch: decoder_only has no encoder (full only)",
            )
        if t is not None:  # the heads split d_model evenly, and rotary positions rotate pairs of a head's dimensions
            self.require(
                self.d_model % t.n_heads == 0,
                "d_model",
                f"({self.d_model}) must be divisible by {t.key('n_heads')} ({t.n_heads})",
            )
            t.require(
                t.positions != "rope" or (self.d_model // t.n_heads) % 2 == 0,
                "positions",
                f"rope rotates pairs of dimensions: {self.key('d_model')} / {t.key('n_heads')} "
                f"({self.d_model // t.n_heads}) must be even",
            )
            t.require(
                t.attention != "linformer" or t.linformer_length <= self.max_positions,
                "linformer_length",
                f"({t.linformer_length}) must not exceed {self.key('max_positions')} ({self.max_positions}), the "
                "longest input its projection is built for",
            )

    def dropouts(self) -> tuple[float, ...]:
        """Every dropout probability of the chosen architecture."""
        t = self.transformer
        return (self.dropout,) if t is None else (self.dropout, t.attention_dropout, t.activation_dropout)


@dataclass(frozen=True)
class TrainConfig(Section):
    """The training loop: where the run goes, device, precision, batches, limits, logging; what it starts from.

    What an update optimizes is `optim`, when the model is validated `validation`, what is saved
    `checkpoint` (their settings were `train.*` keys once, still read: see MOVED_TRAIN_KEYS)."""

    run_dir: str = setting("runs/default", "where everything of a run goes", nonempty=True)
    seed: int = setting(1, "seed of the weights, the batches and dropout", min=0, below=INT_LIMIT)
    device: Literal["auto", "cpu", "cuda"] = setting("auto", "`auto`: CUDA if available")
    threads: int = setting(0, "CPU threads for torch (0: torch's default)", min=0, max=MAX_THREADS)
    precision: Literal["auto", "fp32", "bf16", "fp16"] = setting(
        "fp32",
        "`bf16`: autocast; `fp16`: CUDA, with a gradient scaler; `auto`: bf16 on CPUs with native bf16, and on "
        "GPUs for a `model.d_model` of 512 or more (fp16 where the GPU lacks bf16), else fp32 (on an H200, bf16 "
        "updated a width-256 model at 0.87x fp32's speed and a width-512 one at 2.92x)",
    )
    max_tokens: int = setting(4096, "token budget of one batch (padded, the larger side)", min=16)
    update_freq: int = setting(1, "batches accumulated into one optimizer step", min=1)
    max_epochs: int = setting(20, "epochs before stopping (0: no limit)", min=0)
    max_steps: int = setting(0, "updates before stopping (0: no limit)", min=0)
    max_minutes: float = setting(0.0, "training-time budget, counted across resumes (0: no limit)", min=0)
    log_every: int = setting(50, "updates between log lines", min=1)
    max_bad_steps: int = setting(20, "non-finite updates tolerated in a row before giving up", min=1)
    deterministic: bool = setting(False, "deterministic kernels, for reproducibility")
    compile: Literal["off", "default", "reduce-overhead", "max-autotune"] = setting(
        "off",
        "torch.compile the training forward pass in this mode (`reduce-overhead` also captures CUDA graphs); batch "
        "shapes are then rounded up to a bounded set, a graph each, each compiled on first use (logged)",
    )
    # seq2seq.training.setup.data_workers says why auto is 0 on the CPU and a few on CUDA
    num_workers: int | Literal["auto"] = setting(
        "auto",
        "DataLoader processes that collate the next batches while the model trains (0: in the training process; "
        "auto: 0 on the CPU, where a worker would take a core from the model, and min(4, cores - 1) on CUDA, "
        "where subword sampling in the training process would leave the GPU waiting)",
        min=0,
        max=64,
    )
    init_from: str = setting(
        "",
        "fine-tuning: start a fresh run from this checkpoint's (or run directory's `checkpoint_best.pt`) weights "
        'and tokenizer, everything else afresh (see Fine-tuning); `""`: random weights',
    )
    init_encoder_from: str = setting(
        "",
        "start the encoder (and its embeddings; the decoder's too when shared) from a `seq2seq pretrain` "
        "checkpoint, or a run directory's `checkpoint_best.pt`, and use its tokenizer; the rest starts afresh "
        '(see Pretraining the encoder); `""`: random weights',
    )


@dataclass(frozen=True)
class OptimConfig(Section):
    """What an update optimizes and how: the optimizer, the learning-rate schedule, the loss, clipping."""

    optimizer: Literal["adam", "adamw"] = setting("adam", "the optimizer")
    lr: float = setting(7e-4, "peak learning rate", above=0)
    betas: tuple[float, float] = setting((0.9, 0.98), "Adam's betas", min=0, below=1)
    eps: float = setting(1e-9, "Adam's epsilon", above=0)
    weight_decay: float = setting(0.0, "weight decay", min=0)
    schedule: Literal["inverse_sqrt", "noam", "cosine", "constant"] = setting(
        "inverse_sqrt",
        "learning-rate schedule (`cosine` decays to 0 at the first limit reached: train.max_steps, the last epoch's "
        "end or train.max_minutes, its updates projected from the rate so far)",
    )
    warmup_steps: int = setting(1000, "updates of linear warmup (`noam` needs some)", min=0)
    label_smoothing: float = setting(0.1, "label smoothing of the loss", min=0, below=1)
    rdrop_alpha: float = setting(
        0.0,
        "R-Drop: every batch twice through the model under two dropout masks, plus this weight times their "
        "symmetric KL; an update costs 2.5x a plain one on CPU (`scripts/bench/bench_train.py --compare rdrop`); "
        "0 is off",
        min=0,
    )
    clip_norm: float = setting(1.0, "gradient-norm clipping (0: off)", min=0)

    def check(self) -> None:
        self.require(
            self.schedule != "noam" or self.warmup_steps > 0, "warmup_steps", "must be positive for the noam schedule"
        )


@dataclass(frozen=True)
class ValidationConfig(Section):
    """When the model is validated, what is measured, which validation is the best, when to stop early."""

    every: int = setting(0, "updates between validations (0: once per epoch)", min=0)
    bleu: bool = setting(True, "decode the validation set for BLEU at each validation")
    best_metric: Literal["bleu", "loss"] = setting("bleu", "what `checkpoint_best.pt` is best at")
    patience: int = setting(0, "validations without improvement before stopping (0: never stop)", min=0)


@dataclass(frozen=True)
class CheckpointConfig(Section):
    """What a run saves besides checkpoint_last and checkpoint_best, how many it keeps and averages."""

    every: int = setting(
        0, "updates between saves besides validations (checkpoint_last and a step checkpoint); 0: off", min=0
    )
    keep_last: int = setting(5, "epoch/step checkpoints kept besides checkpoint_last and checkpoint_best", min=0)
    average_last: int = setting(
        0, "how many last checkpoints to average at the end of training (0: off; a warning if fewer were kept)", min=0
    )
    format: Literal["torch", "safetensors"] = setting(
        "torch",
        "the file format of the checkpoints written (`safetensors`: nothing unpickled when read; needs the `hf` "
        "extra); either is read, with the same checks",
    )

    def check(self) -> None:
        self.require(
            self.average_last <= self.keep_last,
            "average_last",
            f"({self.average_last}) must not exceed {self.key('keep_last')} ({self.keep_last}): "
            "only the kept step checkpoints can be averaged",
        )


@dataclass(frozen=True)
class DecodeConfig(Section):
    """Search settings for `translate`, `evaluate` and validation BLEU."""

    strategy: Literal["beam", "greedy", "sample"] = setting("beam", "the search")
    beam_size: int = setting(5, "beam width", min=1, limit=MAX_BEAM)
    length_penalty: float = setting(
        1.0,
        "GNMT alpha: score = log P / ((5 + n) / 6) ** alpha",
        min=-MAX_LENGTH_PENALTY,
        max=MAX_LENGTH_PENALTY,
    )
    beam_stop: Literal["exact", "first_k"] = setting(
        "exact",
        "when beam search stops a sentence: `exact` once none of its live hypotheses can beat its K-th best "
        "finished one (the best the beam can find; under a length penalty that grows with length it searches "
        "longer), `first_k` once K have finished (fairseq's and CTranslate2's rule: faster, can miss a longer, "
        "better hypothesis); an exported model's beam runs on to the length limit for `exact`",
    )
    max_len_a: float = setting(
        1.5,
        "tokens allowed before EOS: floor(a * source length + b), the source length in subwords with its EOS",
        min=0,
        max=MAX_POSITIONS,
    )
    max_len_b: int = setting(10, "the b of `decode.max_len_a`", min=0, limit=MAX_POSITIONS)
    max_len: int = setting(256, "the cap on a * source length + b", min=1, limit=MAX_POSITIONS)
    min_len: int = setting(1, "tokens required before EOS", min=0)
    nbest: int = setting(
        1,
        "hypotheses returned per sentence by beam search; greedy search and sampling return one",
        min=1,
        limit=MAX_BEAM,
    )
    no_repeat_ngram: int = setting(
        0, "n-gram blocking: no n-gram of this size twice (0: off)", min=0, limit=MAX_POSITIONS
    )
    suppress_unk: bool = setting(False, "never emit `<unk>`")
    temperature: float = setting(1.0, "sampling temperature", min=TEMPERATURES[0], max=TEMPERATURES[1])
    top_k: int = setting(0, "sampling from the k likeliest tokens (0: off)", min=0, limit=MAX_TOP_K)
    top_p: float = setting(1.0, "nucleus sampling (1: off)", above=0, max=1)
    seed: int = setting(1, "sampling seed", min=0, below=INT_LIMIT)
    max_tokens: int = setting(6000, "source tokens per decoding batch", min=1)
    max_input_len: int = setting(
        0,
        "subwords (EOS included) of the longest input; longer ones are truncated with a warning (0: model limit)",
        min=0,
        limit=MAX_POSITIONS,
    )
    valid_strategy: Literal["beam", "greedy"] = setting("greedy", "search used for validation BLEU")
    quantize: Literal["none", "int8"] = setting(
        "none",
        "`int8`: the encoder's and decoder's linear layers run in int8 on the CPU (weights quantized per output row "
        "when the model is opened, inputs per row at every call; oneDNN's int8 GEMM on CPUs with VNNI or AMX, "
        "FBGEMM's on other x86 CPUs; the checkpoint stays float32), not on CUDA nor for an RNN; a CTranslate2 model "
        "loads with compute type int8; validation always decodes in float32",
    )

    def check(self) -> None:
        self.require(
            self.max_len_a > 0 or self.max_len_b > 0,
            "max_len_b",
            f"must be positive when {self.key('max_len_a')} is 0 (every translation would be cut to "
            f"{self.key('min_len')} tokens)",
        )
        self.require(self.min_len <= self.max_len, "min_len", f"must not exceed {self.key('max_len')}")
        self.require(
            self.max_input_len != 1,
            "max_input_len",
            "must be 0 (the model's limit) or at least 2: it counts the EOS, so 1 would leave every input empty",
        )
        self.require(
            self.strategy != "beam" or self.nbest <= self.beam_size,
            "nbest",
            f"({self.nbest}) must not exceed {self.key('beam_size')} ({self.beam_size})",
        )


@dataclass(frozen=True)
class PretrainConfig(Section):
    """`seq2seq pretrain`: masked language modelling of the encoder (BERT's recipe), read by that command only."""

    text: tuple[str, ...] = setting(
        (),
        "monolingual text files (plain or .gz, a sentence a line) to pretrain on; `[]`: the source side of "
        "`data.train`",
    )
    mask_prob: float = setting(0.15, "share of each sentence's ordinary tokens selected for prediction", above=0, max=1)
    mask_token: float = setting(0.8, "share of the selected tokens replaced by the mask token", min=0, max=1)
    random_token: float = setting(
        0.1, "share of the selected tokens replaced by a random token (the rest stay as they were)", min=0, max=1
    )

    def check(self) -> None:
        self.require(
            self.mask_token + self.random_token <= 1,
            "random_token",
            f"({self.random_token}) plus {self.key('mask_token')} ({self.mask_token}) must not exceed 1",
        )


@dataclass(frozen=True)
class ExperimentConfig(Section):
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    pretrain: PretrainConfig = field(default_factory=PretrainConfig)

    def check(self) -> None:
        data, model, train, decode = self.data, self.model, self.train, self.decode
        train.require(
            not (train.init_from and train.init_encoder_from),
            "init_encoder_from",
            f"and {train.key('init_from')} both start the weights: give one",
        )
        valid = self.validation
        train.require(
            bool(train.max_epochs or train.max_steps or train.max_minutes or valid.patience),
            "max_epochs",
            f"0 (no epoch limit) needs {train.key('max_steps')}, {train.key('max_minutes')} or "
            f"{valid.key('patience')} to end the run",
        )
        self.optim.require(
            self.optim.rdrop_alpha == 0 or max(model.dropouts()) > 0,
            "rdrop_alpha",
            "compares two dropout passes, so it needs some dropout in model",
        )
        model.require(
            not model.share_all_embeddings or data.shared_vocab,
            "share_all_embeddings",
            f"needs {data.key('shared_vocab')}: true (one vocabulary for both languages)",
        )
        positions = f"{model.key('max_positions')} ({model.max_positions})"
        if model.decoder_only is not None:  # source and target share one sequence: half each (search caps its half)
            half = f"half of {positions}, as model.arch: decoder_only"
            data.require(data.max_len < model.max_positions // 2, "max_len", f"({data.max_len}) must be below {half}")
            self.check_source_loss(model.decoder_only)
        else:
            data.require(data.max_len < model.max_positions, "max_len", f"({data.max_len}) must be below {positions}")
            decode.require(
                decode.max_len < model.max_positions, "max_len", f"({decode.max_len}) must be below {positions}"
            )

    def check_source_loss(self, d: DecoderOnlyConfig) -> None:
        """The source part's loss rides on the plain training forward pass: not on a compiled or an R-Drop one."""
        if d.source_loss > 0:
            d.require(
                d.prefix == "causal",
                "source_loss",
                f"needs {d.key('prefix')}: causal (a prefix LM's source sees the token it would predict)",
            )
            d.require(self.train.compile == "off", "source_loss", "needs train.compile: off")
            d.require(self.optim.rdrop_alpha == 0, "source_loss", "cannot be combined with optim.rdrop_alpha")


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
    raw = migrate_train(raw, source, stored=True)
    if isinstance(raw.get("model"), dict):
        raw["model"] = _architecture_sections(migrate_model(raw["model"], source), source)
    return _build(ExperimentConfig, raw, source, prefix="")


# Settings that were `train.*` keys before train had sections beside it: where each one is now. Config files,
# command-line overrides and stored configs that use the old key are read, migrated, with a note in the log.
MOVED_TRAIN_KEYS = {
    **{
        key: f"optim.{key}"
        for key in (
            "optimizer",
            "lr",
            "betas",
            "eps",
            "weight_decay",
            "schedule",
            "warmup_steps",
            "label_smoothing",
            "rdrop_alpha",
            "clip_norm",
        )
    },
    "valid_every": "validation.every",
    "valid_bleu": "validation.bleu",
    "best_metric": "validation.best_metric",
    "patience": "validation.patience",
    "save_every": "checkpoint.every",
    "keep_last": "checkpoint.keep_last",
    "average_last": "checkpoint.average_last",
}


def _moved_note(source: str, old: list[str]) -> None:
    moved = ", ".join(f"train.{key} is now {MOVED_TRAIN_KEYS[key]}" for key in old)
    log.warning("%s: %s (the old keys are still read; write the new ones)", source, moved)


def migrate_train(raw: dict[str, Any], source: str, stored: bool = False) -> dict[str, Any]:
    """A config dict with the settings that moved out of `train` (MOVED_TRAIN_KEYS) at their new place, and
    one line in the log: a warning naming each old key for a config someone can rewrite, a short note for one
    `stored` in a checkpoint or an export (every one written before the move). Today's layout comes back
    unchanged; a setting given under both names is refused."""
    train = raw.get("train")
    old = [key for key in train if key in MOVED_TRAIN_KEYS] if isinstance(train, dict) else []
    if not old:
        return raw
    assert isinstance(train, dict)
    out = {**raw, "train": {key: value for key, value in train.items() if key not in old}}
    for key in old:
        section, name = MOVED_TRAIN_KEYS[key].split(".")
        target = out.get(section)
        if target is not None and not isinstance(target, dict):
            raise ConfigError(f"{source}: {section} must be a mapping, got {type(target).__name__}")
        if target is not None and name in target:
            raise ConfigError(
                f"{source}: train.{key} is the old name of {section}.{name}, and both are given: keep {section}.{name}"
            )
        out[section] = {**(target or {}), name: train[key]}
    if stored:
        log.info("%s: written with %d settings at their old train.* keys, read at their new ones", source, len(old))
    else:
        _moved_note(source, old)
    return out


def migrate_override(key: str) -> str:
    """The key a `train.X=value` override of a moved setting (MOVED_TRAIN_KEYS) means today, with a note."""
    section, _, name = key.partition(".")
    if section != "train" or name not in MOVED_TRAIN_KEYS:
        return key
    _moved_note("command line", [name])
    return MOVED_TRAIN_KEYS[name]


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
    for ignored in ARCHITECTURES:
        if ignored not in ARCH_SECTIONS.get(model.get("arch", "transformer"), ("transformer",)):
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
        if section not in ARCH_SECTIONS[arch] and section in model:
            keys = model[section]
            key = f"model.{section}.{next(iter(keys))}" if isinstance(keys, dict) and keys else f"model.{section}"
            switch = " ".join(
                [f"model.arch={section}"]
                + [f"model.{s}=null" for s in ARCH_SECTIONS[arch] if s not in ARCH_SECTIONS[section]]
            )
            raise ConfigError(
                f"{source}: {key} does not apply to model.arch: {arch} (it is a setting of model.arch: {section}; "
                f"drop it with model.{section}=null, or switch with {switch})"
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
        raw = migrate_train(raw, source)
    blocks = _precision_blocks(raw.pop(BY_PRECISION, None), source)
    given = [_parse_override(item) for item in overrides]  # in order: a later one may undo an earlier one
    where = source if not overrides else f"{source} + command line"
    cfg = from_dict(_overridden(raw, {}, given, source), where)
    if not blocks:
        return cfg
    # every block is checked, not only the one this machine picks
    built = {
        name: from_dict(_overridden(raw, block, given, source), f"{where}, {BY_PRECISION}.{name}")
        for name, block in blocks.items()
    }
    precision = _training_precision(cfg)
    overridden = {key for key, _ in given}
    applied = [f"{key}={value}" for key, value in blocks.get(precision, {}).items() if key not in overridden]
    if applied:
        log.info(
            "%s: training in %s here: %s.%s sets %s", source, precision, BY_PRECISION, precision, ", ".join(applied)
        )
    return built.get(precision, cfg)


# `by_precision:` in a config file: settings for the precision training resolves to on the machine that trains
# (`train.precision: auto` is bf16 on a CPU with native bf16, fp32 on one without), applied over the file's own
# and under the command line's. A run's config.yaml and its checkpoints hold the result, not the block. The
# settings that decide the precision cannot depend on it.
BY_PRECISION = "by_precision"
PRECISION_NAMES = ("fp32", "bf16", "fp16")
DECIDE_PRECISION = ("train.precision", "train.device", "model.d_model")


def _precision_blocks(raw: Any, source: str) -> dict[str, dict[str, Any]]:
    """The `by_precision` section of a config file as {precision: {dotted key: value}}, its keys checked."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {BY_PRECISION} must be a mapping of precisions, got {type(raw).__name__}")
    blocks: dict[str, dict[str, Any]] = {}
    for name, block in raw.items():
        where = f"{BY_PRECISION}.{name}"
        if name not in PRECISION_NAMES:
            raise ConfigError(f"{source}: unknown key '{where}' (a precision: {', '.join(PRECISION_NAMES)})")
        if block is not None and not isinstance(block, dict):
            raise ConfigError(f"{source}: {where} must be a mapping of settings, got {type(block).__name__}")
        settings = dotted(block or {})
        for key in settings:  # a whole section (`model: null`) would set them too
            decided = next((d for d in DECIDE_PRECISION if d == key or d.startswith(f"{key}.")), None)
            if decided:
                raise ConfigError(
                    f"{source}: {where}.{key}: the precision depends on {decided}, so it cannot be set here"
                )
        blocks[name] = settings
    return blocks


def _overridden(
    raw: dict[str, Any], block: dict[str, Any], given: list[tuple[str, Any]], source: str
) -> dict[str, Any]:
    """A copy of a config file's dict with a `by_precision` block's settings, then the command line's, applied."""
    out = copy.deepcopy(raw)
    for key, value in block.items():
        _set(out, key, value, f"{source}: {BY_PRECISION}")
    for key, value in given:
        _set(out, key, value, "command line")
    return out


def _training_precision(cfg: ExperimentConfig) -> str:
    """The precision `cfg` trains in on this machine, as training resolves it (torch is imported only here)."""
    from seq2seq.device import resolve_device, resolve_precision

    return resolve_precision(cfg.train.precision, resolve_device(cfg.train.device), cfg.model.d_model)


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
    _set(raw, *_parse_override(item), "command line")


def _parse_override(item: str) -> tuple[str, Any]:
    """The dotted key (today's name) and the value of a `section.key=value` override."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ConfigError(f"command line: override {item!r} must look like section.key=value")
    key = migrate_override(key)
    if key.split(".")[0] == BY_PRECISION:
        raise ConfigError(
            f"command line: {key}: {BY_PRECISION} is read from config files only; override the setting itself"
        )
    try:
        return key, _parse_yaml(text) if text.strip() else ""
    except (yaml.YAMLError, RecursionError):  # not YAML: keep the text as it was typed
        return key, text


def _set(raw: dict[str, Any], key: str, value: Any, source: str) -> None:
    """Set the dotted `key` of a nested config dict, making the sections it needs. A mapping given for a section
    sets the keys it names and keeps the others (`data={dir: x, max_len: 64}` is `data.dir=x data.max_len=64`):
    replacing the section would silently put the config file's other settings of it back to their defaults."""
    parts = key.split(".")
    node = raw
    for part in parts[:-1]:
        if node.get(part) is None:  # absent, or an empty section in the YAML file
            node[part] = {}
        child = node[part]
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {key}: {part!r} is not a section")
        node = child
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict):
        for name, inner in value.items():
            _set(node[parts[-1]], str(name), inner, source)
        return
    node[parts[-1]] = value


def _build(cls: type, raw: Any, source: str, prefix: str) -> Any:
    where = prefix.rstrip(".") or "top level"
    if raw is None:  # an empty section (`data:` with nothing below) keeps the defaults
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: {where} must be a mapping, got {type(raw).__name__}")
    hints = _hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in names:
            # Compare bare names: a shared `section.` prefix would make every key look close. In `train`, the
            # settings that moved out of it are close too, named where they are now.
            known = {name: f"{prefix}{name}" for name in names}
            if prefix == "train.":
                known.update(MOVED_TRAIN_KEYS)
            close = difflib.get_close_matches(str(key), list(known), n=1, cutoff=0.6)
            hint = f" (did you mean '{known[close[0]]}'?)" if close else f" (valid keys: {', '.join(names)})"
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


# The configuration reference of docs/guide.md, generated from the settings' Specs.

REFERENCE_START = "<!-- generated from seq2seq/config.py by `seq2seq config --reference docs/guide.md` -->"
REFERENCE_END = "<!-- end of the generated configuration reference -->"


def reference_table() -> str:
    """A Markdown table with a row per setting: its key, default, allowed values and help, section by section."""
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    for s in settings():
        cells = [f"`{s.key}`", _default_text(s.default), _values_text(s.kind, s.spec), s.spec.help]
        rows.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def _default_text(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    if isinstance(value, tuple):
        return "`[" + ", ".join(map(str, value)) + "]`"
    return _number(value)


def _values_text(kind: Any, spec: Spec) -> str:
    """The values a setting takes, in words: its choices, or its type and bounds."""
    if typing.get_origin(kind) in (Union, UnionType):
        return " or ".join(_values_text(option, spec) for option in typing.get_args(kind))
    if typing.get_origin(kind) is Literal:
        return ", ".join(f"`{choice}`" for choice in typing.get_args(kind))
    bounds = spec.bounds(with_limit=True)
    if typing.get_origin(kind) is tuple:
        args = typing.get_args(kind)
        item = _values_text(args[0], Spec(""))
        text = f"list of {item}" if args[1:] == (Ellipsis,) else f"{len(args)} {item}s"
        return f"{text}, each {bounds}" if bounds else text
    name = {bool: "true, false", str: "text"}.get(kind, getattr(kind, "__name__", str(kind)))
    if spec.nonempty:
        return f"{name}, not empty"
    return f"{name}, {bounds}" if bounds else name


def _reference_span(text: str, where: str) -> tuple[int, int]:
    """Where the generated table lies in `text`: between the line of REFERENCE_START and REFERENCE_END."""
    start, end = text.find(REFERENCE_START), text.find(REFERENCE_END)
    if start < 0 or end < start:
        raise UserError(f"{where}: no {REFERENCE_START!r} ... {REFERENCE_END!r} markers to put the reference between")
    return start + len(REFERENCE_START) + 1, end


def reference_in(path: str | Path) -> str:
    """The configuration reference a file holds between its markers, as committed."""
    text = Path(path).read_text(encoding="utf-8")
    start, end = _reference_span(text, str(path))
    return text[start:end]


def write_reference(path: str | Path) -> bool:
    """Put reference_table() between the markers of `path` (docs/guide.md); whether the file changed."""
    text = Path(path).read_text(encoding="utf-8")
    start, end = _reference_span(text, str(path))
    new = text[:start] + reference_table() + text[end:]
    if new == text:
        return False
    Path(path).write_text(new, encoding="utf-8")
    return True
