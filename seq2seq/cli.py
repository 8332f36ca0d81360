"""The `seq2seq` command: download, train, translate, evaluate, average, serve.

Each subcommand parses its arguments and calls one library function. Known
problems (bad config, bad data, unusable checkpoint) end with one line on
stderr: exit code 2 for configuration errors, 1 for the rest. Ctrl-C ends any
subcommand with one line and exit code 130; training stopped by SIGINT/SIGTERM
saves first, then exits 130/143 so that nothing takes it for done.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, TypeVar

from seq2seq import interrupt
from seq2seq.config import MAX_THREADS, apply_overrides, load_config
from seq2seq.data import decode_lines, read_lines
from seq2seq.errors import ConfigError, DataError, UserError
from seq2seq.inputs import Record
from seq2seq.serve import options as serve_options

if TYPE_CHECKING:
    from tqdm import tqdm

    from seq2seq.alignment import AttentionMap, LayerChoice
    from seq2seq.config import DataConfig
    from seq2seq.translate import TextTranslator, Translation

T = TypeVar("T")

log = logging.getLogger("seq2seq")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    _setup_logging(args.verbose)
    try:
        return args.run(args)
    except ConfigError as e:
        print(f"seq2seq: config error: {e}", file=sys.stderr)
        return 2
    except UserError as e:
        print(f"seq2seq: error: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `seq2seq translate ... | head`
        return 0
    except OSError as e:  # e.g. an --input file that does not exist: the system's message says it all
        print(f"seq2seq: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:  # Ctrl-C while loading a model, translating, scoring...
        return interrupt.report(e)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="seq2seq", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("download", help="fetch Multi30k task 1 (or copy it from a local mirror)")
    p.add_argument("--langs", default="de,en", help="comma-separated languages (default: de,en)")
    p.add_argument("--dest", default="data/multi30k", help="target directory (default: data/multi30k)")
    p.add_argument("--mirror", help="local directory with the raw files (or set SEQ2SEQ_DATA_MIRROR)")
    p.set_defaults(run=_download)

    p = sub.add_parser("train", help="train (or resume) the experiment a config describes")
    p.add_argument("--config", required=True, help="YAML experiment file")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(run=_train)

    p = sub.add_parser("prepare", help="prepare the training data of a config (train does it when needed)")
    p.add_argument("--config", required=True, help="YAML experiment file")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (default: one per CPU)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(run=_prepare)

    p = sub.add_parser("translate", help="translate a file or stdin with a checkpoint")
    _add_model_args(p)
    p.add_argument("--input", "-i", help="input file (default: stdin)")
    p.add_argument("--output", "-o", help="output file (default: stdout)")
    p.add_argument(
        "--format",
        choices=["text", "jsonl"],
        default="text",
        help="text: one translation per line; jsonl: n-best, scores, token log-probabilities",
    )
    p.add_argument(
        "--interactive",
        action="store_true",
        help="translate each stdin line as it arrives (the default when stdin is a terminal)",
    )
    _add_inspect_args(p)
    p.set_defaults(run=_translate)

    p = sub.add_parser("evaluate", help="score a checkpoint or a hypothesis file with sacreBLEU")
    _add_model_args(p, required=False)
    p.add_argument("--hypotheses", help="score this file of translations instead of decoding")
    p.add_argument("--src", help="source file (default: the config's test split)")
    p.add_argument("--ref", help="reference file (default: the config's test split)")
    p.add_argument("--lowercase", action="store_true", help="also report lower-cased BLEU")
    p.add_argument(
        "--tok-ref",
        help="tokenized lower-cased reference (Multi30k lc.norm.tok) for tokenized BLEU "
        "(default: the test split's under data.dir/tok/, when it exists and --ref is not given)",
    )
    p.add_argument(
        "--bootstrap",
        type=int,
        default=1,
        metavar="N",
        help="BLEU's 95%% interval from N resampled test sets (sacreBLEU's, seeded; 1000 is usual)",
    )
    p.add_argument("--save", help="write the translations here")
    p.set_defaults(run=_evaluate)

    p = sub.add_parser("average", help="average the weights of checkpoints")
    p.add_argument("checkpoints", nargs="*", help="checkpoints to average")
    p.add_argument("--run-dir", help="average the last --last step checkpoints of this run")
    p.add_argument("--last", type=int, default=5, help="how many step checkpoints (default: 5)")
    p.add_argument("--output", "-o", required=True, help="averaged checkpoint to write")
    p.set_defaults(run=_average)

    p = sub.add_parser("export", help="export a checkpoint to an inference engine (CTranslate2)")
    p.add_argument("checkpoint", help="checkpoint file (e.g. RUN/checkpoint_best.pt)")
    p.add_argument("--format", choices=["ctranslate2"], default="ctranslate2", help="target engine")
    p.add_argument("--output", "-o", required=True, help="model directory to create")
    p.add_argument("--quantization", default="float32", help="weights: float32 (default), int8, int8_float32, ...")
    p.set_defaults(run=_export)

    p = sub.add_parser("serve", help="an HTTP translation service for a checkpoint, with dynamic batching")
    _add_model_args(p)
    serve_options.add_arguments(p)
    p.set_defaults(run=_serve)
    return parser


def _add_inspect_args(p: argparse.ArgumentParser) -> None:
    """translate's options for prefixes, attention pictures and alignments."""
    g = p.add_argument_group("prefixes")
    g.add_argument(
        "--input-format",
        choices=["text", "jsonl"],
        default="text",
        help='text: one sentence per line; jsonl: {"text": ..., "prefix": ...} per line',
    )
    g.add_argument("--prefix-file", help="target prefixes, one per input line, each forced at the start of its output")
    g = p.add_argument_group("attention")
    g.add_argument("--attention-dir", help="write a picture of each line's cross-attention here (NNNNNN.png)")
    g.add_argument(
        "--attention-layer",
        default="last",
        help="decoder layer for pictures and alignments: a number from 1, last (default) or all",
    )
    g.add_argument(
        "--attention-heads",
        choices=["mean", "each"],
        default="mean",
        help="pictures: heads averaged (default) or one panel per head; alignments always average",
    )
    g.add_argument(
        "--alignment",
        action="store_true",
        help="jsonl output gains subword and word (i-j) alignments; costs a re-scoring pass",
    )


