"""Attention pictures: the cross-attention of a translation as a heat map with its subwords as labels.

One PNG per translation: a grid of panels, one row per layer shown and one
column per head shown (a single panel for one layer with its heads averaged),
target subwords down the side, source subwords along the bottom. The figure's
size follows the sentence lengths, so the pixel size of a picture is known
before drawing (`picture_size`). Drawing uses matplotlib's object API without
pyplot, so no global figure state or GUI backend is involved.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from seq2seq.decoding.alignment import AttentionMap, LayerChoice
from seq2seq.errors import UserError

if TYPE_CHECKING:
    from seq2seq.decoding.translate import Translation, Translator

DPI = 100
CELL = 0.3  # inches per subword, unless the figure would grow past MAX_INCHES
MAX_INCHES = 60.0
CHAR = 0.085  # inches per character of a label, roughly, at the labels' font size
LABEL_FONT = 9


def require_matplotlib() -> None:
    """One line saying how to install matplotlib, when it is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise UserError("attention pictures need matplotlib: pip install 'seq2seq[recipes]'")


def picture_size(amap: AttentionMap) -> tuple[int, int]:
    """(width, height) in pixels of the picture `draw` makes of `amap`."""
    width, height = _figure_inches(amap)
    return round(width * DPI), round(height * DPI)


def _cell(amap: AttentionMap) -> float:
    rows, cols, T, S = amap.weights.shape
    return min(CELL, MAX_INCHES / max(cols * S, rows * T))


def _figure_inches(amap: AttentionMap) -> tuple[float, float]:
    """Panels of `_cell` inches per subword, plus room for the labels and the titles."""
    rows, cols, T, S = amap.weights.shape
    cell = _cell(amap)
    side = CHAR * max(len(p) for p in amap.target) + 0.6
    bottom = CHAR * max(len(p) for p in amap.source) + 0.5
    width = side + cols * (cell * S + 0.35) + 0.3
    height = bottom + rows * (cell * T + 0.45) + 0.3
    return round(max(width, 2.5), 2), round(max(height, 2.0), 2)


def draw(amap: AttentionMap, path: str | Path) -> Path:
    """Write the picture of `amap` to `path` (PNG) and return the path."""
    require_matplotlib()
    from matplotlib.figure import Figure

    rows, cols, T, S = amap.weights.shape
    figure = Figure(figsize=_figure_inches(amap), dpi=DPI, layout="constrained")
    axes = figure.subplots(rows, cols, squeeze=False)
    for r in range(rows):
        for c in range(cols):
            ax = axes[r][c]
            ax.imshow(amap.weights[r, c].numpy(), cmap="Blues", vmin=0.0, aspect="equal", interpolation="nearest")
            ax.set_title(f"{amap.layers[r]}, {amap.heads[c]}", fontsize=LABEL_FONT)
            ax.set_xticks(range(S), amap.source if r == rows - 1 else [""] * S, rotation=90, fontsize=LABEL_FONT)
            ax.set_yticks(range(T), amap.target if c == 0 else [""] * T, fontsize=LABEL_FONT)
            ax.tick_params(length=0)
    path = Path(path)
    figure.savefig(path, format="png", dpi=DPI)
    return path


def save_pictures(
    translator: Translator,
    translations: Sequence[Translation],
    directory: str | Path,
    layer: LayerChoice = "last",
    heads: str = "mean",
    first_line: int = 1,
) -> list[Path | None]:
    """One picture per translation, `directory`/NNNNNN.png numbered by input line from `first_line`
    (None, and no file, for an empty line)."""
    require_matplotlib()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    maps = translator.attention(translations, layer, heads)
    return [draw(m, picture_path(directory, first_line + i)) if m else None for i, m in enumerate(maps)]


def picture_path(directory: Path, line: int) -> Path:
    return directory / f"{line:06d}.png"
