"""Recurrent encoder-decoders (Sutskever et al., 2014; Luong et al., 2015) and their decoding session.

Notation: B batch, S source length, T target length, D embedding size (model.d_model),
H the decoder's hidden size (model.rnn.hidden_size), L layers, V vocabulary.

`attention: none` is the fixed-vector model: the encoder's last state, through
the bridge, is all the decoder ever learns of the source. By default
(Sutskever et al.) it is only the decoder's initial state, which each step
may overwrite; with `context_every_step` (Cho et al., 2014) its top layer is
the context vector c, concatenated to the decoder's input at every step and to
what the readout reads, a_t = tanh(W_c [y_{t-1}; d_t; c]) (Cho et al. use a
maxout there), so the last step still sees the source as the first did.

With attention this is Luong et al.'s global attention with input feeding,
rather than Bahdanau et al.'s context inside the recurrence, because:
- the three score functions taught (dot `d_t^T h_k`, general `d_t^T W h_k`,
  MLP `w^T tanh(W [d_t; h_k])`) are Luong's, and they score the *current*
  decoder state d_t, as written; Bahdanau scores the previous one;
- input feeding passes the previous attentional vector into the recurrence, so
  the decoder still knows what it attended to before (Bahdanau's reason for
  putting the context inside), and one step function serves training and search.
The price: a decoder with attention runs its time steps one by one in training
too, while `none` runs the RNN over the whole target in one call.

Padding: the encoder packs its input, so padded positions never enter the
recurrence, and attention masks them, so they never change a real position.
"""

from __future__ import annotations

from typing import NamedTuple, overload

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from seq2seq.config import ModelConfig
from seq2seq.model.embedding import Embedding, output_layer, token_embeddings
from seq2seq.model.record import AttentionRecord

State = tuple[Tensor, ...]  # (h,) for a GRU, (h, c) for an LSTM; each (L, B, H)


@overload
def run_rnn(rnn: nn.RNNBase, x: Tensor, state: State | None) -> tuple[Tensor, State]: ...
@overload
def run_rnn(rnn: nn.RNNBase, x: PackedSequence, state: State | None) -> tuple[PackedSequence, State]: ...


def run_rnn(rnn: nn.RNNBase, x: Tensor | PackedSequence, state: State | None) -> tuple[Tensor | PackedSequence, State]:
    """One call of a GRU or LSTM with the state as a tuple of tensors, whatever the cell: x (B, T, in), or a
    packed batch, and the output of the same kind.

    The recurrence runs in float32 even under autocast: oneDNN's bf16 LSTM refuses
    inputs of mixed precision, and a recurrence accumulates its rounding anyway.
    The matmuls around it (attention, readout, output) keep the autocast dtype.
    """
    if isinstance(x, Tensor):
        x = x.float()
    hx = None if state is None else tuple(s.float() for s in state)
    with torch.autocast(rnn.all_weights[0][0].device.type, enabled=False):
        if isinstance(rnn, nn.LSTM):
            out, (h, c) = rnn(x, None if hx is None else (hx[0], hx[1]))
            return out, (h, c)
        out, h = rnn(x, None if hx is None else hx[0])
        return out, (h,)


class Encoded(NamedTuple):
    memory: Tensor  # (B, S, H) the top layer's outputs, both directions concatenated; zeros at padding
    state: State  # (L, B, H) each: the last real position's state per layer, directions concatenated


class RNNEncoder(nn.Module):
    def __init__(self, embedding: Embedding, rnn: nn.RNNBase) -> None:
        super().__init__()
        self.embedding = embedding
        self.rnn = rnn

    def forward(self, src: Tensor, src_pad_mask: Tensor) -> Encoded:
        lengths = (~src_pad_mask).sum(dim=1).cpu()  # (B,) pack_padded_sequence wants them on the CPU
        packed = pack_padded_sequence(self.embedding(src), lengths, batch_first=True, enforce_sorted=False)
        out, state = run_rnn(self.rnn, packed, None)
        memory, _ = pad_packed_sequence(out, batch_first=True, total_length=src.shape[1])
        return Encoded(memory, tuple(self.by_layer(s) for s in state))

    def by_layer(self, s: Tensor) -> Tensor:
        """(L * directions, B, H / directions) -> (L, B, H): each layer's directions side by side."""
        directions = 2 if self.rnn.bidirectional else 1
        _, B, h = s.shape
        return s.view(-1, directions, B, h).permute(0, 2, 1, 3).reshape(-1, B, directions * h)


