"""What the framework may delete: only directories and temporaries it wrote itself, recognised before removal.

A directory the framework fills (prepared data, an export) is replaced only when
it is missing, empty, or holds the framework's own marker file and nothing but
names the framework writes there; anything else is refused in one line, so a
mistyped path never costs the user a file. Temporaries are built beside their
target as `{name}.tmp{pid}` holding a marker file, and only such directories,
whose process is gone, are ever removed as abandoned.

The new content is built in the temporary's `new/`; the swap moves the target
into the temporary's `old/` and then `new/` into its place, two renames, so a
kill at any moment leaves a whole directory: the target, or (between the two
renames) the finished `new/`, which the next `remove_abandoned` puts in place.
The marker is removed last, so a temporary is never left unmarked.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from seq2seq.errors import UserError

TEMPORARY_MARKER = ".seq2seq-temporary"  # written first into every temporary directory the framework builds
NEW, OLD = "new", "old"  # in a temporary: the replacement being built; the directory it replaced


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
    """Put `built` (the `new/` of a temporary from `make_temporary`, finished) in place of `directory`, which
    `check_replaceable` has just accepted (call it right before: a user may have put a file there while the
    replacement was built). The old directory goes into the temporary, removed with it."""
    if directory.exists():
        directory.rename(built.parent / OLD)
    built.rename(directory)


def make_temporary(target: Path) -> Path:
    """A new directory to build the replacement of `target` in: `new/` of a temporary beside it, marked as the
    framework's, after removing abandoned ones."""
    remove_abandoned(target)
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    (tmp / TEMPORARY_MARKER).write_bytes(b"")
    (tmp / NEW).mkdir()
    return tmp / NEW


def remove_temporary(built: Path) -> None:
    """Remove the temporary of `built` (from `make_temporary`; if still there), checking its marker first."""
    _remove_marked(built.parent)


def remove_abandoned(target: Path) -> list[Path]:
    """Remove the marked temporaries of `target` whose process is gone (killed midway), and empty ones (killed
    before the marker); one killed between the two renames of `replace_directory` finishes its swap first.
    Returns the temporaries removed."""
    removed = []
    for tmp in target.parent.glob(f"{glob_escape(target.name)}.tmp*"):
        pid = tmp.name.rpartition(".tmp")[2]
        if not (pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid)))):
            continue
        if not tmp.is_dir() or tmp.is_symlink():
            continue
        if not any(tmp.iterdir()):
            tmp.rmdir()
        elif (tmp / TEMPORARY_MARKER).exists():
            if (tmp / OLD).is_dir() and (tmp / NEW).is_dir() and not os.path.lexists(target):
                (tmp / NEW).rename(target)  # the old one was moved aside only once the new one was finished
            _remove_marked(tmp)
        else:
            continue
        removed.append(tmp)
    return removed


def _remove_marked(tmp: Path) -> None:
    """Remove a marked temporary directory, its marker last: one killed midway is still recognised."""
    if not tmp.is_dir() or tmp.is_symlink() or not (tmp / TEMPORARY_MARKER).exists():
        return
    for path in tmp.iterdir():
        if path.name == TEMPORARY_MARKER:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    if [path.name for path in tmp.iterdir()] == [TEMPORARY_MARKER]:  # else something could not be removed
        (tmp / TEMPORARY_MARKER).unlink()
        tmp.rmdir()


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
