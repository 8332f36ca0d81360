"""Model equivalences: masks, the incremental cache, tied embeddings and embedding scaling.

Every property is checked for each Transformer variant (norms, positions) and each RNN
(cells, attention scores, one or two directions) that it applies to.

Tiny dimensions, fixed seeds, dropout 0 and eval mode, so every comparison is exact up to float rounding.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import weakref
from typing import Any

import pytest
import torch
from conftest import model_config
from torch import Tensor
from torch.nn.attention import SDPBackend

from seq2seq.config import DecoderOnlyConfig, RNNConfig
from seq2seq.model import MultiHeadAttention, Seq2SeqModel, build_model, kernel_scope, training_kernel
from seq2seq.model.cache import HEADS
from seq2seq.model.packed import onednn_available
from seq2seq.model.plan import CPU_KERNEL, FUSED_KERNEL
from seq2seq.model.rnn import Encoded
from seq2seq.model.transformer import DecodingPlan, Seq2SeqTransformer, TransformerSession, sinusoidal_table
from seq2seq.text.vocab import BOS, EOS, PAD

VOCAB = 23
pytestmark = pytest.mark.usefixtures("one_thread")

CLOSE = {"atol": 1e-5, "rtol": 1e-5}
VARIANTS = {
    "pre": {"norm": "pre"},
    "post": {"norm": "post"},
    "learned": {"positions": "learned"},
    "post-learned-gelu-untied": {
        "norm": "post",
        "positions": "learned",
        "activation": "gelu",
        "share_all_embeddings": False,
        "share_decoder_embeddings": False,
    },
    "rmsnorm-pre": {"norm_type": "rmsnorm"},
    "rmsnorm-post": {"norm_type": "rmsnorm", "norm": "post"},
    "relative": {"positions": "relative", "max_relative_distance": 3},  # clipped within the test lengths
    "relative-post-rmsnorm": {"positions": "relative", "norm": "post", "norm_type": "rmsnorm"},
    "rope": {"positions": "rope"},
    "rope-post": {"positions": "rope", "norm": "post"},
    "none": {"positions": "none"},
    # few buckets, so that the test lengths reach the logarithmic ones and the shared last one
    "t5_bias": {"positions": "t5_bias", "t5_buckets": 8, "t5_max_distance": 6},
    "t5_bias-post-rmsnorm": {"positions": "t5_bias", "norm": "post", "norm_type": "rmsnorm"},
    # the encoder's long attention: windows, global tokens and random links narrower than the test sources
    "local_global": {"attention": "local_global", "window": 1, "global_tokens": 1, "random_links": 2},
    "local_global-rope-post": {"attention": "local_global", "window": 2, "positions": "rope", "norm": "post"},
    "local_global-relative": {
        "attention": "local_global",
        "window": 2,
        "global_tokens": 1,
        "positions": "relative",
        "max_relative_distance": 3,
    },
    "linformer": {"attention": "linformer", "linformer_length": 4},
    "linformer-learned-post": {"attention": "linformer", "linformer_length": 9, "positions": "learned", "norm": "post"},
}
RNN_VARIANTS: dict[str, dict[str, Any]] = {
    "rnn-lstm-none-unidirectional": {"cell": "lstm", "attention": "none", "bidirectional": False},
    "rnn-gru-none": {"cell": "gru", "attention": "none"},
    # Cho et al.'s decoder (the tutorial's one-layer unidirectional GRU), and the context at every step of two layers
    "rnn-gru-none-context-unidirectional": {
        "cell": "gru",
        "attention": "none",
        "bidirectional": False,
        "layers": 1,
        "context_every_step": True,
    },
    "rnn-lstm-none-context": {"cell": "lstm", "attention": "none", "context_every_step": True},
    "rnn-lstm-dot": {"cell": "lstm", "attention": "dot"},
    "rnn-gru-general": {"cell": "gru", "attention": "general", "layers": 1},
    "rnn-lstm-mlp-untied": {"cell": "lstm", "attention": "mlp", "share_all": False},
}
# The decoder-only translator (seq2seq.model.decoder_only): a prefix LM and a plain causal LM, with positions
# added to the embeddings (at each row's own offsets) and inside attention; 2 + 2 layers make one stack of 4.
DECODER_ONLY_VARIANTS: dict[str, dict[str, Any]] = {
    "decoder_only-prefix": {"arch": "decoder_only"},
    "decoder_only-causal-learned": {
        "arch": "decoder_only",
        "decoder_only": DecoderOnlyConfig(prefix="causal"),
        "positions": "learned",
    },
    "decoder_only-prefix-rope-post": {"arch": "decoder_only", "positions": "rope", "norm": "post"},
    "decoder_only-causal-relative": {
        "arch": "decoder_only",
        "decoder_only": DecoderOnlyConfig(prefix="causal"),
        "positions": "relative",
        "max_relative_distance": 3,
    },
    "decoder_only-prefix-t5_bias": {
        "arch": "decoder_only",
        "positions": "t5_bias",
        "t5_buckets": 8,
        "t5_max_distance": 6,
    },
}
DECODER_ONLY = list(DECODER_ONLY_VARIANTS)
# PyTorch's two CPU attention kernels: flash (its own choice without attention dropout) and math (CPU training's)
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def rnn_overrides(
    cell: str,
    attention: str,
    bidirectional: bool = True,
    layers: int = 2,
    share_all: bool = True,
    context_every_step: bool = False,
) -> dict[str, Any]:
    rnn = {
        "cell": cell,
        "attention": attention,
        "bidirectional": bidirectional,
        "layers": layers,
        "hidden_size": 12,
        "context_every_step": context_every_step,
    }
    return {
        "arch": "rnn",
        "rnn": RNNConfig(**rnn),
        "share_all_embeddings": share_all,
        "share_decoder_embeddings": share_all,
    }


def variant(name: str) -> dict[str, Any]:
    """The ModelConfig overrides of a named variant, Transformer or RNN."""
    if name in DECODER_ONLY_VARIANTS:
        return DECODER_ONLY_VARIANTS[name]
    return VARIANTS[name] if name in VARIANTS else rnn_overrides(**RNN_VARIANTS[name])


ALL_VARIANTS = [*VARIANTS, *RNN_VARIANTS]
# The RNNs do not use PyTorch's attention kernels: one kernel is enough for them.
WITH_KERNELS = [(v, k) for v in [*VARIANTS, *DECODER_ONLY] for k in KERNELS] + [(v, "flash") for v in RNN_VARIANTS]


def tiny_model(seed: int = 0, **overrides: Any) -> Seq2SeqModel:
    torch.manual_seed(seed)
    cfg = model_config(
        **{
            "d_model": 16,
            "n_heads": 2,
            "d_ff": 32,
            "encoder_layers": 2,
            "decoder_layers": 2,
            "dropout": 0.0,
            "max_positions": 32,
            **overrides,
        }
    )
    return build_model(cfg, VOCAB, VOCAB).eval()


def source_batch(seed: int = 1) -> tuple[Tensor, Tensor]:
    """Three sources of lengths 7, 5 and 3 (EOS-terminated, PAD-padded) and their padding mask."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS + 1, VOCAB, (3, 7), generator=g)
    lengths = torch.tensor([7, 5, 3])
    positions = torch.arange(7)[None, :]
    src[positions == (lengths[:, None] - 1)] = EOS
    mask = positions >= lengths[:, None]
    return src.masked_fill(mask, PAD), mask


