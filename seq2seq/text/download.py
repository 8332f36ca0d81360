"""Fetch Multi30k (task 1) from its public repository, or copy it from a local mirror.

A mirror is a directory laid out like the repository's `data/task1/raw/`
(`train.de.gz`, ...), optionally with a `tok/` folder of the tokenized
lower-cased references. It is given with `--mirror` or `SEQ2SEQ_DATA_MIRROR`.
"""

from __future__ import annotations

import gzip
import logging
import os
import shutil
import tempfile
import urllib.error
import urllib.request
import zlib
from pathlib import Path

from seq2seq.errors import DownloadError

log = logging.getLogger(__name__)

BASE_URL = "https://github.com/multi30k/dataset/raw/master/data/task1"
MIRROR_ENV = "SEQ2SEQ_DATA_MIRROR"
LINES = {"train": 29_000, "val": 1_014, "test_2016_flickr": 1_000}
LANGUAGES = ("en", "de", "fr", "cs")
TOKENIZED_SPLITS = ("val", "test_2016_flickr")


def tokenized_reference(directory: str | Path, split: str, lang: str) -> Path:
    """Where the dataset's lower-cased Moses-tokenized reference of a split lives (it may not exist)."""
    return Path(directory) / "tok" / f"{split}.lc.norm.tok.{lang}"


def download_multi30k(dest: str | Path, langs: tuple[str, ...], mirror: str | Path | None = None) -> list[Path]:
    """Fetch train/val/test_2016_flickr for `langs` into `dest`, check line counts, return the paths."""
    mirror = mirror or os.environ.get(MIRROR_ENV) or None
    if mirror is not None and not Path(mirror).is_dir():
        log.warning("mirror %s does not exist; downloading from %s instead", mirror, BASE_URL)
        mirror = None
    for lang in langs:
        if lang not in LANGUAGES:
            raise DownloadError(f"Multi30k has no language {lang!r} (choose from {', '.join(LANGUAGES)})")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    fetched = []
    for split, expected in LINES.items():
        for lang in langs:
            name = f"{split}.{lang}.gz"
            path = dest / name
            if not _complete(path, expected):
                _fetch(f"raw/{name}", path, mirror)
            _check_lines(path, expected)
            fetched.append(path)
    for split in TOKENIZED_SPLITS:
        for lang in langs:
            path = tokenized_reference(dest, split, lang)
            name = path.relative_to(dest).as_posix()
            if not path.is_file():
                try:
                    _fetch(name, path, mirror)
                except DownloadError as e:  # optional: only the tokenized-BLEU comparison needs them
                    log.warning("skipped %s: %s", name, e)
                    continue
            _check_lines(path, LINES[split])
            fetched.append(path)
    return fetched


def _fetch(relative: str, path: Path, mirror: str | Path | None) -> None:
    """Copy from the mirror, or download, to a temporary name; rename when complete."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out:
            if mirror is not None:
                source = _mirror_file(Path(mirror), relative)
                with open(source, "rb") as f:
                    shutil.copyfileobj(f, out)
            else:
                url = f"{BASE_URL}/{relative}"
                log.info("downloading %s", url)
                try:
                    with urllib.request.urlopen(url, timeout=60) as response:
                        shutil.copyfileobj(response, out)
                except (urllib.error.URLError, TimeoutError, OSError) as e:
                    raise DownloadError(
                        f"cannot download {url} ({getattr(e, 'reason', e)}); offline? "
                        f"point --mirror or {MIRROR_ENV} at a local copy"
                    ) from None
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def _mirror_file(mirror: Path, relative: str) -> Path:
    """The mirror may be laid out like `data/task1` (raw/, tok/) or hold the raw files at its top."""
    for candidate in (mirror / relative, mirror / relative.removeprefix("raw/")):
        if candidate.is_file():
            return candidate
    if not mirror.is_dir():
        raise DownloadError(f"mirror directory not found: {mirror}")
    raise DownloadError(f"{mirror} has no {relative.removeprefix('raw/')}")


def _complete(path: Path, expected: int) -> bool:
    """Whether an earlier download can be reused; a damaged one is fetched again."""
    try:
        return path.is_file() and _count_lines(path) == expected
    except DownloadError:
        return False


def _count_lines(path: Path) -> int:
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            return sum(1 for _ in f)
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a corrupt deflate stream
        raise DownloadError(f"{path}: cannot read ({e}); delete it and run the download again") from None


def _check_lines(path: Path, expected: int) -> None:
    found = _count_lines(path)
    if found != expected:
        raise DownloadError(f"{path} has {found} lines, expected {expected}: incomplete or wrong file")
