"""Multi30k download from a local mirror: files are copied, counted, and problems named. No network."""

from __future__ import annotations

import gzip
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from seq2seq.cli import main
from seq2seq.errors import DownloadError
from seq2seq.text import download
from seq2seq.text.download import download_multi30k

SMALL = {"train": 5, "val": 3, "test_2016_flickr": 2}


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """Small expected line counts, no ambient mirror, and a network that always fails (tests must not download)."""
    monkeypatch.setattr(download, "LINES", dict(SMALL))
    monkeypatch.delenv(download.MIRROR_ENV, raising=False)

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise urllib.error.URLError("network disabled in tests")

    monkeypatch.setattr(urllib.request, "urlopen", no_network)


def make_mirror(root: Path, langs: tuple[str, ...] = ("de", "en"), raw: str = "", tok: bool = True) -> Path:
    """A mirror with `n` numbered lines per file; `raw="raw"` lays it out like the repository's data/task1."""
    for split, n in SMALL.items():
        for lang in langs:
            path = root / raw / f"{split}.{lang}.gz"
            path.parent.mkdir(parents=True, exist_ok=True)
            with gzip.open(path, "wt", encoding="utf-8") as f:
                f.write("".join(f"{split} {lang} {i}\n" for i in range(n)))
    if tok:
        (root / "tok").mkdir(parents=True, exist_ok=True)
        for split in download.TOKENIZED_SPLITS:
            for lang in langs:
                (root / "tok" / f"{split}.lc.norm.tok.{lang}").write_text("x\n" * SMALL[split], encoding="utf-8")
    return root


def gz_lines(path: Path) -> list[str]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read().splitlines()


@pytest.mark.parametrize("layout", ["", "raw"], ids=["flat", "task1-layout"])
def test_copies_every_file_from_the_mirror(tmp_path: Path, layout: str) -> None:
    mirror = make_mirror(tmp_path / "mirror", raw=layout)
    dest = tmp_path / "data"
    paths = download_multi30k(dest, ("de", "en"), mirror)
    raw_files = {f"{split}.{lang}.gz" for split in SMALL for lang in ("de", "en")}
    tok_files = {f"{split}.lc.norm.tok.{lang}" for split in download.TOKENIZED_SPLITS for lang in ("de", "en")}
    assert {p.name for p in paths} == raw_files | tok_files
    assert all(p.is_file() for p in paths)
    assert gz_lines(dest / "val.de.gz") == ["val de 0", "val de 1", "val de 2"]
    assert not list(dest.rglob("*.part"))  # no temporary files left behind


def test_wrong_line_count_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mirror = make_mirror(tmp_path / "mirror")
    monkeypatch.setitem(download.LINES, "val", 4)  # the mirror's val files have 3 lines
    with pytest.raises(DownloadError) as info:
        download_multi30k(tmp_path / "data", ("de", "en"), mirror)
    message = str(info.value)
    assert "val.de.gz" in message and "has 3 lines, expected 4" in message


def test_missing_file_in_the_mirror_is_a_clear_error(tmp_path: Path) -> None:
    mirror = make_mirror(tmp_path / "mirror")
    (mirror / "test_2016_flickr.en.gz").unlink()
    with pytest.raises(DownloadError, match=r"mirror has no test_2016_flickr\.en\.gz"):
        download_multi30k(tmp_path / "data", ("de", "en"), mirror)
    assert not (tmp_path / "data" / "test_2016_flickr.en.gz").exists()


def test_missing_tokenized_references_are_optional(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    mirror = make_mirror(tmp_path / "mirror", tok=False)
    paths = download_multi30k(tmp_path / "data", ("de", "en"), mirror)
    assert len(paths) == len(SMALL) * 2
    assert "skipped tok/val.lc.norm.tok.de" in caplog.text


def test_unknown_language(tmp_path: Path) -> None:
    with pytest.raises(DownloadError, match="no language 'xx'"):
        download_multi30k(tmp_path / "data", ("de", "xx"), make_mirror(tmp_path / "mirror"))


def test_complete_files_are_reused_and_damaged_ones_fetched_again(tmp_path: Path) -> None:
    mirror = make_mirror(tmp_path / "mirror")
    dest = tmp_path / "data"
    download_multi30k(dest, ("de", "en"), mirror)
    (mirror / "train.de.gz").unlink()  # not needed any more: the copy in dest is complete
    (dest / "val.en.gz").write_bytes(b"not gzip at all")  # e.g. an interrupted copy by another tool
    download_multi30k(dest, ("de", "en"), mirror)
    assert gz_lines(dest / "val.en.gz")[0] == "val en 0"


def test_mirror_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(download.MIRROR_ENV, str(make_mirror(tmp_path / "mirror")))
    assert download_multi30k(tmp_path / "data", ("en", "de"))


def test_offline_without_a_mirror_says_what_to_do(tmp_path: Path) -> None:
    """A mirror that does not exist falls back to downloading (documented); offline, that fails in one clear line."""
    with pytest.raises(DownloadError, match="offline\\? point --mirror or SEQ2SEQ_DATA_MIRROR"):
        download_multi30k(tmp_path / "data", ("de", "en"), tmp_path / "no-such-mirror")


def test_cli_download(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    mirror = make_mirror(tmp_path / "mirror", langs=("fr", "en"))
    dest = tmp_path / "data"
    assert main(["download", "--langs", "fr,en", "--dest", str(dest), "--mirror", str(mirror)]) == 0
    assert (dest / "train.fr.gz").is_file()
    (mirror / "train.fr.gz").unlink()
    (dest / "train.fr.gz").unlink()
    assert main(["download", "--langs", "fr,en", "--dest", str(dest), "--mirror", str(mirror)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("seq2seq: error:") and "train.fr.gz" in err[-1]