def target_batch(length: int = 6, seed: int = 2) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    tgt = torch.randint(EOS + 1, VOCAB, (3, length), generator=g)
    tgt[:, 0] = BOS
    return tgt


# Masks.


@pytest.mark.parametrize(("name", "kernel"), WITH_KERNELS)
@torch.no_grad()
def test_future_target_tokens_do_not_change_earlier_logits(name: str, kernel: str) -> None:
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    changed = tgt.clone()
    changed[:, 3:] = (tgt[:, 3:] - EOS) % (VOCAB - EOS - 1) + EOS + 1  # different ordinary tokens
    with kernel_scope(KERNELS[kernel]):
        before, after = model(src, mask, tgt), model(src, mask, changed)
    torch.testing.assert_close(after[:, :3], before[:, :3], **CLOSE)
    assert not torch.allclose(after[:, 3:], before[:, 3:], atol=1e-3)  # later positions do see them


def encoder_states(encoded: Tensor | Encoded) -> Tensor:
    return encoded.memory if isinstance(encoded, Encoded) else encoded  # (B, S, D or H)


@pytest.mark.parametrize("name", ALL_VARIANTS)
@torch.no_grad()
def test_source_padding_does_not_change_real_positions(name: str) -> None:
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    extra = 5
    padded_src = torch.cat([src, torch.full((3, extra), PAD)], dim=1)
    padded_mask = torch.cat([mask, torch.ones(3, extra, dtype=torch.bool)], dim=1)

    torch.testing.assert_close(model(padded_src, padded_mask, tgt), model(src, mask, tgt), **CLOSE)
    real = ~mask
    torch.testing.assert_close(
        encoder_states(model.encode(padded_src, padded_mask))[:, :7][real],
        encoder_states(model.encode(src, mask))[real],
        **CLOSE,
    )


@pytest.mark.parametrize(
    "name",
    ["pre", "relative", "none", "t5_bias", "rnn-lstm-none-unidirectional", "rnn-lstm-mlp-untied", *DECODER_ONLY],
)
@torch.no_grad()
def test_padded_source_content_is_ignored(name: str) -> None:
    """Whatever ids sit under the mask, the result is the same: the mask, not PAD's embedding, hides them."""
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    garbage = src.masked_fill(mask, 7)
    torch.testing.assert_close(model(garbage, mask, tgt), model(src, mask, tgt), **CLOSE)
    unmasked = model(garbage, torch.zeros_like(mask), tgt)
    assert not torch.allclose(unmasked, model(src, mask, tgt), atol=1e-3)  # without the mask they would matter


@pytest.mark.parametrize("name", ["pre", "rnn-gru-none", "rnn-lstm-dot", "decoder_only-prefix"])
@torch.no_grad()
def test_projecting_selected_positions_equals_slicing_all_logits(name: str) -> None:
    """Training projects only real target tokens to the vocabulary; it must be the same numbers."""
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    keep = torch.rand(tgt.shape, generator=torch.Generator().manual_seed(3)) > 0.4
    torch.testing.assert_close(model(src, mask, tgt, keep), model(src, mask, tgt)[keep], **CLOSE)


# Attention kernels: CPU training in bf16 asks for PyTorch's math kernel instead of its flash one; CUDA never
# uses cuDNN's, which builds a graph per batch shape.


def test_math_kernel_for_bf16_cpu_training_pytorchs_choice_in_fp32_and_no_cudnn_on_cuda() -> None:
    assert training_kernel(torch.device("cpu"), "bf16") == SDPBackend.MATH
    assert training_kernel(torch.device("cpu"), "fp32") is None
    for precision in ("fp32", "bf16", "fp16"):  # cuDNN's builds a graph per batch shape: never chosen
        kernels = training_kernel(torch.device("cuda"), precision)
        assert isinstance(kernels, list) and SDPBackend.CUDNN_ATTENTION not in kernels
        assert SDPBackend.FLASH_ATTENTION in kernels and SDPBackend.MATH in kernels


@pytest.mark.parametrize("name", ["pre", "relative", "rope", "none", "t5_bias"])
@torch.no_grad()
def test_math_and_flash_kernels_compute_the_same_attention(name: str) -> None:
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    with kernel_scope(SDPBackend.FLASH_ATTENTION):
        flash = model(src, mask, tgt)
    with kernel_scope(SDPBackend.MATH):
        math_ = model(src, mask, tgt)
    torch.testing.assert_close(math_, flash, **CLOSE)