def _add_model_args(p: argparse.ArgumentParser, required: bool = True) -> None:
    p.add_argument(
        "--checkpoint",
        "-c",
        required=required,
        action="append",
        help="checkpoint file (e.g. RUN/checkpoint_best.pt) or a directory from seq2seq export; "
        "several -c decode checkpoints as an ensemble",
    )
    p.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "torch", "ctranslate2"],
        help="auto (default): CTranslate2 for an exported directory, PyTorch for a checkpoint; "
        "ctranslate2 with a checkpoint exports it (float32) for this run",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument(
        "--threads",
        type=int,
        default=0,
        help="CPU threads for torch (default: torch's choice; 1 is faster on a busy machine)",
    )
    p.add_argument("overrides", nargs="*", metavar="decode.key=value", help="decoding overrides")


def _setup_logging(verbose: bool) -> None:
    for old in [h for h in log.handlers if isinstance(h, _TqdmHandler)]:
        log.removeHandler(old)  # main() may run many times in one process (tests, notebooks)
    handler = _TqdmHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s" if verbose else "%(message)s"))
    handler.setLevel(logging.DEBUG if verbose else logging.INFO)
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)


class _TqdmHandler(logging.Handler):
    """Log lines that do not break progress bars."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        tqdm.write(self.format(record), file=sys.stderr)


# Subcommands.


def _download(args: argparse.Namespace) -> int:
    from seq2seq.download import download_multi30k

    paths = download_multi30k(args.dest, tuple(lang.strip() for lang in args.langs.split(",")), args.mirror)
    log.info("%d files ready in %s", len(paths), args.dest)
    return 0


def _train(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    from seq2seq.training.distributed import peer_failures
    from seq2seq.training.trainer import Trainer

    try:
        with peer_failures():
            trainer = Trainer(cfg)
            trainer.fit()
    except KeyboardInterrupt as e:  # before training started, or a second Ctrl-C
        return interrupt.report(e, "; checkpoint_last.pt (if any) holds the last saved state")
    if trainer.stop.received:
        print(f"seq2seq: stopped by {trainer.stop.received.name}; run the same command to resume", file=sys.stderr)
    return trainer.stop.exit_code


def _prepare(args: argparse.Namespace) -> int:
    """Prepare (or check) the training data; a run with a checkpoint keeps its tokenizer."""
    cfg = load_config(args.config, args.overrides)
    if not 0 <= args.workers <= MAX_THREADS:
        raise ConfigError(f"--workers must be in [0, {MAX_THREADS}], got {args.workers}")
    from seq2seq.prepare import ensure_prepared
    from seq2seq.run_dir import RunDirectory
    from seq2seq.training.setup import prepared_path

    run = RunDirectory(cfg.train.run_dir)
    run.acquire()  # never rebuild the data under a `train` running in this directory
    try:
        resume = run.resume_point()
        ensure_prepared(cfg.data, prepared_path(cfg), resume.tokenizer if resume else None, args.workers)
    finally:
        run.release()
    return 0


def _translator(args: argparse.Namespace, token_scores: bool = True) -> TextTranslator:
    """The model (checkpoint, ensemble or exported directory) with its stored decode settings, changed by the
    command line's decode.* overrides. token_scores: whether each token's log-probability is needed (JSONL)."""
    from seq2seq.checkpoint import load_checkpoint
    from seq2seq.device import resolve_device
    from seq2seq.ensemble import Ensemble, load_ensemble
    from seq2seq.model import Seq2SeqModel
    from seq2seq.translate import Translator

    bad = [o for o in args.overrides if not o.startswith("decode.")]
    if bad:
        raise ConfigError(f"command line: {bad[0]!r}: only decode.* settings can change at translation time")
    if not 0 <= args.threads <= MAX_THREADS:
        raise ConfigError(f"--threads must be in [0, {MAX_THREADS}], got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if _engine(args) == "ctranslate2":
        return _exported_translator(args, token_scores)
    device = resolve_device(args.device, option="--device")
    model: Seq2SeqModel | Ensemble
    if len(args.checkpoint) > 1:
        model, loaded = load_ensemble(args.checkpoint, device)  # decode settings and data: the first's
    else:
        loaded = load_checkpoint(args.checkpoint[0], device)
        model = loaded.model
    config = apply_overrides(loaded.config, args.overrides)  # checked like a config file, with the model's limits
    return Translator(model, loaded.tokenizer, config.decode, device, config.data)


def _engine(args: argparse.Namespace) -> str:
    """torch or ctranslate2, from --engine and what the -c paths are; mixtures refused."""
    from seq2seq.exported import is_exported

    exported = [c for c in args.checkpoint if is_exported(c)]
    if exported and args.engine == "torch":
        raise ConfigError(f"{exported[0]} is a CTranslate2 model directory: it runs with --engine ctranslate2 or auto")
    if not exported and args.engine != "ctranslate2":
        return "torch"
    if len(args.checkpoint) > 1:
        raise ConfigError("CTranslate2 runs one model; an ensemble needs checkpoint files and --engine torch")
    return "ctranslate2"


def _exported_translator(args: argparse.Namespace, token_scores: bool) -> TextTranslator:
    """An exported directory in CTranslate2, or a checkpoint exported (float32) to a temporary one for this run."""
    import tempfile

    import torch

    from seq2seq.exported import CTranslate2Translator, import_ctranslate2, is_exported

    import_ctranslate2()  # its install hint before anything else
    path, threads = args.checkpoint[0], args.threads or torch.get_num_threads()
    if is_exported(path):
        return CTranslate2Translator.from_directory(path, args.device, threads, token_scores, args.overrides)
    from seq2seq.export import export_ctranslate2

    log.info("exporting %s to CTranslate2 (float32) for this run", path)
    with tempfile.TemporaryDirectory(prefix="seq2seq-ct2-") as tmp:  # the engine holds the model in memory
        exported = export_ctranslate2(path, Path(tmp) / "model")
        return CTranslate2Translator.from_directory(exported, args.device, threads, token_scores, args.overrides)


MAX_BOOTSTRAP = 100_000  # evaluate --bootstrap: 1000 is usual; sacreBLEU keeps every resample in memory
CHUNK_LINES = 2000  # lines read before translating: enough to sort into full batches


def _translate(args: argparse.Namespace) -> int:
    """Stream lines through the translator: in chunks of CHUNK_LINES (sorted into batches), or one by one.

    Input is read as bytes and split on newlines only, like the corpus reader, so one input
    line is always one output line. Every line before an unreadable one is translated and
    written before the error.
    """
    layer = _check_inspect_args(args)
    source = open(args.input, "rb") if args.input else _stdin()
    try:
        _refuse_output_that_is_read(args, source)
        records = _records(args, source)
        inspect = args.attention_dir or args.alignment
        if inspect and _engine(args) == "ctranslate2":
            raise ConfigError("--attention-dir and --alignment need the PyTorch engine (a checkpoint file)")
        translator = _translator(args, token_scores=args.format == "jsonl")
        if inspect:
            from seq2seq.alignment import require_attention
            from seq2seq.translate import Translator

            assert isinstance(translator, Translator)
            require_attention(translator.model, layer)
        if hasattr(sys.stdout, "reconfigure"):  # text is UTF-8 whatever the locale says
            sys.stdout.reconfigure(encoding="utf-8")
        from_terminal = not args.input and source.isatty()
        if from_terminal:
            log.info("translating each line typed on stdin; end with Ctrl-D")
        size = 1 if args.interactive or from_terminal else CHUNK_LINES
        sink = open(args.output, "w", encoding="utf-8") if args.output else sys.stdout
        bar = None if from_terminal or args.interactive else _progress_bar(args.input)
        try:
            done = 0
            for chunk in _chunks(records, size):
                _translate_chunk(args, translator, chunk, done + 1, layer, sink, bar)
                done += len(chunk)
        finally:
            if bar is not None:
                bar.close()
            if args.output:
                sink.close()
    finally:
        if args.input:
            source.close()
    return 0


def _progress_bar(path: str | Path | None, total: int | None = None) -> tqdm | None:
    """A bar on stderr (sentences done, sentences/s, and the ETA when the number of lines is known)
    when stderr is a terminal; None otherwise, so that pipes and logs stay clean.

    path: the input file, whose lines are counted when `total` is not given (None: stdin, not counted).
    """
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    if total is None and path is not None:
        from seq2seq.inputs import count_lines

        try:
            total = count_lines(path)
        except OSError:  # counted only for the ETA
            total = None
    return tqdm(total=total, unit="sent", desc="translating", file=sys.stderr, dynamic_ncols=True)


def _translate_chunk(
    args: argparse.Namespace,
    translator: TextTranslator,
    chunk: list[Record],
    first: int,
    layer: LayerChoice,
    sink: IO[str],
    bar: tqdm | None = None,
) -> None:
    """Translate, draw and align one chunk of records (lines first..), and write its output lines."""
    prefixes = [r.prefix for r in chunk] if any(r.prefix for r in chunk) else None
    results = translator.translate_full(
        [r.text for r in chunk], first_line=first, prefixes=prefixes, progress=None if bar is None else bar.update
    )
    maps: list[AttentionMap | None] = [None] * len(results)
    if args.attention_dir or args.alignment:
        from seq2seq.translate import Translator

        assert isinstance(translator, Translator)  # _translate refused the other engines
        maps = translator.attention(results, layer, args.attention_heads)
    if args.attention_dir:
        from seq2seq.pictures import draw, picture_path

        Path(args.attention_dir).mkdir(parents=True, exist_ok=True)
        for number, amap in enumerate(maps, start=first):
            if amap is not None:
                draw(amap, picture_path(Path(args.attention_dir), number))
    for result, amap in zip(results, maps):
        sink.write(_format(result, args.format, args.alignment, amap) + "\n")
    sink.flush()


def _check_inspect_args(args: argparse.Namespace) -> LayerChoice:
    """Options that do not go together, a missing matplotlib, a bad layer: refused before anything runs."""
    from seq2seq.alignment import parse_layer

    if args.alignment and args.format != "jsonl":
        raise ConfigError("--alignment needs --format jsonl (the alignments are fields of each JSON line)")
    if args.prefix_file and args.input_format == "jsonl":
        raise ConfigError('give prefixes in the JSONL input ("prefix") or with --prefix-file, not both')
    if args.attention_dir:
        from seq2seq.pictures import require_matplotlib

        require_matplotlib()
    return parse_layer(args.attention_layer)


def _records(args: argparse.Namespace, source: BinaryIO) -> Iterator[Record]:
    """The input as records: plain lines, JSONL records, or lines with their --prefix-file line."""
    from seq2seq import inputs

    name = args.input or "stdin"
    lines = decode_lines(source, name)
    if args.input_format == "jsonl":
        return inputs.jsonl(lines, name)
    if not args.prefix_file:
        return inputs.plain(lines)
    prefixes = read_lines(args.prefix_file)
    if args.input and Path(args.input).is_file():  # a file can be checked before anything is translated
        count = inputs.count_lines(args.input)
        if count != len(prefixes):
            raise inputs.misaligned(args.prefix_file, len(prefixes), name, str(count))
    return inputs.with_prefixes(lines, prefixes, args.prefix_file, name)


def _stdin() -> BinaryIO:
    if sys.stdin is None:  # started with stdin closed (`<&-`)
        raise UserError("no input: stdin is closed; give --input FILE")
    return sys.stdin.buffer


def _refuse_output_that_is_read(args: argparse.Namespace, source: BinaryIO) -> None:
    """Opening --output empties it, so it must not be a file this command reads: refuse before opening it."""
    if not args.output:
        return
    output = Path(args.output)
    for checkpoint in args.checkpoint or []:
        if _same_file(output, Path(checkpoint)):
            raise UserError(f"--output {args.output} is the checkpoint; writing there would empty it first")
    try:  # the input, whether named by --input or redirected to stdin, under any path or link
        read = os.fstat(source.fileno())
        reads_output = stat.S_ISREG(read.st_mode) and output.exists() and os.path.samestat(read, output.stat())
    except (OSError, ValueError):  # a stdin without a file descriptor (a test's, a notebook's)
        reads_output = False
    if reads_output:
        raise UserError(
            f"--output {args.output} is the input file ({args.input or 'stdin'}); writing there would empty it first"
        )


def _refuse_overwriting(output: Path, option: str, *inputs: str | Path | None) -> None:
    """An output must not be one of the command's own inputs: writing it would destroy what is being read."""
    for given in inputs:
        if given and output.exists() and _same_file(output, Path(given)):
            raise UserError(f"{option} {output} is also an input of this command; choose another file")