class Bridge(nn.Module):
    """The encoder's final states -> the decoder's initial states, layer by layer.

    A bidirectional encoder's state is two halves read in opposite directions:
    a learned tanh(W s + b) per state (h, and c for an LSTM) mixes them into one
    (Bahdanau et al.'s s_0 = tanh(W h_1)). A unidirectional encoder's last state
    is handed over as it is: the fixed vector of Sutskever et al.
    """

    def __init__(self, hidden_size: int, n_states: int, learned: bool) -> None:
        super().__init__()
        self.maps = nn.ModuleList([nn.Linear(hidden_size, hidden_size) for _ in range(n_states if learned else 0)])

    def forward(self, state: State) -> State:
        if not self.maps:
            return state
        return tuple(torch.tanh(linear(s)) for linear, s in zip(self.maps, state))


class GlobalAttention(nn.Module):
    """Luong et al.'s global attention of a decoder state d_t (B, H) over encoder states h_k (B, S, H).

    dot: d_t^T h_k; general: d_t^T W h_k; mlp: w^T tanh(W_d d_t + W_h h_k), which is
    w^T tanh(W [d_t; h_k]) with W split in two. What does not depend on d_t (W h_k,
    W_h h_k) is projected once per sentence, in `keys`, and cached.
    """

    def __init__(self, score: str, hidden_size: int) -> None:
        super().__init__()
        self.score = score
        self.key_proj = nn.Linear(hidden_size, hidden_size, bias=False) if score in ("general", "mlp") else None
        self.query_proj = nn.Linear(hidden_size, hidden_size) if score == "mlp" else None
        self.v = nn.Linear(hidden_size, 1, bias=False) if score == "mlp" else None

    def keys(self, memory: Tensor) -> Tensor:
        return memory if self.key_proj is None else self.key_proj(memory)  # (B, S, H)

    def forward(self, query: Tensor, keys: Tensor, memory: Tensor, pad_mask: Tensor) -> tuple[Tensor, Tensor]:
        """The context vector (B, H) and the alignment weights (B, S)."""
        if self.query_proj is not None and self.v is not None:
            scores = self.v(torch.tanh(keys + self.query_proj(query)[:, None, :])).squeeze(-1)  # (B, S)
        else:
            scores = torch.bmm(keys, query[:, :, None]).squeeze(-1)  # (B, S)
        weights = scores.masked_fill(pad_mask, float("-inf")).softmax(dim=-1)
        return torch.bmm(weights[:, None, :], memory).squeeze(1), weights


class RNNCache:
    """What decoding carries between steps: the recurrent state, the last attentional vector
    (input feeding) and, for attention, the encoder states, their keys and the padding mask;
    for a decoder that reads it at every step, the context vector."""

    def __init__(
        self,
        state: State,
        feed: Tensor | None,
        memory: Tensor,
        keys: Tensor | None,
        pad_mask: Tensor,
        context: Tensor | None = None,
    ):
        self.state = state  # (L, N, H) each
        self.feed = feed  # (N, D), or None without attention
        self.memory = memory  # (N, S, H)
        self.keys = keys  # (N, S, H), or None without attention
        self.pad_mask = pad_mask  # (N, S) True at padding
        self.context = context  # (N, H) the fixed context vector c, or None unless model.rnn.context_every_step

    @property
    def batch_size(self) -> int:
        return self.pad_mask.shape[0]

    def reorder(self, index: Tensor) -> None:
        """Reorder hypotheses within each sentence: only what depends on the target prefix moves."""
        self.state = tuple(s.index_select(1, index) for s in self.state)
        if self.feed is not None:
            self.feed = self.feed.index_select(0, index)

    def select(self, index: Tensor) -> None:
        """Keep (or repeat) whole rows, the encoder states (and the context vector, a sentence's own) included."""
        self.reorder(index)
        self.memory = self.memory.index_select(0, index)
        self.pad_mask = self.pad_mask.index_select(0, index)
        if self.keys is not None:
            self.keys = self.keys.index_select(0, index)
        if self.context is not None:
            self.context = self.context.index_select(0, index)


