"""Translating a stream: records read from a file or stdin, translated in chunks, written as text or JSONL lines.

Input is read as bytes and split on newlines only, like the corpus reader, so
one input line is always one output line. Every line before an unreadable one
is translated and written before the error. A line longer than 1 MiB is read
past, not translated: a warning names FILE:LINE and its output line is empty
(as an empty input line's), so the output stays aligned with the input.
"""

from __future__ import annotations

import json
import logging
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, Literal, TypeVar

from seq2seq.app.files import refuse_output_that_is_read
from seq2seq.app.model import ModelOptions, engine_of, open_translator
from seq2seq.app.progress import progress_bar
from seq2seq.errors import UsageError, UserError
from seq2seq.text.corpus import TOO_LONG_LINE, LongLine, decode_lines, read_lines
from seq2seq.text.inputs import Record

if TYPE_CHECKING:
    from seq2seq.decoding.alignment import AttentionMap, LayerChoice
    from seq2seq.decoding.translate import TextTranslator, TranslateProgress, Translation

T = TypeVar("T")

log = logging.getLogger("seq2seq")

CHUNK_LINES = 2000  # lines read before translating: enough to sort into full batches


@dataclass(frozen=True)
class TranslateOptions:
    """What to read, what to write and how.

    input/output: files (None: stdin/stdout); format: text (one translation per line) or jsonl
    (n-best, scores, token log-probabilities); input_format: text or jsonl ({"text", "prefix"} per line);
    prefix_file: one target prefix per input line; interactive: translate each line as it arrives;
    attention_dir: a picture of each line's cross-attention goes there; attention_layer: a decoder layer
    from 1, last or all; attention_heads: mean or each; alignment: JSONL lines gain the alignments;
    tgt_lang: the target language of every line without its own ("tgt_lang" in JSONL), for a model of several.
    """

    input: str | None = None
    output: str | None = None
    format: Literal["text", "jsonl"] = "text"
    input_format: Literal["text", "jsonl"] = "text"
    prefix_file: str | None = None
    interactive: bool = False
    attention_dir: str | None = None
    attention_layer: str = "last"
    attention_heads: Literal["mean", "each"] = "mean"
    alignment: bool = False
    tgt_lang: str = ""

    @property
    def inspects(self) -> bool:
        """Whether the attention is needed (pictures or alignments): a re-scoring pass, the PyTorch engine."""
        return bool(self.attention_dir or self.alignment)


def translate_stream(model: ModelOptions, options: TranslateOptions) -> None:
    """Stream the input through the model into the output: in chunks of CHUNK_LINES (sorted into batches),
    or line by line when interactive or reading a terminal."""
    check_options(options)
    source = open(options.input, "rb") if options.input else stdin()
    try:
        refuse_output_that_is_read(options.output, source, options.input or "stdin", model.paths)
        records = read_records(source, options)
        translator = open_for(model, options)
        if hasattr(sys.stdout, "reconfigure"):  # text is UTF-8 whatever the locale says
            sys.stdout.reconfigure(encoding="utf-8")
        from_terminal = not options.input and source.isatty()
        if from_terminal:
            log.info("translating each line typed on stdin; end with Ctrl-D")
        size = 1 if options.interactive or from_terminal else CHUNK_LINES
        bar = None if from_terminal or options.interactive else progress_bar(options.input)
        try:
            _write(translate_records(translator, records, options, size, None if bar is None else bar.update), options)
        finally:
            if bar is not None:
                bar.close()
    finally:
        if options.input:
            source.close()


def _write(chunks: Iterable[list[str]], options: TranslateOptions) -> None:
    """Each chunk's lines, flushed as soon as they are translated."""
    sink: IO[str] = open(options.output, "w", encoding="utf-8") if options.output else sys.stdout
    try:
        for lines in chunks:
            sink.write("".join(line + "\n" for line in lines))
            sink.flush()
    finally:
        if options.output:
            sink.close()


def check_options(options: TranslateOptions) -> LayerChoice:
    """Options that do not go together, a missing matplotlib, a bad layer: refused before anything runs."""
    from seq2seq.decoding.alignment import parse_layer

    if options.alignment and options.format != "jsonl":
        raise UsageError("--alignment needs --format jsonl (the alignments are fields of each JSON line)")
    if options.prefix_file and options.input_format == "jsonl":
        raise UsageError('give prefixes in the JSONL input ("prefix") or with --prefix-file, not both')
    if options.attention_dir:
        from seq2seq.decoding.pictures import require_matplotlib

        require_matplotlib()
        if Path(options.attention_dir).exists() and not Path(options.attention_dir).is_dir():
            raise UsageError(f"--attention-dir {options.attention_dir} is a file; give a directory for the pictures")
    return parse_layer(options.attention_layer)


def open_for(model: ModelOptions, options: TranslateOptions) -> TextTranslator:
    """The translator these options need: token scores for JSONL, the PyTorch engine and a model
    that has the attention layer for pictures and alignments."""
    from dataclasses import replace

    if options.inspects and engine_of(model) == "ctranslate2":
        raise UsageError("--attention-dir and --alignment need the PyTorch engine (a checkpoint file)")
    translator = open_translator(replace(model, token_scores=options.format == "jsonl"))
    if options.inspects:
        from seq2seq.decoding.alignment import parse_layer, require_attention
        from seq2seq.decoding.translate import Translator

        assert isinstance(translator, Translator)
        require_attention(translator.model, parse_layer(options.attention_layer))
    return translator