# Incremental decoding.


def on(device: torch.device, *tensors: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.to(device) for t in tensors)


def decode_incrementally(model: Seq2SeqModel, src: Tensor, mask: Tensor, tgt: Tensor) -> Tensor:
    session = model.start(src, mask)
    return torch.stack([session.step(tgt[:, t : t + 1]) for t in range(tgt.shape[1])], dim=1)


@pytest.mark.parametrize(("name", "kernel"), WITH_KERNELS)
@torch.no_grad()
def test_cached_decoding_equals_forward(name: str, kernel: str, device: torch.device) -> None:
    """For rope and relative positions this also proves each step sits at its absolute position."""
    if device.type == "cuda" and kernel == "flash":
        pytest.skip("PyTorch's flash kernel on CUDA needs half precision")
    model = tiny_model(**variant(name)).to(device)
    src, mask, tgt = on(device, *source_batch(), target_batch(length=9))
    with kernel_scope(KERNELS[kernel]):
        torch.testing.assert_close(decode_incrementally(model, src, mask, tgt), model(src, mask, tgt), **CLOSE)


@pytest.mark.parametrize(("name", "kernel"), WITH_KERNELS)
@torch.no_grad()
def test_a_step_of_several_positions_equals_steps_of_one(name: str, kernel: str, device: torch.device) -> None:
    """Positions fed to a session together see the cached ones and those before them, never those after: the
    last one's logits, and every step after, are those of one position at a time."""
    if device.type == "cuda" and kernel == "flash":
        pytest.skip("PyTorch's flash kernel on CUDA needs half precision")
    model = tiny_model(**variant(name)).to(device)
    src, mask, tgt = on(device, *source_batch(), target_batch(length=9))
    expected = model(src, mask, tgt)  # (B, T, V)
    with kernel_scope(KERNELS[kernel]):
        session = model.start(src, mask)
        session.step(tgt[:, :1])
        together = session.step(tgt[:, 1:5])  # positions 1..4 at once
        after = torch.stack([session.step(tgt[:, t : t + 1]) for t in range(5, tgt.shape[1])], dim=1)
    torch.testing.assert_close(together, expected[:, 4], **CLOSE)
    torch.testing.assert_close(after, expected[:, 5:], **CLOSE)


@pytest.mark.parametrize("name", ["pre", "post", "relative", "rope", "none", "t5_bias", *RNN_VARIANTS, *DECODER_ONLY])
@torch.no_grad()
def test_cache_reorder_and_select_follow_the_rows(name: str, device: torch.device) -> None:
    """Beam search reorders hypotheses mid-sentence; the cache must then behave as if they had always been there."""
    model = tiny_model(**variant(name)).to(device)
    src, mask, tgt = on(device, *source_batch(), target_batch(length=6))
    expected = model(src, mask, tgt)

    session = model.start(src, mask)
    for t in range(3):
        session.step(tgt[:, t : t + 1])
    rows = torch.tensor([2, 0, 0, 1], device=device)  # drop nothing, repeat row 0, permute
    session.select(rows)
    steps = [session.step(tgt[rows, t : t + 1]) for t in range(3, 6)]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[rows, 3:], **CLOSE)

    # `reorder` moves only the target-side state: valid within one sentence's identical sources.
    same = src[:1].expand(3, -1).contiguous(), mask[:1].expand(3, -1).contiguous()
    expected = model(*same, tgt)
    session = model.start(*same)
    for t in range(3):
        session.step(tgt[:, t : t + 1])
    order = torch.tensor([1, 2, 0], device=device)
    session.reorder(order)
    steps = [session.step(tgt[order, t : t + 1]) for t in range(3, 6)]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[order, 3:], **CLOSE)


@pytest.mark.parametrize("name", ["pre", "relative", "rope"])
@torch.no_grad()
def test_the_cache_grows_past_its_first_capacity(name: str) -> None:
    """Targets longer than the source and a chunk: the self-attention buffer grows (twice here), reordered
    hypotheses included, and every step still equals the full forward pass."""
    model = tiny_model(**variant(name), max_positions=64)
    src, mask = source_batch()  # 7 positions: a first capacity of 7 + 16, rounded up to 32
    length, sentence = 50, torch.tensor([0, 0, 1, 2])  # sentence 0 twice: a beam of two hypotheses
    tgt = torch.randint(EOS + 1, VOCAB, (4, length), generator=torch.Generator().manual_seed(3))  # one per row
    tgt[:, 0] = BOS
    expected = model(src[sentence], mask[sentence], tgt)
    session = model.start(src, mask)
    session.select(sentence)
    row = torch.arange(4)  # the hypothesis (row of tgt) each row of the cache holds
    for t in range(length):
        if t in (20, 40):  # swap the beam's two hypotheses: once before the buffer grows, once after
            session.reorder(torch.tensor([1, 0, 2, 3]))
            row = row[torch.tensor([1, 0, 2, 3])]
        torch.testing.assert_close(session.step(tgt[row, t : t + 1]), expected[row, t], **CLOSE)
    assert isinstance(session, TransformerSession) and session.cache.self_kv is not None
    assert session.cache.self_kv.shape[4] == 64


