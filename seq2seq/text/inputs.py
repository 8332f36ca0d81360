"""What `seq2seq translate` reads: plain lines, JSONL records (a target prefix, a target language), or lines
with a prefix file.

Every input line is one record and gives one output line, whatever its form.
A record that cannot be read, or a prefix file whose lines do not match the
input's, stops with one line naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from seq2seq.errors import DataError
from seq2seq.text.corpus import lone_surrogate

FIELDS = ("text", "prefix", "tgt_lang")


@dataclass(frozen=True)
class Record:
    text: str
    prefix: str = ""  # "": translate freely
    tgt_lang: str = ""  # the target language, for a model of several ("": the command's --tgt-lang)


def plain(lines: Iterable[str]) -> Iterator[Record]:
    return (Record(line) for line in lines)


def jsonl(lines: Iterable[str], name: str) -> Iterator[Record]:
    """Records from lines like {"text": "...", "prefix": "...", "tgt_lang": "en"} ("prefix" and "tgt_lang"
    optional; a blank line is an empty text)."""
    for number, line in enumerate(lines, start=1):
        yield parse_record(line, f"{name}:{number}")


def parse_record(line: str, where: str) -> Record:
    if not line.strip():
        return Record("")
    try:
        raw = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        raise DataError(
            f'{where}: not JSON; each line must be an object like {{"text": "...", "prefix": "..."}}'
        ) from None
    except ValueError as e:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise DataError(f"{where}: a number too long to read ({str(e).partition(';')[0]})") from None
    if not isinstance(raw, dict):
        raise DataError(f'{where}: each line must be a JSON object with a "text" string')
    for key in raw:
        if key not in FIELDS:
            raise DataError(f"{where}: unknown field {key!r} (fields: {', '.join(FIELDS)})")
    text, prefix, lang = raw.get("text"), raw.get("prefix", ""), raw.get("tgt_lang", "")
    for field, value in (("text", text), ("prefix", prefix), ("tgt_lang", lang)):
        if not isinstance(value, str):
            raise DataError(f'{where}: "{field}" must be a string')
        if "\n" in value or "\r" in value:
            raise DataError(f'{where}: "{field}" contains a line break; one sentence per line')
        if lone_surrogate(value) is not None:
            raise DataError(f'{where}: "{field}" holds invalid UTF-8 (a lone surrogate escape)')
    assert isinstance(text, str) and isinstance(prefix, str) and isinstance(lang, str)
    return Record(text, prefix, lang.strip())


def with_prefixes(lines: Iterable[str], prefixes: Sequence[str], prefix_file: str, name: str) -> Iterator[Record]:
    """Each line with the prefix of the same line number; a prefix file of another length is refused
    (lines read before the mismatch shows are yielded first, as for any unreadable input)."""
    count = 0
    for count, line in enumerate(lines, start=1):
        if count > len(prefixes):
            raise misaligned(prefix_file, len(prefixes), name, "more")
        yield Record(line, prefixes[count - 1])
    if count != len(prefixes):
        raise misaligned(prefix_file, len(prefixes), name, str(count))


def misaligned(prefix_file: str, prefixes: int, name: str, lines: str) -> DataError:
    return DataError(f"misaligned --prefix-file: {prefix_file} has {prefixes} lines but {name} has {lines}")


def count_lines(path: str | Path) -> int:
    """Lines as the input reader splits them (on newline bytes only), read in blocks: a file
    without newlines is never held in memory whole."""
    lines, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            lines += block.count(b"\n")
            last = block[-1:]
    return lines + (last != b"\n")
