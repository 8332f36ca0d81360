"""The encoder's long attention (`model.transformer.attention: local_global | linformer`): the rule of who attends
to whom, the blocked path against the dense mask, padding invariance, bad settings, and the CLI end to end.

The model-level proofs every variant gets (cache == forward, padding, causality) run these kinds too: see the
`local_global` and `linformer` entries of VARIANTS in test_model.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, decodes_and_evaluates, model_config, tiny_overrides
from test_model import CLOSE, source_batch, target_batch, tiny_model
from torch import Tensor

from seq2seq.cli import main
from seq2seq.errors import ConfigError
from seq2seq.model.long_attention import DENSE_UP_TO, LinformerAttention, LocalGlobalAttention, random_links
from seq2seq.model.positions import RelativePositions
from seq2seq.text.vocab import EOS, PAD

pytestmark = pytest.mark.usefixtures("one_thread")


def qkv(length: int, batch: int = 3, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, 2, length, 8, generator=g) for _ in range(3))  # type: ignore[return-value]


def real_positions(lengths: list[int], length: int) -> Tensor:
    return torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]  # (B, S) True at real positions


@pytest.mark.parametrize("relative", [False, True])
@pytest.mark.parametrize(("window", "global_tokens", "links"), [(1, 0, 0), (3, 2, 2), (5, 3, 4), (20, 4, 3)])
def test_the_blocked_path_equals_the_dense_mask(window: int, global_tokens: int, links: int, relative: bool) -> None:
    """Long inputs are computed in chunks; the result is the dense mask's, padding, global tokens, links and
    Shaw et al.'s relative positions (clipped at 3) and all, and so are the gradients (no NaN from padding rows)."""
    q, k, v = qkv(70)
    real = real_positions([70, 50, 23], 70)
    attention = LocalGlobalAttention(window, global_tokens, links)
    torch.manual_seed(0)
    positions = RelativePositions(8, 3) if relative else None
    inputs = [x.requires_grad_(True) for x in (q, k, v)]
    if positions is not None:
        inputs += list(positions.parameters())
    dense = attention.dense(q, k, v, real, 0.0, positions)
    dense_grads = torch.autograd.grad(dense[real[:, None, :, None].expand_as(dense)].sum(), inputs)
    blocked = attention.blocked(q, k, v, real, 0.0, positions)
    blocked_grads = torch.autograd.grad(blocked[real[:, None, :, None].expand_as(blocked)].sum(), inputs)
    torch.testing.assert_close(blocked, dense, **CLOSE)
    for got, expected in zip(blocked_grads, dense_grads):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, **CLOSE)


def test_a_window_wider_than_the_input_is_full_attention() -> None:
    q, k, v = qkv(40)
    real = real_positions([40, 31, 9], 40)
    full = F.scaled_dot_product_attention(q, k, v, attn_mask=real[:, None, None, :])
    wide = LocalGlobalAttention(40, 0, 0)
    rows = real[:, None, :, None].expand_as(full)  # padding queries see themselves too (never nothing)
    for path in (wide.dense, wide.blocked):
        torch.testing.assert_close(path(q, k, v, real, 0.0)[rows], full[rows], **CLOSE)
    with torch.no_grad():  # a whole model: the same weights (local_global has none of its own), the same logits
        src, mask = source_batch()
        expected = tiny_model()(src, mask, target_batch())
        windowed = tiny_model(attention="local_global", window=7)
        torch.testing.assert_close(windowed(src, mask, target_batch()), expected, **CLOSE)
        narrow = tiny_model(attention="local_global", window=1)
        assert not torch.allclose(narrow(src, mask, target_batch()), expected, atol=1e-3)


def test_the_mask_holds_the_window_the_global_tokens_and_nothing_else() -> None:
    real = real_positions([12, 8], 12)
    allowed = LocalGlobalAttention(1, 2, 0).mask(real)[:, 0]  # (B, S, S)
    i, j = torch.arange(12)[:, None], torch.arange(12)[None, :]
    expected = (((i - j).abs() <= 1) | (i < 2) | (j < 2)) & real[:, None, :]
    assert torch.equal(allowed, expected | (i == j))  # padding queries also see themselves, never nothing
    assert allowed[0, 0].all() and allowed[0, :, 0].all() and allowed[0, :, 1].all()  # global: to and from all
    assert allowed[0, 6].nonzero().flatten().tolist() == [0, 1, 5, 6, 7]
    assert not allowed[1, 0, 8:].any()  # never to padding