@pytest.mark.parametrize("name", ["post", "relative", "rope"])
@torch.no_grad()
def test_one_row_per_source_keeps_its_keys_in_one_block_and_beams_moved_in_and_out_still_equal_the_full_pass(
    name: str, device: torch.device
) -> None:
    """With one row per source the self-attention keys are stored position-major (a step's keys in one block),
    with beams source-major; moving from one to the other mid-sentence (a greedy prefix expanded to a beam,
    the beam cut back to one row per source) copies every cached position, and each step still equals the
    full forward pass."""
    model = tiny_model(**variant(name)).to(device)
    K, length = 3, 9
    g = torch.Generator().manual_seed(11)
    src, mask = on(device, *source_batch())
    B = src.shape[0]
    tgt = torch.randint(EOS + 1, VOCAB, (B * K, length), generator=g).to(device)
    tgt[:, 0] = BOS
    tgt[:, :3] = tgt[::K, :3].repeat_interleave(K, dim=0)  # each beam shares its sentence's first three tokens
    sentence = torch.arange(B, device=device).repeat_interleave(K)
    expected = model(src[sentence], mask[sentence], tgt)  # (B * K, length, V)
    session = model.start(src, mask)
    assert isinstance(session, TransformerSession)
    cache, row = session.cache, torch.arange(0, B * K, K, device=device)  # the row of tgt each cache row holds

    def stored_position_major() -> bool:
        kv = cache.self_kv
        assert kv is not None
        return kv.stride(4) > kv.stride(2)  # positions outside sentences in memory

    for t in range(length):
        if t == 3:  # a beam from here on: the three cached positions copied into the beam's layout
            session.select(torch.arange(B, device=device).repeat_interleave(K))
            row = torch.arange(B * K, device=device)
            assert cache.group == K and not stored_position_major()
        if t == 6:  # back to one row per sentence, each keeping its beam's second hypothesis
            keep = torch.arange(1, B * K, K, device=device)
            session.select(keep)
            row = row[keep]
            assert cache.group == 1 and stored_position_major()
        torch.testing.assert_close(session.step(tgt[row, t : t + 1]), expected[row, t], **CLOSE)
        if t == 0:
            assert stored_position_major()


@pytest.mark.parametrize("name", ["pre", "post", "relative", "rope", "none", "t5_bias"])
@torch.no_grad()
def test_cache_follows_beams_and_dropped_rows(name: str, device: torch.device) -> None:
    """The cache as beam search and greedy search use it: each sentence expanded to a beam (sharing one copy of
    its cross-attention keys/values), hypotheses reordered within a beam, rows dropped a few at a time (kept
    in place, only mapped) or many at once (copied): every step still equals the full forward pass."""
    model = tiny_model(**variant(name)).to(device)
    K, length = 4, 8
    g = torch.Generator().manual_seed(5)
    tgt = torch.randint(EOS + 1, VOCAB, (3 * K, length), generator=g)  # one target per hypothesis
    tgt[:, 0] = BOS
    src, mask, tgt = on(device, *source_batch(), tgt)
    sentence = torch.arange(3, device=device).repeat_interleave(K)
    expected = model(src[sentence], mask[sentence], tgt)  # (3K, length, V)
    session = model.start(src, mask)
    session.select(sentence)
    assert isinstance(session, TransformerSession) and session.cache.group == K
    cache = session.cache
    row = torch.arange(3 * K, device=device)  # the hypothesis (row of tgt) each row of the cache holds
    within = torch.tensor([3, 1, 2, 0, 4, 6, 5, 7, 9, 8, 11, 10], device=device)
    changes = {
        2: ("reorder", within),  # within each beam
        3: ("select", torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11], device=device)),  # one dropped: mapped
        5: ("select", torch.tensor([0, 1, 3, 7, 8, 9], device=device)),  # most dropped: copied
        6: ("reorder", torch.tensor([1, 0, 2, 3, 5, 4], device=device)),
    }
    for t in range(length):
        if t in changes:
            how, index = changes[t]
            getattr(session, how)(index)
            row = row[index]
            if t == 3:
                assert cache.rows is not None and cache.batch_size == 11
        logits = session.step(tgt[row, t : t + 1])
        torch.testing.assert_close(logits, expected[row, t], **CLOSE)


@pytest.mark.parametrize("kernel", [CPU_KERNEL, FUSED_KERNEL])
@pytest.mark.parametrize("name", ["post", "rope", "relative", "t5_bias"])
@torch.no_grad()
def test_beam_reorders_move_no_keys_and_every_step_still_equals_the_full_pass(name: str, kernel: str) -> None:
    """Beam search reorders hypotheses within a sentence at every step, a parent often keeping two children
    and losing another, also while dropped rows are only mapped, and drops finished sentences while it
    reorders the others: the cache follows each row's ancestry instead of copying keys (the buffer is never
    replaced; a dropped sentence's successors move up in it), and every step's logits still equal the full
    forward pass of the hypotheses held. Both step kernels: the CPU's matmuls and PyTorch's fused attention
    (the GPU's), each given the grouped keys and their mask."""
    model = tiny_model(**variant(name)).eval()
    K, length = 4, 9
    g = torch.Generator().manual_seed(11)
    tgt = torch.randint(EOS + 1, VOCAB, (3 * K, length), generator=g)
    tgt[:, 0] = BOS
    src, mask = source_batch()
    sentence = torch.arange(3).repeat_interleave(K)  # of each row search sees
    session = model.start(src, mask)
    session.select(sentence)
    assert isinstance(session, TransformerSession)
    cache = session.cache
    cache.plan = dataclasses.replace(cache.plan, kernel=kernel)
    buffer = None
    for t in range(length):
        if t == 4:  # one row dropped: mapped, not copied
            keep = torch.tensor([0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11])
            session.select(keep)
            sentence, tgt = sentence[keep], tgt[keep]
            assert cache.rows is not None
        if t == 6:  # a sentence dropped (copied away) and the others reordered, in one call, as beam search does
            index = torch.tensor([1, 0, 0, 3, 9, 7, 8, 10])
            session.select(index)
            sentence, tgt = sentence[index], tgt[index]
            assert cache.rows is None and cache.self_kv is not None and cache.self_kv.shape[2] == 2
        if t >= 2:  # each row continues a random hypothesis of its own sentence
            same = sentence[:, None] == sentence[None, :]  # (N, N)
            parents = torch.multinomial(same.float(), 1, generator=g)[:, 0]
            session.reorder(parents)
            tgt = torch.cat([tgt[parents, :t], tgt[:, t:]], dim=1)
        logits = session.step(tgt[:, t : t + 1])
        expected = model(src[sentence], mask[sentence], tgt[:, : t + 1])[:, t]
        torch.testing.assert_close(logits, expected, **CLOSE)
        if t == 1:
            buffer = cache.self_kv
    assert buffer is not None and cache.self_kv is not None
    assert cache.self_kv.data_ptr() == buffer.data_ptr() and cache.ancestry is not None