class RNNDecoder(nn.Module):
    """An RNN over the target whose attentional vector a_t is D wide, so the output layer can share the
    embedding matrix: tanh(W_c [c_t; d_t]) with attention; without, tanh(W_c d_t), or
    tanh(W_c [y_{t-1}; d_t; c]) with the context vector c at every step."""

    def __init__(
        self,
        embedding: Embedding,
        rnn: nn.RNNBase,
        attention: GlobalAttention | None,
        output: nn.Linear,
        dropout: float,
        context_every_step: bool = False,
    ) -> None:
        super().__init__()
        self.embedding = embedding
        self.rnn = rnn
        self.attention = attention
        self.context_every_step = context_every_step
        H, D = rnn.hidden_size, output.in_features
        read = 2 * H if attention is not None else D + 2 * H if context_every_step else H
        self.readout = nn.Linear(read, D)  # W_c
        self.dropout = nn.Dropout(dropout)
        self.output = output  # (V, D) weight, tied to the embedding unless configured otherwise

    def forward(self, tgt_in: Tensor, cache: RNNCache, select: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) at the `select`ed positions."""
        return self.run(tgt_in, cache, select)[0]

    def run(self, tgt_in: Tensor, cache: RNNCache, select: Tensor | None = None) -> tuple[Tensor, list[Tensor]]:
        """`forward`'s logits and, with attention, the alignment weights (B, S) of each target position."""
        x = self.embedding(tgt_in)  # (B, T, D)
        weights: list[Tensor] = []
        if self.attention is None:
            a = self.fixed_vector_steps(x, cache)  # (B, T, D)
        else:
            steps = [self.attend_step(x[:, t], cache) for t in range(x.shape[1])]
            a = torch.stack([a_t for a_t, _ in steps], dim=1)
            weights = [w for _, w in steps]
        a = self.dropout(a)
        if select is not None:
            a = a[select]  # (N, D): project only the positions that are scored
        return self.output(a), weights  # (B, T, V) or (N, V)

    def fixed_vector_steps(self, x: Tensor, cache: RNNCache) -> Tensor:
        """Steps without attention, the whole target in one call (training) or one (search):
        x (B, T, D) -> a (B, T, D); updates the cache's state."""
        if not self.context_every_step:
            out, cache.state = run_rnn(self.rnn, x, cache.state)
            return torch.tanh(self.readout(out))
        assert cache.context is not None
        c = cache.context[:, None].expand(-1, x.shape[1], -1)  # (B, T, H)
        out, cache.state = run_rnn(self.rnn, torch.cat([x, c], dim=-1), cache.state)
        return torch.tanh(self.readout(torch.cat([x, out, c], dim=-1)))

    def attend_step(self, x: Tensor, cache: RNNCache) -> tuple[Tensor, Tensor]:
        """One step with attention and input feeding: x (B, D) -> a_t (B, D) and the alignment weights (B, S);
        updates the cache."""
        assert self.attention is not None and cache.feed is not None and cache.keys is not None
        out, cache.state = run_rnn(self.rnn, torch.cat([x, cache.feed], dim=-1)[:, None], cache.state)
        d = out[:, 0]  # (B, H) the top layer's state
        context, weights = self.attention(d, cache.keys, cache.memory, cache.pad_mask)
        cache.feed = torch.tanh(self.readout(torch.cat([context, d], dim=-1)))
        return cache.feed, weights


class RNNSession:
    """An RNN decoding session (seq2seq.model.session): the decoder and the cache its steps advance."""

    def __init__(self, decoder: RNNDecoder, cache: RNNCache, need_attention: bool = False) -> None:
        self.decoder = decoder
        self.cache = cache
        # None: nothing recorded. A record: each step keeps its alignment weights (N, 1, 1, S) in
        # `attention.steps` (one layer, one head, like the Transformer's (N, L, H, S)), rows as they are then.
        self.attention = AttentionRecord() if need_attention else None

    def step(self, tokens: Tensor) -> Tensor:
        """Logits (N, V) for the next position, given the tokens (N, T) after those already stepped (T is 1 in
        search): the decoder over those positions, its state carried in the cache."""
        logits, weights = self.decoder.run(tokens, self.cache)
        if self.attention is not None:
            self.attention.end_step([w[:, None, None, :] for w in weights[-1:]])  # the last position's: one layer
        return logits[:, -1]  # (N, V)

    def reorder(self, index: Tensor) -> None:
        self.cache.reorder(index)

    def select(self, index: Tensor) -> None:
        self.cache.select(index)