def test_global_tokens_see_and_are_seen_by_everything_and_the_rest_only_their_window() -> None:
    """Output-level: changing the value at position 9 changes the global queries and 9's neighbours only;
    changing a global position's value changes every query."""
    q, k, v = qkv(12, batch=1)
    real = torch.ones(1, 12, dtype=torch.bool)
    attention = LocalGlobalAttention(1, 2, 0)
    before = attention.dense(q, k, v, real, 0.0)
    for position, touched in ((9, {0, 1, 8, 9, 10}), (1, set(range(12)))):
        changed = v.clone()
        changed[:, :, position] += 1.0
        after = attention.dense(q, k, changed, real, 0.0)
        differs = (after - before).abs().amax(dim=(0, 1, 3)) > 1e-6
        assert set(differs.nonzero().flatten().tolist()) == touched


def test_random_links_are_fixed_real_and_independent_of_the_padding() -> None:
    links = random_links(torch.tensor([30, 7]), 30, 4)  # (B, S, R)
    assert torch.equal(links, random_links(torch.tensor([30, 7]), 30, 4))
    assert (links[0] < 30).all() and (links[1] < 7).all() and (links >= 0).all()
    alone = random_links(torch.tensor([7]), 7, 4)
    assert torch.equal(links[1, :7], alone[0])
    assert len(set(links[0].flatten().tolist())) > 15  # spread over the sentence


@pytest.mark.parametrize(
    "settings",
    [
        {"attention": "local_global", "window": 16, "global_tokens": 2, "random_links": 2},
        {"attention": "local_global", "window": 8, "global_tokens": 1, "positions": "relative"},
        {"attention": "linformer", "linformer_length": 16},
    ],
)
@torch.no_grad()
def test_a_long_sentence_alone_equals_it_in_a_padded_batch(settings: dict[str, object]) -> None:
    """Beyond DENSE_UP_TO: local_global's blocked path (padded) against its dense one (alone, shorter)."""
    length, padded = DENSE_UP_TO - 20, DENSE_UP_TO + 60
    model = tiny_model(max_positions=padded, **settings)
    g = torch.Generator().manual_seed(4)
    src = torch.randint(EOS + 1, 23, (2, padded), generator=g)
    src[0, length:] = PAD
    mask = src == PAD
    batch = model.encode(src, mask)
    alone = model.encode(src[:1, :length], mask[:1, :length])
    torch.testing.assert_close(batch[0, :length], alone[0], **CLOSE)
    assert torch.isfinite(batch).all()


def test_linformer_refuses_an_input_longer_than_its_projection() -> None:
    q, k, v = qkv(10)
    with pytest.raises(ConfigError, match="an input of 10 positions is longer than the 8 its projection was built"):
        LinformerAttention(8, 4)(q, k, v, torch.ones(3, 10, dtype=torch.bool), 0.0)


@pytest.mark.parametrize(
    ("settings", "error"),
    [
        ({"attention": "local_global", "window": 0}, "model.transformer.window"),
        ({"attention": "linformer", "linformer_length": 600}, "linformer_length (600) must not exceed model.max_pos"),
        ({"attention": "sparse"}, "model.transformer.attention"),
        ({"attention": "linformer", "positions": "relative"}, "linformer does not go with model.transformer.posit"),
        ({"attention": "linformer", "positions": "rope"}, "linformer does not go with model.transformer.positions"),
        ({"attention": "local_global", "positions": "t5_bias"}, "local_global does not go with model.transformer"),
        ({"window": 32}, "model.transformer.window applies to model.transformer.attention: local_global only"),
        ({"attention": "linformer", "global_tokens": 2}, "global_tokens applies to model.transformer.attention: loc"),
        ({"attention": "local_global", "linformer_length": 32}, "linformer_length applies to model.transformer.att"),
    ],
)
def test_bad_settings_are_refused_in_one_line(settings: dict[str, object], error: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(error)) as raised:
        model_config(max_positions=512, **settings)
    assert "\n" not in str(raised.value)


@pytest.mark.trains
@pytest.mark.parametrize(
    "settings",
    [
        ("model.transformer.attention=local_global", "model.transformer.window=2", "model.transformer.global_tokens=1"),
        ("model.transformer.attention=linformer", "model.transformer.linformer_length=16"),
    ],
)
def test_long_attention_trains_translates_evaluates_and_does_not_export(
    settings: tuple[str, ...], corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    common = ("model.d_model=32", "train.max_epochs=2", "train.threads=1", "validation.bleu=false")
    overrides = tiny_overrides(corpus, run, *settings, *common, "validation.best_metric=loss")
    assert main(["train", "--config", str(TINY), *overrides]) == 0
    best = str(run / "checkpoint_best.pt")
    decodes_and_evaluates(best, tmp_path, capsys, nbest=2, strategies=("greedy",))
    kind = settings[0].split("=")[1]
    for export in (["--format", "hf"], ["--format", "ctranslate2"]):
        assert main(["export", best, *export, "-o", str(tmp_path / "exported")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"model.transformer.attention={kind} does not export" in err, err
        assert not (tmp_path / "exported").exists()