@torch.no_grad()
def test_sessions_reuse_one_block_for_their_keys_and_never_share_it() -> None:
    """A session's self-attention keys/values go into the block the last finished session held (the model's
    `SpareBlocks`); two sessions alive at once never share one; every step still equals the full pass; and a
    session's cache is freed as soon as nothing refers to it (no reference cycle keeps it)."""
    model = tiny_model(**variant("post")).eval()
    assert isinstance(model, Seq2SeqTransformer)
    src, mask = source_batch()
    tgt = target_batch()

    def run(session: TransformerSession) -> int:
        for t in range(tgt.shape[1]):
            logits = session.step(tgt[:, t : t + 1])
            torch.testing.assert_close(logits, model(src, mask, tgt[:, : t + 1])[:, t], **CLOSE)
        assert session.cache.self_kv is not None
        return session.cache.self_kv.data_ptr()

    first = model.start(src, mask)
    assert isinstance(first, TransformerSession)
    first_block = run(first)
    second = model.start(src, mask)  # the first is still alive: its block is not for the second
    assert isinstance(second, TransformerSession)
    assert run(second) != first_block
    alive, held = weakref.ref(first.cache), first.cache.self_kv  # held: malloc cannot hand out this memory again
    del first
    assert alive() is None  # freed by reference counting, without the garbage collector
    third = model.start(src, mask)
    assert isinstance(third, TransformerSession)
    assert run(third) == first_block == held.data_ptr()  # the first session's block, given back when it ended


def test_a_block_made_in_inference_mode_is_not_written_outside_it() -> None:
    """Inference tensors can be written in inference mode only: a session under `no_grad` after one under
    `inference_mode` takes fresh memory (and decodes right)."""
    model = tiny_model(**variant("post")).eval()
    src, mask = source_batch()
    tgt = target_batch()
    with torch.inference_mode():
        decode_incrementally(model, src, mask, tgt)
    with torch.no_grad():
        torch.testing.assert_close(decode_incrementally(model, src, mask, tgt), model(src, mask, tgt), **CLOSE)


@pytest.mark.parametrize("name", ["post", "pre", "rope", "relative"])
def test_the_encoder_pass_for_decoding_reuses_one_heads_block_and_clears_its_padding(name: str) -> None:
    """The encoder pass that starts decoding writes every layer's queries, keys and values into one tensor from
    the model's kept memory (`Packing.heads`): a block left full of NaN by anything before is reused, its
    padding zeroed, and the output still equals the padded encoder's at every real position. With autograd,
    the layers keep tensors of their own and gradients flow."""
    model = tiny_model(**variant(name)).eval()
    assert isinstance(model, Seq2SeqTransformer)
    src, mask = source_batch()
    with torch.no_grad():
        expected = model.encoder(src, mask).masked_fill(mask[:, :, None], 0.0)
        first = model.encode(src, mask)
        block = model.plan.spare._blocks[HEADS]
        block.fill_(float("nan"))
        second = model.encode(src, mask)
        assert model.plan.spare._blocks[HEADS].data_ptr() == block.data_ptr()
    torch.testing.assert_close(first, expected, **CLOSE)
    torch.testing.assert_close(second, expected, **CLOSE)
    model.zero_grad()
    model.encode(src, mask).sum().backward()
    grads = [p.grad for p in model.encoder.parameters() if p.grad is not None]
    assert grads and all(bool(g.isfinite().all()) for g in grads)


def test_decoding_follows_the_weights_after_training_updates() -> None:
    """Decoding keeps prepacked copies of the decoder's weights; an update (a fused optimizer's too, which does
    not bump the parameters' versions) must not leave it decoding with the old ones."""
    model = tiny_model(**variant("post")).eval()
    src, mask = source_batch()
    tgt = target_batch()
    with torch.no_grad():
        before = decode_incrementally(model, src, mask, tgt)
    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    model(src, mask, tgt).logsumexp(dim=-1).mean().backward()
    optimizer.step()
    model.eval()
    with torch.no_grad():
        after = decode_incrementally(model, src, mask, tgt)
        torch.testing.assert_close(after, model(src, mask, tgt), **CLOSE)
    assert not torch.allclose(after, before, atol=1e-3)


@pytest.mark.parametrize("name", ["post", "post-learned-gelu-untied", "relative", "rope-post", "none", "t5_bias"])
@torch.no_grad()
def test_packed_and_plain_decoder_linears_give_the_same_logits(name: str) -> None:
    """The oneDNN-packed projections (CPU float32 decoding's default) against the modules themselves."""
    model = tiny_model(**variant(name)).eval()
    assert isinstance(model, Seq2SeqTransformer)
    src, mask = source_batch()
    tgt = target_batch(length=9)
    packed = decode_incrementally(model, src, mask, tgt)
    assert model.plan.holds_packed == onednn_available()
    model.plan = DecodingPlan(model.decoder, pack=False)
    plain = decode_incrementally(model, src, mask, tgt)
    assert not model.plan.holds_packed
    torch.testing.assert_close(packed, plain, **CLOSE)


@torch.no_grad()
def test_each_session_gets_the_models_plan_and_data_of_its_own() -> None:
    """CPU float32 sessions share the model's packed plan (packed once, for every batch); their keys and
    values are their own, and a step changes no plan."""
    model = tiny_model(**variant("post")).eval()
    assert isinstance(model, Seq2SeqTransformer)
    src, mask = source_batch()
    first = model.start(src, mask)
    second = model.start(src[:2], mask[:2])
    assert (first.plan is second.plan) == onednn_available() and first.plan.kernel == CPU_KERNEL
    assert (first.plan.linear(model.decoder.output) is not model.decoder.output) == onednn_available()
    plan = second.plan
    second.step(target_batch()[:2, :1])
    assert second.plan is plan and first.cache.self_kv is None and second.cache.self_kv is not None
    assert first.cache.cross.shape[2] == 3 and second.cache.cross.shape[2] == 2