def read_records(source: BinaryIO, options: TranslateOptions) -> Iterator[Record]:
    """The input as records: plain lines, JSONL records, or lines with their --prefix-file line."""
    from seq2seq.text import inputs

    name = options.input or "stdin"
    lines = (_text(line) for line in decode_lines(source, name, skip_long=True))
    if options.input_format == "jsonl":
        return inputs.jsonl(lines, name)
    if not options.prefix_file:
        return inputs.plain(lines)
    prefixes = read_lines(options.prefix_file)
    if options.input and Path(options.input).is_file():  # a file can be checked before anything is translated
        count = inputs.count_lines(options.input)
        if count != len(prefixes):
            raise inputs.misaligned(options.prefix_file, len(prefixes), name, str(count))
    return inputs.with_prefixes(lines, prefixes, options.prefix_file, name)


def _text(line: str | LongLine) -> str:
    """A line's text; "" (an empty output line, as an empty input line's) for one too long to read."""
    if isinstance(line, LongLine):
        log.warning("%s: %s; not translated, its output line is empty", line.where, TOO_LONG_LINE)
        return ""
    return line


def stdin() -> BinaryIO:
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise UserError("no input: stdin is closed; give --input FILE")
    return sys.stdin.buffer


def translate_records(
    translator: TextTranslator,
    records: Iterable[Record],
    options: TranslateOptions,
    size: int = CHUNK_LINES,
    progress: TranslateProgress | None = None,
) -> Iterator[list[str]]:
    """The output lines of each chunk of `size` records, chunk by chunk (pictures drawn on the way).

    `progress` is told how many more records are done after each batch.
    """
    from seq2seq.decoding.alignment import parse_layer

    layer, done = parse_layer(options.attention_layer), 0
    for chunk in chunks(records, size):
        yield translate_chunk(translator, chunk, done + 1, options, layer, progress)
        done += len(chunk)


def translate_chunk(
    translator: TextTranslator,
    chunk: list[Record],
    first: int,
    options: TranslateOptions,
    layer: LayerChoice,
    progress: TranslateProgress | None = None,
) -> list[str]:
    """Translate, draw and align one chunk of records (lines first..); its output lines."""
    prefixes = [r.prefix for r in chunk] if any(r.prefix for r in chunk) else None
    langs = [r.tgt_lang or options.tgt_lang for r in chunk]
    results = translator.translate_full(
        [r.text for r in chunk], first_line=first, prefixes=prefixes, progress=progress, tgt_langs=langs
    )
    maps: list[AttentionMap | None] = [None] * len(results)
    if options.inspects:
        from seq2seq.decoding.translate import Translator

        assert isinstance(translator, Translator)  # open_for refused the other engines
        maps = translator.attention(results, layer, options.attention_heads)
    if options.attention_dir:
        from seq2seq.decoding.pictures import draw, picture_path

        Path(options.attention_dir).mkdir(parents=True, exist_ok=True)
        for number, amap in enumerate(maps, start=first):
            if amap is not None:
                draw(amap, picture_path(Path(options.attention_dir), number))
    return [format_line(result, options.format, options.alignment, amap) for result, amap in zip(results, maps)]


def chunks(lines: Iterable[T], size: int) -> Iterator[list[T]]:
    """Lines in groups of `size`, yielded as soon as each group is complete.

    When reading fails midway, the lines read before the failure are yielded first.
    """
    chunk: list[T] = []
    try:
        for line in lines:
            chunk.append(line)
            if len(chunk) >= size:
                yield chunk
                chunk = []
    except (UserError, OSError):
        if chunk:
            yield chunk
        raise
    if chunk:
        yield chunk


def format_line(result: Translation, fmt: str, alignment: bool = False, amap: AttentionMap | None = None) -> str:
    """One output line: the text, or a JSON object (with `alignment`, the alignments of `amap`;
    empty ones for an empty line)."""
    if fmt == "text":
        return result.text
    line: dict[str, object] = {
        "source": result.source,
        **({"prefix": result.prefix} if result.prefix else {}),
        "translation": result.text,
        "score": result.hypotheses[0].score if result.hypotheses else None,
        "nbest": [
            {
                "translation": text,
                "score": h.score,
                "tokens": h.tokens,
                "pieces": pieces,
                "token_logprobs": h.token_scores,
            }
            for text, pieces, h in zip(result.texts, result.pieces, result.hypotheses)
        ],
    }
    if alignment:
        line.update(alignment_fields(amap))
    return json.dumps(line, ensure_ascii=False)


def alignment_fields(amap: AttentionMap | None) -> dict[str, object]:
    """The best hypothesis' alignments: per target subword (EOS included) the index of a source subword,
    and the word alignment in Pharaoh 'i-j' form."""
    from seq2seq.decoding.alignment import pharaoh, subword_alignment, word_alignment

    if amap is None:
        return {"source_pieces": [], "alignment": [], "word_alignment": ""}
    return {
        "source_pieces": amap.source,
        "alignment": subword_alignment(amap),
        "word_alignment": pharaoh(word_alignment(amap)),
    }
