"""Model equivalences: masks, the incremental cache, tied embeddings and embedding scaling.

Tiny dimensions, fixed seeds, dropout 0 and eval mode, so every comparison is exact up to float rounding.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend

from seq2seq.config import ModelConfig
from seq2seq.model import Seq2SeqTransformer, build_model, kernel_scope, training_kernel
from seq2seq.model.transformer import sinusoidal_table
from seq2seq.vocab import BOS, EOS, PAD

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
}
# PyTorch's two CPU attention kernels: flash (its own choice without attention dropout) and math (CPU training's)
KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


def tiny_model(seed: int = 0, **overrides: Any) -> Seq2SeqTransformer:
    torch.manual_seed(seed)
    cfg = ModelConfig(
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


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@torch.no_grad()
def test_future_target_tokens_do_not_change_earlier_logits(variant: str, kernel: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    src, mask = source_batch()
    tgt = target_batch()
    changed = tgt.clone()
    changed[:, 3:] = (tgt[:, 3:] - EOS) % (VOCAB - EOS - 1) + EOS + 1  # different ordinary tokens
    with kernel_scope(KERNELS[kernel]):
        before, after = model(src, mask, tgt), model(src, mask, changed)
    torch.testing.assert_close(after[:, :3], before[:, :3], **CLOSE)
    assert not torch.allclose(after[:, 3:], before[:, 3:], atol=1e-3)  # later positions do see them


@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@torch.no_grad()
def test_source_padding_does_not_change_real_positions(variant: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    src, mask = source_batch()
    tgt = target_batch()
    extra = 5
    padded_src = torch.cat([src, torch.full((3, extra), PAD)], dim=1)
    padded_mask = torch.cat([mask, torch.ones(3, extra, dtype=torch.bool)], dim=1)

    torch.testing.assert_close(model(padded_src, padded_mask, tgt), model(src, mask, tgt), **CLOSE)
    real = ~mask
    torch.testing.assert_close(
        model.encode(padded_src, padded_mask)[:, :7][real], model.encode(src, mask)[real], **CLOSE
    )


@torch.no_grad()
def test_padded_source_content_is_ignored() -> None:
    """Whatever ids sit under the mask, the result is the same: the mask, not PAD's embedding, hides them."""
    model = tiny_model()
    src, mask = source_batch()
    tgt = target_batch()
    garbage = src.masked_fill(mask, 7)
    torch.testing.assert_close(model(garbage, mask, tgt), model(src, mask, tgt), **CLOSE)
    unmasked = model(garbage, torch.zeros_like(mask), tgt)
    assert not torch.allclose(unmasked, model(src, mask, tgt), atol=1e-3)  # without the mask they would matter


@torch.no_grad()
def test_projecting_selected_positions_equals_slicing_all_logits() -> None:
    """Training projects only real target tokens to the vocabulary; it must be the same numbers."""
    model = tiny_model()
    src, mask = source_batch()
    tgt = target_batch()
    keep = torch.rand(tgt.shape, generator=torch.Generator().manual_seed(3)) > 0.4
    torch.testing.assert_close(model(src, mask, tgt, keep), model(src, mask, tgt)[keep], **CLOSE)


# Attention kernels: CPU training asks for PyTorch's math kernel instead of its flash one.


def test_math_kernel_for_cpu_training_and_pytorchs_choice_elsewhere() -> None:
    assert training_kernel(torch.device("cpu")) == SDPBackend.MATH
    assert training_kernel(torch.device("cuda")) is None


@torch.no_grad()
def test_math_and_flash_kernels_compute_the_same_attention() -> None:
    model = tiny_model()
    src, mask = source_batch()
    tgt = target_batch()
    with kernel_scope(SDPBackend.FLASH_ATTENTION):
        flash = model(src, mask, tgt)
    with kernel_scope(SDPBackend.MATH):
        math_ = model(src, mask, tgt)
    torch.testing.assert_close(math_, flash, **CLOSE)


# Incremental decoding.


def decode_incrementally(model: Seq2SeqTransformer, src: Tensor, mask: Tensor, tgt: Tensor) -> Tensor:
    cache = model.init_cache(model.encode(src, mask), mask)
    return torch.stack([model.decode_step(tgt[:, t : t + 1], cache) for t in range(tgt.shape[1])], dim=1)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("variant", VARIANTS, ids=list(VARIANTS))
@torch.no_grad()
def test_cached_decoding_equals_forward(variant: str, kernel: str) -> None:
    model = tiny_model(**VARIANTS[variant])
    src, mask = source_batch()
    tgt = target_batch(length=9)
    with kernel_scope(KERNELS[kernel]):
        torch.testing.assert_close(decode_incrementally(model, src, mask, tgt), model(src, mask, tgt), **CLOSE)


@pytest.mark.parametrize("variant", ["pre", "post"])
@torch.no_grad()
def test_cache_reorder_and_select_follow_the_rows(variant: str) -> None:
    """Beam search reorders hypotheses mid-sentence; the cache must then behave as if they had always been there."""
    model = tiny_model(**VARIANTS[variant])
    src, mask = source_batch()
    tgt = target_batch(length=6)
    expected = model(src, mask, tgt)

    cache = model.init_cache(model.encode(src, mask), mask)
    for t in range(3):
        model.decode_step(tgt[:, t : t + 1], cache)
    rows = torch.tensor([2, 0, 0, 1])  # drop nothing, repeat row 0, permute
    cache.select(rows)
    steps = [model.decode_step(tgt[rows, t : t + 1], cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[rows, 3:], **CLOSE)

    # `reorder` moves only self-attention state: valid within one sentence's identical sources.
    same = src[:1].expand(3, -1).contiguous(), mask[:1].expand(3, -1).contiguous()
    expected = model(*same, tgt)
    cache = model.init_cache(model.encode(*same), same[1])
    for t in range(3):
        model.decode_step(tgt[:, t : t + 1], cache)
    order = torch.tensor([1, 2, 0])
    cache.reorder(order)
    steps = [model.decode_step(tgt[order, t : t + 1], cache) for t in range(3, 6)]
    torch.testing.assert_close(torch.stack(steps, dim=1), expected[order, 3:], **CLOSE)


def test_decoding_past_max_positions_is_refused() -> None:
    model = tiny_model()
    src, mask = source_batch()
    with pytest.raises(ValueError, match="max_positions"):
        model(src, mask, target_batch(length=33))


# Tied embeddings.


def embedding_weights(model: Seq2SeqTransformer) -> tuple[Tensor, Tensor, Tensor]:
    return (
        model.encoder.embedding.tokens.weight,
        model.decoder.embedding.tokens.weight,
        model.decoder.output.weight,
    )


@pytest.mark.parametrize(
    ("share_all", "share_decoder", "expected_distinct"),
    [(True, True, 1), (False, True, 2), (True, False, 2), (False, False, 3)],
)
def test_tied_embeddings_are_one_parameter(share_all: bool, share_decoder: bool, expected_distinct: int) -> None:
    model = tiny_model(share_all_embeddings=share_all, share_decoder_embeddings=share_decoder)
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
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1)
    with pytest.raises(ValueError, match="one vocabulary"):
        build_model(cfg, 20, 21)


def test_separate_vocabularies_have_their_own_sizes() -> None:
    cfg = ModelConfig(d_model=16, n_heads=2, d_ff=32, encoder_layers=1, decoder_layers=1, share_all_embeddings=False)
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
