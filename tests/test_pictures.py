"""Attention pictures: readable PNGs of the size the layout promises, one per non-empty input line, for the
Transformer, an RNN with attention and an ensemble; one line for what cannot be drawn.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest
import torch

from seq2seq.cli import main
from seq2seq.config import RNNConfig
from seq2seq.decoding.alignment import AttentionMap
from seq2seq.decoding.ensemble import Ensemble
from seq2seq.decoding.pictures import draw, picture_size, save_pictures
from seq2seq.decoding.translate import Translator
from seq2seq.model import build_model
from seq2seq.runs import checkpoint as ckpt

pytest.importorskip("matplotlib", reason="attention pictures need matplotlib: pip install -e '.[recipes]'")
from matplotlib.image import imread  # noqa: E402  (after the skip)

pytestmark = pytest.mark.usefixtures("one_thread")


def read_png(path: Path) -> Any:
    """The image as an (height, width, RGBA) array; fails unless the file is a PNG."""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return imread(path)


def diagonal_map(n: int, layers: int = 1, heads: int = 1) -> AttentionMap:
    source = [f"▁src{i}" for i in range(n)] + ["</s>"]
    target = [f"▁tgt{i}" for i in range(n)] + ["</s>"]
    weights = torch.eye(n + 1).expand(layers, heads, n + 1, n + 1).clone()
    return AttentionMap(source, target, weights, [f"layer {i + 1}" for i in range(layers)], ["mean of 4 heads"] * heads)


def test_a_picture_is_a_png_of_the_promised_size(tmp_path: Path) -> None:
    amap = diagonal_map(6)
    image = read_png(draw(amap, tmp_path / "a.png"))
    width, height = picture_size(amap)
    assert image.shape == (height, width, 4)
    gray = image[:, :, :3].mean(axis=2)
    assert gray.min() < 0.2 and gray.max() > 0.9  # dark cells on a light background


def test_pictures_grow_with_the_sentence_and_the_grid(tmp_path: Path) -> None:
    sizes = {
        name: picture_size(amap)
        for name, amap in {"short": diagonal_map(3), "long": diagonal_map(20), "grid": diagonal_map(3, 3, 4)}.items()
    }
    assert sizes["long"][0] > sizes["short"][0] and sizes["long"][1] > sizes["short"][1]
    assert sizes["grid"][0] > 3 * sizes["short"][0] * 0.8 and sizes["grid"][1] > 2 * sizes["short"][1]
    grid = diagonal_map(3, 3, 4)
    assert read_png(draw(grid, tmp_path / "grid.png")).shape[:2] == sizes["grid"][::-1]


@pytest.fixture(scope="module")
def checkpoint(trained_run: Path) -> Path:
    return trained_run / "checkpoint_best.pt"


def untrained(checkpoint: Path, path: Path, layers: dict[str, Any] | None = None, **model: Any) -> Path:
    """A checkpoint of another (untrained) model with the trained one's tokenizer and settings."""
    stored = ckpt.read(checkpoint)
    if layers is not None:  # changes to the stored model.transformer
        model["transformer"] = dataclasses.replace(stored.config.model.transformer, **layers)
    config = dataclasses.replace(stored.config, model=dataclasses.replace(stored.config.model, **model))
    torch.manual_seed(0)
    weights = build_model(config.model, stored.tokenizer.src_vocab_size, stored.tokenizer.tgt_vocab_size)
    ckpt.save(path, ckpt.Checkpoint(config, stored.tokenizer, weights.state_dict()))
    return path


def test_save_pictures_draws_each_non_empty_line(checkpoint: Path, tmp_path: Path) -> None:
    translator = Translator.from_checkpoint(checkpoint)
    translations = translator.translate_full(["red cat dog", "", "sun moon"])
    paths = save_pictures(translator, translations, tmp_path / "pictures", "all", "each", first_line=7)
    assert paths == [tmp_path / "pictures" / "000007.png", None, tmp_path / "pictures" / "000009.png"]
    assert sorted(p.name for p in (tmp_path / "pictures").iterdir()) == ["000007.png", "000009.png"]
    maps = translator.attention(translations, "all", "each")
    for path, amap in zip(paths, maps):
        if path is not None and amap is not None:
            width, height = picture_size(amap)
            assert read_png(path).shape == (height, width, 4)
            assert amap.weights.shape[:2] == (2, 4)  # the tiny model: 2 decoder layers of 4 heads


