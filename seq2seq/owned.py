"""What the framework may delete: only directories and temporaries it wrote itself, recognised before removal.

A directory the framework fills (prepared data, an export) is replaced only when
it is missing, empty, or holds the framework's own marker file and nothing but
names the framework writes there; anything else is refused in one line, so a
mistyped path never costs the user a file. Temporaries are built beside their
target as `{name}.tmp{pid}` holding a marker file, and only such directories,
whose process is gone, are ever removed as abandoned.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from seq2seq.errors import UserError

TEMPORARY_MARKER = ".seq2seq-temporary"  # written first into every temporary directory the framework builds


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def is_regular_file(path: Path) -> bool:
    """A plain file, not a symbolic link (to anything), a directory or a device."""
    return path.is_file() and not path.is_symlink()


def check_replaceable(directory: Path, marker: str, ours: re.Pattern[str], what: str, error: type[UserError]) -> None:
    """Refuse, in one line, to replace `directory` unless it is missing, empty, or holds `marker` and only
    regular files whose names match `ours`. `what` names the setting or option that chose the directory."""
    if directory.is_symlink():
        raise error(f"{what} {directory} is a symbolic link; give the directory it points to")
    if not directory.exists():
        return
    if not directory.is_dir():
        raise error(f"{what} {directory} is not a directory; choose another path")
    entries = sorted(directory.iterdir())
    if not entries:
        return
    foreign = [p.name for p in entries if not (ours.fullmatch(p.name) and is_regular_file(p))]
    if marker not in {p.name for p in entries} or foreign:
        names = foreign or [p.name for p in entries]
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise error(
            f"{what} {directory} holds files seq2seq did not write there ({shown}); seq2seq never deletes them: "
            "choose another directory, or empty it yourself"
        )


def replace_directory(directory: Path, built: Path) -> None:
    """Put the finished temporary `built` in place of `directory`, which `check_replaceable` has just accepted
    (call it right before: a user may have put a file there while the replacement was built)."""
    if directory.exists():
        for path in directory.iterdir():
            path.unlink()
        directory.rmdir()
    (built / TEMPORARY_MARKER).unlink()
    built.rename(directory)


def make_temporary(target: Path) -> Path:
    """A new temporary directory beside `target`, marked as the framework's, after removing abandoned ones."""
    remove_abandoned(target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    (tmp / TEMPORARY_MARKER).write_bytes(b"")
    return tmp


def remove_temporary(tmp: Path) -> None:
    """Remove a temporary directory this process made (if still there), checking its marker first."""
    if tmp.is_dir() and not tmp.is_symlink() and (tmp / TEMPORARY_MARKER).exists():
        shutil.rmtree(tmp, ignore_errors=True)


def remove_abandoned(target: Path) -> list[Path]:
    """Remove the marked temporaries of `target` whose process is gone (killed midway); returns them."""
    removed = []
    for tmp in target.parent.glob(f"{glob_escape(target.name)}.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            if tmp.is_dir() and not tmp.is_symlink() and (tmp / TEMPORARY_MARKER).exists():
                shutil.rmtree(tmp, ignore_errors=True)
                removed.append(tmp)
    return removed


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
