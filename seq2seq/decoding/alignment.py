"""Where a model looks: the cross-attention of a translation, and the alignments read from it.

Notation: B sentences, T target tokens (EOS included), S source tokens (EOS
included), L decoder layers, H heads.

Weights come from re-scoring, not from search. Beam search reorders, drops
and forks hypotheses at every step; recording attention inside it would mean
carrying every hypothesis' weights through each reorder, at a cost on every
decode. Instead, once the best hypothesis is known, `teacher_forced_attention`
feeds it back through a decoding session started with `need_attention`
(seq2seq.model.session), whose record keeps each step's weights: the same code
and numbers as the step that chose each token (the fused attention kernel and the math
version agree up to rounding), nothing to keep aligned, and decoding without
recording pays nothing. It costs one extra greedy-sized pass, which is why
pictures and alignments are only computed when asked for.

Row t of a weight matrix is the attention while predicting target token t,
i.e. of the decoder step whose input is token t - 1 (BOS for t = 0).

An RNN with attention has one attention "layer" with one "head": its alignment
weights. An ensemble's attention is the mean of its members' (each member's
chosen layer, heads averaged or not), which needs the members to agree on the
number of layers and heads shown.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from seq2seq.errors import AttentionError, ConfigError
from seq2seq.model.record import AttentionRecord
from seq2seq.model.session import Decodable
from seq2seq.text.vocab import BOS

LayerChoice = int | str
"""A 1-based decoder layer, "last" or "all"."""
HEAD_CHOICES = ("mean", "each")
WORD_START = "\u2581"  # SentencePiece's mark of a piece that begins a word


@dataclass
class AttentionMap:
    """The cross-attention of one translation's best hypothesis, as chosen (layers, heads)."""

    source: list[str]  # (S,) source subwords, EOS included
    target: list[str]  # (T,) target subwords, EOS included
    weights: Tensor  # (L', H', T, S) float32 on the CPU; each row sums to 1
    layers: list[str]  # the names of the L' layers shown, e.g. "layer 3"
    heads: list[str]  # the names of the H' heads shown, e.g. "mean of 4 heads" or "head 2"


def parse_layer(text: str) -> LayerChoice:
    """A layer option as given on the command line: "last", "all" or a number from 1."""
    if text in ("last", "all"):
        return text
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise ConfigError(f"--attention-layer must be last, all or a layer number from 1; got {text!r}")


class Attending(Protocol):
    """A model, or an ensemble, as `require_attention` checks it."""

    @property
    def attention_layers(self) -> list[int]:
        """The decoder layers with cross-attention of each model decoded (one per member of an ensemble); 0 for
        a model without attention (an RNN with model.rnn.attention: none)."""
        ...


def require_attention(model: Attending, layer: LayerChoice = "last") -> None:
    """One line for a model without attention (an RNN with model.rnn.attention: none) or without `layer`."""
    for layers in model.attention_layers:
        if layers == 0:
            raise AttentionError(
                "this model has no attention (model.rnn.attention: none): there are no weights to draw or align"
            )
        check_layer(layer, layers)


def check_layer(layer: LayerChoice, layers: int) -> None:
    if isinstance(layer, int) and layer > layers:
        raise AttentionError(f"attention layer {layer} does not exist: the model has {layers} decoder layers")


@torch.no_grad()
def teacher_forced_record(model: Decodable, src: Tensor, src_pad_mask: Tensor, tgt: Tensor) -> AttentionRecord:
    """The attention record of targets tgt (B, T), EOS-ended and PAD-filled, fed to a decoding session that
    records it, one step per target token (rows past a target's EOS are for padding and mean nothing)."""
    session = model.start(src, src_pad_mask, need_attention=True)
    inputs = torch.cat([torch.full_like(tgt[:, :1], BOS), tgt[:, :-1]], dim=1)  # (B, T)
    for t in range(inputs.shape[1]):
        session.step(inputs[:, t : t + 1])
    if session.attention is None:
        raise AttentionError("the model's decoding session records no attention")
    return session.attention


def teacher_forced_attention(model: Decodable, src: Tensor, src_pad_mask: Tensor, tgt: Tensor) -> Tensor:
    """Cross-attention weights (B, T, L, H, S) of targets tgt (B, T) (see `teacher_forced_record`); an ensemble's
    members' layers side by side."""
    return teacher_forced_record(model, src, src_pad_mask, tgt).weights()