def _same_file(a: Path, b: Path) -> bool:
    """The same path once resolved, or the same file under another name (a hard or symbolic link)."""
    if a.resolve() == b.resolve():
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet)
        return False


def _chunks(lines: Iterable[T], size: int) -> Iterator[list[T]]:
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


def _format(result: Translation, fmt: str, alignment: bool = False, amap: AttentionMap | None = None) -> str:
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
        line.update(_alignment_fields(amap))
    return json.dumps(line, ensure_ascii=False)


def _alignment_fields(amap: AttentionMap | None) -> dict[str, object]:
    """The best hypothesis' alignments: per target subword (EOS included) the index of a source subword,
    and the word alignment in Pharaoh 'i-j' form."""
    from seq2seq.alignment import pharaoh, subword_alignment, word_alignment

    if amap is None:
        return {"source_pieces": [], "alignment": [], "word_alignment": ""}
    return {
        "source_pieces": amap.source,
        "alignment": subword_alignment(amap),
        "word_alignment": pharaoh(word_alignment(amap)),
    }


def _evaluate(args: argparse.Namespace) -> int:
    from seq2seq import metrics

    if not args.checkpoint and not args.hypotheses:
        raise ConfigError("evaluate needs --checkpoint or --hypotheses")
    if args.checkpoint and args.hypotheses:
        raise ConfigError("evaluate takes --checkpoint or --hypotheses, not both")
    if args.bootstrap < 1:
        raise ConfigError(f"--bootstrap must be at least 1, got {args.bootstrap}")
    if args.bootstrap > MAX_BOOTSTRAP:  # sacreBLEU draws every resample's indices at once
        raise ConfigError(f"--bootstrap must be at most {MAX_BOOTSTRAP}, got {args.bootstrap}")
    if args.save:
        _refuse_overwriting(
            Path(args.save), "--save", args.hypotheses, args.src, args.ref, args.tok_ref, *(args.checkpoint or [])
        )
    tok_ref: Path | None = Path(args.tok_ref) if args.tok_ref else None
    if args.hypotheses:
        if not args.ref:
            raise ConfigError("evaluate --hypotheses needs --ref")
        hyps, refs = read_lines(args.hypotheses), read_lines(args.ref)
        lang = tok_ref.suffix.lstrip(".") if tok_ref else ""  # e.g. test_2016_flickr.lc.norm.tok.en
    else:
        translator = _translator(args, token_scores=False)
        assert translator.data is not None  # loaded from a checkpoint
        src, refs = _test_set(translator.data, args.src, args.ref)
        lang = translator.data.tgt_lang
        if tok_ref is None and args.ref is None:
            tok_ref = _default_tok_ref(translator.data)
        bar = _progress_bar(None, total=len(src))
        try:
            hyps = translator.translate(src, progress=None if bar is None else bar.update)
        finally:
            if bar is not None:
                bar.close()
    if len(hyps) != len(refs):
        raise DataError(f"{len(hyps)} hypotheses but {len(refs)} references")
    if args.save:
        Path(args.save).write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    tok_refs = read_lines(tok_ref) if tok_ref else None
    report = metrics.report(hyps, refs, args.bootstrap, args.lowercase, tok_refs, lang)
    for score in report.scores():
        print(score)
    return 0