class Seq2SeqRNN(nn.Module):
    """The same interface as Seq2SeqTransformer: `forward` for training, `start` (a decoding session) for search."""

    def __init__(self, encoder: RNNEncoder, bridge: Bridge, decoder: RNNDecoder) -> None:
        super().__init__()
        self.encoder = encoder
        self.bridge = bridge
        self.decoder = decoder

    def forward(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor, select: Tensor | None = None) -> Tensor:
        """Teacher-forced logits (B, T, V), or (N, V) for the `select`ed positions only."""
        return self.decoder(tgt_in, self.init_cache(self.encode(src, src_pad_mask), src_pad_mask), select)

    @torch.no_grad()
    def cross_attention(self, src: Tensor, src_pad_mask: Tensor, tgt_in: Tensor) -> Tensor:
        """Teacher-forced alignment weights (B, T, 1, 1, S) of target inputs (B, T), BOS first
        (one layer and one head, the Transformer's (B, T, L, H, S)); the model must have attention."""
        if self.decoder.attention is None:
            raise ValueError("this RNN has no attention (model.rnn.attention: none)")
        _, weights = self.decoder.run(tgt_in, self.init_cache(self.encode(src, src_pad_mask), src_pad_mask))
        return torch.stack(weights, dim=1)[:, :, None, None, :]  # (B, T, S) -> (B, T, 1, 1, S)

    def encode(self, src: Tensor, src_pad_mask: Tensor) -> Encoded:
        return self.encoder(src, src_pad_mask)

    def init_cache(self, encoded: Encoded, src_pad_mask: Tensor) -> RNNCache:
        """Bridge the final states; project the encoder states to attention keys, once per sentence.
        The context vector, when the decoder reads one at every step, is its initial state's top layer (h)."""
        state, memory, attention = self.bridge(encoded.state), encoded.memory, self.decoder.attention
        if attention is None:
            context = state[0][-1] if self.decoder.context_every_step else None  # (B, H)
            return RNNCache(state, None, memory, None, src_pad_mask, context)
        feed = memory.new_zeros(memory.shape[0], self.decoder.output.in_features)  # a_0 = 0
        return RNNCache(state, feed, memory, attention.keys(memory), src_pad_mask)

    def start(self, src: Tensor, src_pad_mask: Tensor, need_attention: bool = False) -> RNNSession:
        """Start decoding sources (B, S): encode them and set up the decoder's cache (`init_cache`). With
        `need_attention` the session records every step's alignment weights."""
        return RNNSession(self.decoder, self.init_cache(self.encode(src, src_pad_mask), src_pad_mask), need_attention)

    @property
    def max_positions(self) -> int:
        return self.decoder.embedding.max_positions

    @property
    def attention_layers(self) -> list[int]:
        """The attention "layers": one (its global attention), or none (model.rnn.attention: none)."""
        return [0 if self.decoder.attention is None else 1]


def build_rnn(cfg: ModelConfig, src_vocab_size: int, tgt_vocab_size: int) -> Seq2SeqRNN:
    """The RNN encoder-decoder a config describes (model.arch: rnn)."""
    d, r = cfg.d_model, cfg.rnn
    if r is None:
        raise ValueError(f"model.arch: {cfg.arch} has no model.rnn settings")
    src_tokens, tgt_tokens = token_embeddings(cfg, src_vocab_size, tgt_vocab_size)
    cell = nn.LSTM if r.cell == "lstm" else nn.GRU
    between = cfg.dropout if r.layers > 1 else 0.0  # dropout between stacked layers
    directions = 2 if r.bidirectional else 1
    encoder_rnn = cell(
        d, r.hidden_size // directions, r.layers, batch_first=True, dropout=between, bidirectional=r.bidirectional
    )
    attention = None if r.attention == "none" else GlobalAttention(r.attention, r.hidden_size)
    fed = d if attention else r.hidden_size if r.context_every_step else 0  # input feeding; the context vector
    decoder_rnn = cell(d + fed, r.hidden_size, r.layers, batch_first=True, dropout=between)
    output = output_layer(cfg, tgt_tokens, tgt_vocab_size)

    def embedding(tokens: nn.Embedding) -> Embedding:
        return Embedding(tokens, d, cfg.max_positions, "none", cfg.dropout)

    encoder = RNNEncoder(embedding(src_tokens), encoder_rnn)
    bridge = Bridge(r.hidden_size, 2 if r.cell == "lstm" else 1, learned=r.bidirectional)
    decoder = RNNDecoder(embedding(tgt_tokens), decoder_rnn, attention, output, cfg.dropout, r.context_every_step)
    return Seq2SeqRNN(encoder, bridge, decoder)