@torch.no_grad()
def test_the_decoding_plan_belongs_to_its_model_and_follows_loaded_weights() -> None:
    """Packed copies live in the model's plan (copies of the model pack their own), and loading other weights
    in eval mode, in place, repacks."""
    model, other = tiny_model(seed=0).eval(), tiny_model(seed=1).eval()
    assert isinstance(model, Seq2SeqTransformer) and isinstance(other, Seq2SeqTransformer)
    src, mask = source_batch()
    tgt = target_batch()
    before = decode_incrementally(model, src, mask, tgt)
    twin = copy.deepcopy(model)
    assert twin.plan is not model.plan and twin.plan.decoder is twin.decoder and not twin.plan.holds_packed
    torch.testing.assert_close(decode_incrementally(twin, src, mask, tgt), before, **CLOSE)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(decode_incrementally(model, src, mask, tgt), other(src, mask, tgt), **CLOSE)
    torch.testing.assert_close(decode_incrementally(twin, src, mask, tgt), before, **CLOSE)


@pytest.mark.parametrize("name", ["pre", "rope", "rnn-lstm-dot"])
def test_decoding_past_max_positions_is_refused(name: str) -> None:
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    with pytest.raises(ValueError, match="max_positions"):
        model(src, mask, target_batch(length=33))


# Tied embeddings.


def embedding_weights(model: Seq2SeqModel) -> tuple[Tensor, Tensor, Tensor]:
    return (
        model.encoder.embedding.tokens.weight,
        model.decoder.embedding.tokens.weight,
        model.decoder.output.weight,
    )


@pytest.mark.parametrize("arch", ["transformer", "rnn"])
@pytest.mark.parametrize(
    ("share_all", "share_decoder", "expected_distinct"),
    [(True, True, 1), (False, True, 2), (True, False, 2), (False, False, 3)],
)
def test_tied_embeddings_are_one_parameter(
    share_all: bool, share_decoder: bool, expected_distinct: int, arch: str
) -> None:
    model = tiny_model(share_all_embeddings=share_all, share_decoder_embeddings=share_decoder, arch=arch)
    encoder, decoder, output = embedding_weights(model)
    assert (encoder is decoder) == share_all
    assert (decoder is output) == share_decoder
    assert len({id(w) for w in (encoder, decoder, output)}) == expected_distinct
    # The optimizer sees a tied matrix once, and a write through one name shows through the others.
    n_params = sum(p.numel() for p in model.parameters())
    assert n_params == sum(p.numel() for p in set(model.parameters()))
    with torch.no_grad():
        decoder[5, 0] = 42.0
    assert (encoder[5, 0].item() == 42.0) == share_all
    assert (output[5, 0].item() == 42.0) == share_decoder


def test_tied_embeddings_stay_tied_after_loading_weights() -> None:
    source = tiny_model(seed=0)
    target = tiny_model(seed=1)
    target.load_state_dict(source.state_dict())
    encoder, decoder, output = embedding_weights(target)
    assert encoder is decoder is output
    torch.testing.assert_close(output, embedding_weights(source)[2])


def test_share_all_embeddings_needs_one_vocabulary() -> None:
    cfg = model_config(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    with pytest.raises(ValueError, match="one vocabulary"):
        build_model(cfg, 20, 21)


def test_separate_vocabularies_have_their_own_sizes() -> None:
    cfg = model_config(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1, share_all_embeddings=False)
    model = build_model(cfg, 30, 20).eval()
    src, mask = source_batch()
    assert model(src, mask, target_batch() % 20).shape[-1] == 20
    assert model.encoder.embedding.tokens.num_embeddings == 30


# Embedding scale and positions (section 3.4 and 3.5 of the paper).


@pytest.mark.parametrize("positions", ["sinusoidal", "learned"])
@torch.no_grad()
def test_embeddings_are_scaled_by_sqrt_d_model(positions: str) -> None:
    model = tiny_model(d_model=16, positions=positions)
    embedding = model.decoder.embedding
    ids = torch.tensor([[BOS, 5, 9, 5]])
    position_table = embedding.positions.weight if embedding.positions is not None else sinusoidal_table(32, 16)
    expected = embedding.tokens.weight[ids] * math.sqrt(16) + position_table[:4]
    torch.testing.assert_close(embedding(ids), expected)
    # Positions are absolute: starting at 2 adds the encodings of positions 2 and 3.
    torch.testing.assert_close(embedding(ids[:, 2:], start=2), expected[:, 2:])
    # Same token, different positions, different vectors.
    assert not torch.allclose(embedding(ids)[0, 1], embedding(ids)[0, 3])


def test_sinusoidal_table_matches_the_paper() -> None:
    d = 16
    table = sinusoidal_table(50, d)
    for pos in (0, 1, 7, 49):
        for i in range(d // 2):
            angle = pos / 10000 ** (2 * i / d)
            assert table[pos, 2 * i].item() == pytest.approx(math.sin(angle), abs=1e-5)
            assert table[pos, 2 * i + 1].item() == pytest.approx(math.cos(angle), abs=1e-5)


def test_pad_embedding_starts_at_zero() -> None:
    model = tiny_model(share_all_embeddings=False, share_decoder_embeddings=False)
    for weight in embedding_weights(model)[:2]:
        assert torch.count_nonzero(weight[PAD]) == 0


# Positions inside attention (rope, relative) and the norms.


def self_attention_scores(attn: MultiHeadAttention, x: Tensor, q_start: int, k_start: int) -> Tensor:
    """Scores (B, H, L, L) of x's self-attention with queries at q_start.. and keys at k_start.."""
    q, k, _ = attn.project_self(x)
    if attn.rotary is not None:
        q, k = attn.rotary(q, q_start), attn.rotary(k, k_start)
    return attn.scores(q, k, q_start, k_start)


@pytest.mark.parametrize("positions", ["rope", "relative"])
@torch.no_grad()
def test_shifting_every_position_leaves_attention_scores_unchanged(positions: str) -> None:
    model = tiny_model(positions=positions, max_relative_distance=3)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))
    for layer in [*model.encoder.layers, *model.decoder.layers]:
        attn = layer.self_attn
        base = self_attention_scores(attn, x, 0, 0)
        for shift in (1, 7, 26):
            torch.testing.assert_close(self_attention_scores(attn, x, shift, shift), base, **CLOSE)
        # Moving the queries against the keys does change them: the scores see distances.
        assert not torch.allclose(self_attention_scores(attn, x, 2, 0), base, atol=1e-3)