def translate(checkpoint: Path | list[Path], tmp_path: Path, *options: str) -> int:
    checkpoints = checkpoint if isinstance(checkpoint, list) else [checkpoint]
    (tmp_path / "in.txt").write_text("red cat dog\n\nsun moon tree\n", encoding="utf-8")
    argv = ["translate", *(f"-c{c}" for c in checkpoints), "--threads", "1", "-i", str(tmp_path / "in.txt")]
    return main([*argv, "-o", str(tmp_path / "out.txt"), *options])


def test_cli_draws_one_picture_per_line_and_translates_as_before(checkpoint: Path, tmp_path: Path) -> None:
    assert translate(checkpoint, tmp_path) == 0
    before = (tmp_path / "out.txt").read_text(encoding="utf-8")
    assert translate(checkpoint, tmp_path, "--attention-dir", str(tmp_path / "att")) == 0
    translator = Translator.from_checkpoint(checkpoint)
    expected = "".join(line + "\n" for line in translator.translate(["red cat dog", "", "sun moon tree"]))
    assert (tmp_path / "out.txt").read_text(encoding="utf-8") == before == expected  # whatever the model learnt
    assert sorted(p.name for p in (tmp_path / "att").iterdir()) == ["000001.png", "000003.png"]
    single = read_png(tmp_path / "att" / "000001.png").shape
    options = ["--attention-dir", str(tmp_path / "grid"), "--attention-layer", "all", "--attention-heads", "each"]
    assert translate(checkpoint, tmp_path, *options) == 0
    grid = read_png(tmp_path / "grid" / "000001.png").shape
    translations = translator.translate_full(["red cat dog"])
    for shape, (layer, heads) in ((single, ("last", "mean")), (grid, ("all", "each"))):
        amap = translator.attention(translations, layer, heads)[0]
        assert amap is not None and shape == (picture_size(amap)[1], picture_size(amap)[0], 4)
    assert grid[0] > 1.5 * single[0] and grid[1] > 2 * single[1]  # 2 layers x 4 heads


def test_cli_draws_an_rnns_alignment_and_an_ensembles_mean(checkpoint: Path, tmp_path: Path) -> None:
    rnn = untrained(
        checkpoint, tmp_path / "rnn.pt", arch="rnn", transformer=None, rnn=RNNConfig(attention="mlp", hidden_size=32)
    )
    assert translate(rnn, tmp_path, "--attention-dir", str(tmp_path / "rnn")) == 0
    assert read_png(tmp_path / "rnn" / "000003.png").ndim == 3
    deeper = untrained(checkpoint, tmp_path / "deeper.pt", layers={"decoder_layers": 3})
    assert translate([checkpoint, deeper], tmp_path, "--attention-dir", str(tmp_path / "ensemble")) == 0
    assert sorted(p.name for p in (tmp_path / "ensemble").iterdir()) == ["000001.png", "000003.png"]


def test_an_ensemble_of_a_model_with_itself_attends_as_the_model(checkpoint: Path) -> None:
    single = Translator.from_checkpoint(checkpoint)
    pair = Translator(Ensemble([single.model, single.model]), single.tokenizer, single.decode)
    translations = single.translate_full(["red cat dog", "sun moon"])
    for a, b in zip(single.attention(translations, "all", "each"), pair.attention(translations, "all", "each")):
        assert a is not None and b is not None
        torch.testing.assert_close(a.weights, b.weights)
        assert (a.source, a.target, a.layers, a.heads) == (b.source, b.target, b.layers, b.heads)


def test_what_cannot_be_drawn_is_one_line_before_any_output(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    none = untrained(
        checkpoint, tmp_path / "none.pt", arch="rnn", transformer=None, rnn=RNNConfig(attention="none", hidden_size=32)
    )
    deeper = untrained(checkpoint, tmp_path / "deeper.pt", layers={"decoder_layers": 3})
    cases = [
        ([none], [], 1, "this model has no attention (model.rnn.attention: none)"),
        ([checkpoint, deeper], ["--attention-layer", "all"], 1, "the ensemble's members show different numbers"),
        ([checkpoint], ["--attention-layer", "5"], 1, "attention layer 5 does not exist: the model has 2"),
        ([checkpoint], ["--attention-dir", str(tmp_path / "in.txt")], 2, "in.txt is a file; give a directory"),
    ]
    for checkpoints, options, code, message in cases:
        assert translate(checkpoints, tmp_path, "--attention-dir", str(tmp_path / "att"), *options) == code
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "att").exists() or not any((tmp_path / "att").iterdir())
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a)
    )
    assert translate(checkpoint, tmp_path, "--attention-dir", str(tmp_path / "att")) == 1
    assert capsys.readouterr().err.splitlines() == [
        "seq2seq: error: attention pictures need matplotlib: pip install 'seq2seq[recipes]'"
    ]