def _test_set(data: DataConfig, src: str | None, ref: str | None) -> tuple[list[str], list[str]]:
    from seq2seq.data import find_file

    src_path = src or find_file(data.dir, data.test, data.src_lang)
    ref_path = ref or find_file(data.dir, data.test, data.tgt_lang)
    return read_lines(src_path), read_lines(ref_path)


def _default_tok_ref(data: DataConfig) -> Path | None:
    """The test split's tokenized reference, when the dataset has one and sacremoses can use it."""
    import importlib.util

    from seq2seq.download import tokenized_reference

    path = tokenized_reference(data.dir, data.test, data.tgt_lang)
    if not path.is_file():
        return None
    if importlib.util.find_spec("sacremoses") is None:
        log.info("no tokenized BLEU against %s: it needs sacremoses (pip install 'seq2seq[recipes]')", path)
        return None
    return path


def _average(args: argparse.Namespace) -> int:
    from seq2seq.checkpoint import average_checkpoints
    from seq2seq.run_dir import RunDirectory

    if args.last < 1:
        raise ConfigError("average --last must be at least 1")
    paths = [Path(p) for p in args.checkpoints]
    if args.run_dir:
        if not Path(args.run_dir).is_dir():
            raise UserError(f"run directory not found: {args.run_dir}")
        paths += RunDirectory(args.run_dir).latest(args.last)
    if not paths:
        raise UserError("nothing to average: give checkpoints, or --run-dir with checkpoint_step*.pt files")
    _refuse_overwriting(Path(args.output), "--output", *paths)
    average_checkpoints(paths, args.output)
    log.info("averaged %d checkpoints (%s) into %s", len(paths), ", ".join(p.name for p in paths), args.output)
    return 0


def _export(args: argparse.Namespace) -> int:
    from seq2seq.export import export_ctranslate2

    output = export_ctranslate2(args.checkpoint, args.output, args.quantization)
    log.info("exported %s to %s (CTranslate2, %s)", args.checkpoint, output, args.quantization)
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The model loads once the port is bound, so that a busy port fails before a long load."""
    options = serve_options.ServeOptions.from_args(args)
    serve_options.require_extra()
    from seq2seq.serve.engine import TranslatorEngine
    from seq2seq.serve.server import serve

    return serve(lambda: TranslatorEngine(_translator(args)), options)