@torch.no_grad()
def test_relative_distances_are_clipped() -> None:
    model = tiny_model(positions="relative", max_relative_distance=2)
    relative = model.encoder.layers[0].self_attn.relative
    index = relative.distances(0, 5, 0, 5, torch.device("cpu")) - 2  # clip(j - i, -2, 2)
    assert index[0].tolist() == [0, 1, 2, 2, 2] and index[4].tolist() == [-2, -2, -2, -1, 0]
    assert relative.keys.num_embeddings == relative.values.num_embeddings == 5


@pytest.mark.parametrize("positions", ["rope", "relative", "t5_bias"])
def test_attention_positions_add_nothing_to_the_embeddings(positions: str) -> None:
    model = tiny_model(positions=positions)
    ids = torch.tensor([[BOS, 5, 5]])
    embedded = model.decoder.embedding(ids)
    torch.testing.assert_close(embedded[0, 1], embedded[0, 2])  # same token, same vector: positions come later
    assert not any("positions" in name and "relative" not in name for name in model.state_dict())


# T5's buckets with its defaults (32 buckets, max_distance 128), by hand from the definition (Raffel et al., 2020):
# a direction's n buckets (16 each way in the encoder, 32 in the decoder) hold the exact distances 0 .. n/2 - 1,
# then bucket n/2 + floor(log(d / (n/2)) / log(128 / (n/2)) * n/2), at most n - 1. Encoder: n/2 = 8, so
# 8 + floor(2 log2(d / 8)); keys after the query 16 higher. Decoder: n/2 = 16, so 16 + floor(16/3 log2(d / 16)).
T5_DISTANCES = [0, 1, 7, 8, 11, 12, 15, 16, 19, 22, 23, 32, 45, 46, 64, 90, 91, 112, 113, 127, 128, 1000]
T5_BEFORE = [0, 1, 7, 8, 8, 9, 9, 10, 10, 10, 11, 12, 12, 13, 14, 14, 15, 15, 15, 15, 15, 15]  # key before query
T5_CAUSAL = [0, 1, 7, 8, 11, 12, 15, 16, 17, 18, 18, 21, 23, 24, 26, 29, 29, 30, 31, 31, 31, 31]


def test_t5_buckets_follow_t5s_definition() -> None:
    model = tiny_model(positions="t5_bias")
    encoder, decoder = model.encoder.position_bias, model.decoder.position_bias
    distance = torch.tensor(T5_DISTANCES)
    assert encoder.bucket(-distance).tolist() == T5_BEFORE
    assert encoder.bucket(distance).tolist() == [0] + [16 + b for b in T5_BEFORE[1:]]  # key after query
    assert decoder.bucket(-distance).tolist() == T5_CAUSAL
    assert encoder.bias.weight.shape == decoder.bias.weight.shape == (32, 2)  # a scalar per bucket and head


@torch.no_grad()
def test_t5_bias_is_one_table_per_stack_added_to_self_attention_only() -> None:
    """Shared by the layers of a stack as in T5: one table each for the encoder and the decoder, none in a
    layer (so none on cross-attention); the decoder's step t sees the bias of its distance to each cached key."""
    model = tiny_model(positions="t5_bias")
    tables = [name for name in model.state_dict() if "position_bias" in name]
    assert tables == ["encoder.position_bias.bias.weight", "decoder.position_bias.bias.weight"]
    bias = model.decoder.position_bias
    full = bias(0, 5, 5)  # (1, H, 5, 5): a teacher-forced pass, -inf above the diagonal
    torch.testing.assert_close(bias(3, 1, 4), full[:, :, 3:4, :4])  # step 3 over the 4 keys so far
    assert torch.isinf(full[0, :, 1, 2:]).all() and torch.isfinite(full[0, :, 1, :2]).all()
    head = bias.bias.weight[:, 0]
    assert full[0, 0, 4, :].tolist() == [head[b].item() for b in (4, 3, 2, 1, 0)]  # distances -4 .. 0
    mask = model.encoder.position_bias(0, 3, 3, torch.tensor([True, True, False])[None, None, None])
    assert torch.isinf(mask[0, :, :, 2]).all() and torch.isfinite(mask[0, :, :, :2]).all()  # padding masked


@torch.no_grad()
def test_no_positions_make_the_encoder_permutation_equivariant() -> None:
    """positions: none (NoPos): permuting the real source positions permutes the encoder output the same way,
    padding masked; the same source under sinusoidal positions does not."""
    src = torch.tensor([[5, 6, 7, 8, 9, EOS], [10, 11, 12, EOS, PAD, PAD]])
    order = [torch.tensor([3, 0, 4, 2, 1, 5]), torch.tensor([2, 0, 3, 1, 4, 5])]  # padding stays in place
    permuted = torch.stack([row[o] for row, o in zip(src, order)])
    for positions, equivariant in (("none", True), ("sinusoidal", False)):
        model = tiny_model(positions=positions)
        out, out_permuted = model.encoder(src, src == PAD), model.encoder(permuted, permuted == PAD)
        expected = torch.stack([row[o] for row, o in zip(out, order)])
        real = (permuted != PAD)[..., None]
        assert torch.allclose(out_permuted * real, expected * real, atol=1e-5) == equivariant
    assert not any("position" in name for name in tiny_model(positions="none").state_dict())