def select(weights: Tensor, layer: LayerChoice, heads: str) -> tuple[Tensor, list[str], list[str]]:
    """The chosen layers and heads of weights (B, T, L, H, S): (B, T, L', H', S) and their names."""
    if heads not in HEAD_CHOICES:
        raise ConfigError(f"attention heads must be {' or '.join(HEAD_CHOICES)}; got {heads!r}")
    if layer not in ("last", "all") and not (isinstance(layer, int) and layer >= 1):
        raise ConfigError(f"attention layer must be last, all or a layer number from 1; got {layer!r}")
    L, H = weights.shape[2], weights.shape[3]
    if layer == "all":
        chosen, layers = weights, [f"layer {i + 1}" for i in range(L)]
    else:
        number = L if layer == "last" else int(layer)
        check_layer(number, L)
        chosen, layers = weights[:, :, number - 1 : number], [f"layer {number}"]
    if heads == "mean":
        return chosen.mean(dim=3, keepdim=True), layers, [f"mean of {H} heads" if H > 1 else "attention"]
    return chosen, layers, [f"head {h + 1}" for h in range(H)]


def model_attention(
    model: Decodable, src: Tensor, src_pad_mask: Tensor, tgt: Tensor, layer: LayerChoice, heads: str
) -> tuple[Tensor, list[str], list[str]]:
    """The chosen cross-attention (B, T, L', H', S) of a model or ensemble, with layer and head names: of an
    ensemble, the mean of what is chosen of each member."""
    parts = teacher_forced_record(model, src, src_pad_mask, tgt).parts()
    chosen = [select(part.weights(), layer, heads) for part in parts if part.steps]
    if not chosen:
        raise AttentionError("the decoding session recorded no attention: the model has none")
    if len(chosen) == 1:
        return chosen[0]
    shapes = {weights.shape for weights, _, _ in chosen}
    if len(shapes) > 1:
        raise AttentionError(
            "the ensemble's members show different numbers of layers or heads; "
            "choose one layer (--attention-layer) and average the heads to combine them"
        )
    weights = torch.stack([w for w, _, _ in chosen]).mean(dim=0)
    layers = chosen[0][1] if all(c[1] == chosen[0][1] for c in chosen) else ["chosen layer"] * weights.shape[2]
    return weights, layers, chosen[0][2]


# Alignments.


def subword_alignment(amap: AttentionMap) -> list[int]:
    """For each target subword, the source subword it attends to most (over the layers and heads shown)."""
    return amap.weights.mean(dim=(0, 1)).argmax(dim=-1).tolist()  # (T,)


def word_indices(pieces: list[str]) -> list[int]:
    """The whitespace word of each subword of an EOS-ended sequence (-1 for the EOS).

    A piece starting with '▁' starts a word (SentencePiece marks the spaces
    that way), so the words are those of the detokenized text split on whitespace.
    """
    words, current = [], -1
    for piece in pieces[:-1]:
        if piece.startswith(WORD_START) or current < 0:
            current += 1
        words.append(current)
    return [*words, -1]


def word_alignment(amap: AttentionMap) -> list[tuple[int, int]]:
    """(source word, target word) pairs: each target subword links its word to the word of the
    source subword it attends to most, EOS left out on both sides (as a word, it is none).

    Every target word gets at least one link; a word whose subwords look at
    different source words gets several (alignment tools read that as many-to-many).
    """
    src_words, tgt_words = word_indices(amap.source), word_indices(amap.target)
    if len(src_words) < 2:
        return []
    weights = amap.weights.mean(dim=(0, 1))[:, :-1]  # (T, S - 1): the source EOS column left out
    best = weights.argmax(dim=-1).tolist()  # (T,)
    return sorted({(src_words[best[t]], tgt_words[t]) for t in range(len(tgt_words)) if tgt_words[t] >= 0})


def pharaoh(pairs: list[tuple[int, int]]) -> str:
    """The 'i-j' format of alignment tools (fast_align, Moses): source word i aligned to target word j, 0-based."""
    return " ".join(f"{i}-{j}" for i, j in pairs)