@pytest.mark.parametrize(("norm_type", "kind"), [("layernorm", torch.nn.LayerNorm), ("rmsnorm", torch.nn.RMSNorm)])
@pytest.mark.parametrize("norm", ["pre", "post"])
def test_norm_type_picks_every_norm(norm_type: str, kind: type, norm: str) -> None:
    model = tiny_model(norm_type=norm_type, norm=norm)
    norms = [m for m in model.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))]
    assert norms and all(isinstance(m, kind) for m in norms)
    # 3 sub-layers per decoder layer, 2 per encoder layer, plus the final norms of a pre-norm stack
    assert len(norms) == 2 * 2 + 2 * 3 + (2 if norm == "pre" else 0)


# Batch invariance and the RNN's own pieces.


@pytest.mark.parametrize("name", ["rope", "relative", "rmsnorm-pre", "none", "t5_bias", *RNN_VARIANTS, *DECODER_ONLY])
@torch.no_grad()
def test_a_sentence_gets_the_same_logits_alone_and_in_a_batch(name: str, device: torch.device) -> None:
    model = tiny_model(**variant(name)).to(device)
    src, mask, tgt = on(device, *source_batch(), target_batch())
    together = model(src, mask, tgt)
    for i, n in enumerate([7, 5, 3]):
        alone = model(src[i : i + 1, :n], mask[i : i + 1, :n], tgt[i : i + 1])
        torch.testing.assert_close(alone[0], together[i], **CLOSE)


@pytest.mark.parametrize("score", ["dot", "general", "mlp"])
@torch.no_grad()
def test_rnn_attention_is_a_distribution_over_real_source_positions(score: str) -> None:
    model = tiny_model(**rnn_overrides("lstm", score))
    src, mask = source_batch()
    encoded = model.encode(src, mask)
    attention = model.decoder.attention
    keys = attention.keys(encoded.memory)
    query = torch.randn(3, 12, generator=torch.Generator().manual_seed(0))
    context, weights = attention(query, keys, encoded.memory, mask)
    assert (weights[mask] == 0).all()
    torch.testing.assert_close(weights.sum(dim=-1), torch.ones(3))
    torch.testing.assert_close(context, torch.einsum("bs,bsh->bh", weights, encoded.memory))
    assert (encoded.memory[mask] == 0).all()  # packed: padding never ran through the recurrence


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_bridge_is_learned_only_for_a_bidirectional_encoder(cell: str) -> None:
    states = 2 if cell == "lstm" else 1
    for bidirectional, maps in ((True, states), (False, 0)):
        model = tiny_model(**rnn_overrides(cell, "none", bidirectional=bidirectional))
        assert len(model.bridge.maps) == maps
        encoded = model.encode(*source_batch())
        assert all(s.shape == (2, 3, 12) for s in encoded.state)  # (layers, B, H), directions side by side


@pytest.mark.parametrize("context_every_step", [False, True])
@torch.no_grad()
def test_without_attention_only_the_final_state_reaches_the_decoder(context_every_step: bool) -> None:
    """The fixed-vector model: a source that ends in the same state gives the same translation."""
    model = tiny_model(**rnn_overrides("lstm", "none", context_every_step=context_every_step))
    src, mask = source_batch()
    tgt = target_batch()
    encoded = model.encode(src, mask)
    cache = model.init_cache(encoded._replace(memory=torch.randn_like(encoded.memory)), mask)
    torch.testing.assert_close(model.decoder(tgt, cache), model(src, mask, tgt), **CLOSE)


@pytest.mark.parametrize("name", ["relative", "rope", "rmsnorm-pre", "none", "t5_bias", *RNN_VARIANTS, *DECODER_ONLY])
def test_bf16_autocast_trains_and_stays_close_to_fp32(name: str) -> None:
    """precision=auto picks bf16 on CPUs with native bf16: every variant must run (and backpropagate) under it."""
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    with torch.no_grad():
        reference = model(src, mask, tgt)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model.train()(src, mask, tgt)
    logits.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    torch.testing.assert_close(logits.float(), reference, atol=0.1, rtol=0.05)


@pytest.mark.parametrize("name", ["rnn-gru-none-context-unidirectional", "rnn-lstm-none-context"])
@torch.no_grad()
def test_the_context_vector_is_the_initial_top_state_and_every_step_reads_it(name: str) -> None:
    """Cho et al.'s decoder: c = the decoder's initial top-layer h, in the input of every step and in the readout."""
    model = tiny_model(**variant(name))
    src, mask = source_batch()
    tgt = target_batch()
    cache = model.init_cache(model.encode(src, mask), mask)
    assert cache.context is not None
    torch.testing.assert_close(cache.context, cache.state[0][-1], rtol=0, atol=0)
    D, H = 16, 12
    assert model.decoder.rnn.input_size == D + H and model.decoder.readout.in_features == D + 2 * H
    expected = model.decoder(tgt, cache)
    cache = model.init_cache(model.encode(src, mask), mask)  # the same initial state, another context
    assert cache.context is not None
    cache.context = torch.randn_like(cache.context)
    changed = (model.decoder(tgt, cache) - expected).abs().amax(dim=-1)  # (B, T)
    assert (changed > 1e-4).all()  # every position, the last included


def test_the_default_fixed_vector_decoder_has_no_context_vector() -> None:
    model = tiny_model(**rnn_overrides("gru", "none"))
    src, mask = source_batch()
    assert model.init_cache(model.encode(src, mask), mask).context is None
    assert model.decoder.rnn.input_size == 16 and model.decoder.readout.in_features == 12
