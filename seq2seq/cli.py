"""The `seq2seq` command: download, prepare, train, pretrain, translate, evaluate, average, export, serve, recipe...

Each subcommand turns its arguments into options and calls one function of
the application layer (seq2seq.app) or the library. Known problems (bad
config, bad data, unusable checkpoint) end with one line on stderr: exit code
2 for configuration errors, 1 for the rest. Ctrl-C ends any
subcommand with one line and exit code 130; training stopped by SIGINT/SIGTERM
saves first, then exits 130/143 so that nothing takes it for done.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeVar

from seq2seq import interrupt, recipe_args
from seq2seq.app.logs import setup_logging
from seq2seq.config import config_yaml, load_config, reference_table, write_reference
from seq2seq.errors import ConfigError, UsageError, UserError
from seq2seq.serve import options as serve_options

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

    from seq2seq.app.model import ModelOptions

Options = TypeVar("Options", bound="DataclassInstance")

log = logging.getLogger("seq2seq")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    setup_logging(args.verbose)
    try:
        return args.run(args)
    except ConfigError as e:  # a config key, or (UsageError) a command-line flag
        label = "usage error" if isinstance(e, UsageError) else "config error"
        print(f"seq2seq: {label}: {e}", file=sys.stderr)
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

    p = sub.add_parser(
        "pretrain",
        help="pretrain the encoder of a config by masked language modelling (BERT), for train.init_encoder_from",
    )
    p.add_argument("--config", required=True, help="YAML experiment file (pretrain.* and the train.* of this run)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(run=_pretrain)

    p = sub.add_parser("prepare", help="prepare the training data of a config (train does it when needed)")
    p.add_argument("--config", required=True, help="YAML experiment file")
    p.add_argument("--workers", type=int, default=0, help="encoding processes (default: one per CPU)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.set_defaults(run=_prepare)

    p = sub.add_parser("config", help="print a config as it resolves: YAML with every default filled in")
    p.add_argument("--config", help="YAML experiment file (default: the defaults alone)")
    p.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    p.add_argument(
        "--reference",
        nargs="?",
        const="-",
        metavar="FILE",
        help="print the reference of every setting (a Markdown table) instead, or with FILE (docs/guide.md) "
        "write it between the markers there",
    )
    p.set_defaults(run=_config)

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
    p.add_argument(
        "--tgt-lang",
        default="",
        help="target language of every line, for a model of several (JSONL input: a line's tgt_lang wins)",
    )
    _add_inspect_args(p)
    p.set_defaults(run=_translate)

    p = sub.add_parser("evaluate", help="score a checkpoint or a hypothesis file with sacreBLEU")
    _add_model_args(p, required=False)
    p.add_argument("--hypotheses", help="score this file of translations instead of decoding")
    p.add_argument("--src", help="source file (default: the config's test split)")
    p.add_argument("--ref", help="reference file (default: the config's test split)")
    p.add_argument(
        "--tgt-lang",
        default="",
        help="target language, for a model of several pairs: one pair at a time "
        "(default test split: the pair of data.pairs into it, when only one is)",
    )
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
    p.add_argument(
        "--format",
        choices=["text", "json"],
        default="text",
        help="text: a line per score; json: one object with every score, for programs (default: text)",
    )
    p.set_defaults(run=_evaluate)

    p = sub.add_parser("average", help="average the weights of checkpoints")
    p.add_argument("checkpoints", nargs="*", help="checkpoints to average")
    p.add_argument("--run-dir", help="average the last --last step checkpoints of this run")
    p.add_argument("--last", type=int, default=5, help="how many step checkpoints (default: 5)")
    p.add_argument("--output", "-o", required=True, help="averaged checkpoint to write")
    p.set_defaults(run=_average)

    p = sub.add_parser("export", help="export a checkpoint to an inference engine (CTranslate2) or Hugging Face")
    p.add_argument("checkpoint", help="checkpoint file (e.g. RUN/checkpoint_best.pt)")
    p.add_argument(
        "--format",
        choices=["ctranslate2", "hf"],
        default="ctranslate2",
        help="ctranslate2 (default), or hf: a Marian directory for transformers' MarianMTModel and MarianTokenizer",
    )
    p.add_argument("--output", "-o", required=True, help="model directory to create")
    p.add_argument("--quantization", default="float32", help="weights: float32 (default), int8, int8_float32, ...")
    p.set_defaults(run=_export)

    p = sub.add_parser("import-hf", help="a Hugging Face Marian (OPUS-MT) model directory as a checkpoint")
    p.add_argument("directory", help="the model directory (config.json, weights, source.spm, target.spm, vocab.json)")
    p.add_argument(
        "--output", "-o", required=True, help="checkpoint to write (e.g. RUN/checkpoint.pt); its config goes beside it"
    )
    p.set_defaults(run=_import_hf)

    p = sub.add_parser(
        "serve", help="an HTTP translation service for a checkpoint, with dynamic batching and an attention explorer"
    )
    _add_model_args(p, required=False)
    serve_options.add_arguments(p)
    p.set_defaults(run=_serve)

    p = sub.add_parser(
        "recipe", help="a whole recipe: train, average, pick on val, test, distill; a rerun skips finished steps"
    )
    recipe_args.add_arguments(p)
    p.set_defaults(run=_recipe)
    return parser


def _add_inspect_args(p: argparse.ArgumentParser) -> None:
    """translate's options for prefixes, attention pictures and alignments."""
    g = p.add_argument_group("prefixes")
    g.add_argument(
        "--input-format",
        choices=["text", "jsonl"],
        default="text",
        help='text: one sentence per line; jsonl: {"text": ..., "prefix": ..., "tgt_lang": ...} per line',
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
        "several -c decode checkpoints as an ensemble (serve --compare: side by side)",
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


# Subcommands.


def _download(args: argparse.Namespace) -> int:
    from seq2seq.text.download import download_multi30k

    paths = download_multi30k(args.dest, tuple(lang.strip() for lang in args.langs.split(",")), args.mirror)
    log.info("%d files ready in %s", len(paths), args.dest)
    return 0


def _train(args: argparse.Namespace) -> int:
    from seq2seq.app.runs import train

    return train(load_config(args.config, args.overrides))


def _pretrain(args: argparse.Namespace) -> int:
    from seq2seq.app.runs import train

    return train(load_config(args.config, args.overrides), pretrain=True)


def _prepare(args: argparse.Namespace) -> int:
    from seq2seq.app.runs import prepare_data

    prepare_data(load_config(args.config, args.overrides), args.workers)
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.reference == "-":
        print(reference_table(), end="")
    elif args.reference is not None:
        print(f"{args.reference}: {'updated' if write_reference(args.reference) else 'already up to date'}")
    else:
        print(config_yaml(load_config(args.config, args.overrides)), end="")
    return 0


def _model_options(args: argparse.Namespace) -> ModelOptions:
    from seq2seq.app.model import ModelOptions

    return ModelOptions(tuple(args.checkpoint or ()), args.engine, args.device, args.threads, tuple(args.overrides))


def _from_args(cls: type[Options], args: argparse.Namespace) -> Options:
    """An options dataclass (the app's, the server's) from the parsed arguments of the same names."""
    return cls(**{field.name: getattr(args, field.name) for field in dataclasses.fields(cls)})


def _translate(args: argparse.Namespace) -> int:
    from seq2seq.app.streams import TranslateOptions, translate_stream

    translate_stream(_model_options(args), _from_args(TranslateOptions, args))
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from seq2seq.app.evaluation import EvaluateOptions, evaluate

    evaluation = evaluate(_from_args(EvaluateOptions, args), _model_options(args) if args.checkpoint else None)
    if args.format == "json":
        print(json.dumps(evaluation.record(), ensure_ascii=False))
        return 0
    for line in evaluation.lines():
        print(line)
    return 0


def _average(args: argparse.Namespace) -> int:
    from seq2seq.app.runs import average

    paths = average(args.output, args.checkpoints, args.run_dir, args.last)
    log.info("averaged %d checkpoints (%s) into %s", len(paths), ", ".join(p.name for p in paths), args.output)
    return 0


def _export(args: argparse.Namespace) -> int:
    if args.format == "hf":
        from seq2seq.hf.files import export_marian

        if args.quantization != "float32":
            raise UsageError("--quantization applies to --format ctranslate2 only")
        log.info("exported %s to %s (Marian)", args.checkpoint, export_marian(args.checkpoint, args.output))
        return 0
    from seq2seq.deploy.export import export_ctranslate2

    output = export_ctranslate2(args.checkpoint, args.output, args.quantization)
    log.info("exported %s to %s (CTranslate2, %s)", args.checkpoint, output, args.quantization)
    return 0


def _import_hf(args: argparse.Namespace) -> int:
    from seq2seq.hf.files import import_to_file

    stored = import_to_file(args.directory, args.output)
    t = stored.config.model.transformer
    assert t is not None
    log.info(
        "imported %s into %s (%d+%d layers, d_model %d, %d and %d ids); its config: %s",
        args.directory,
        args.output,
        t.encoder_layers,
        t.decoder_layers,
        stored.config.model.d_model,
        stored.tokenizer.src_vocab_size,
        stored.tokenizer.tgt_vocab_size,
        args.output.rsplit(".", 1)[0] + ".yaml" if "." in args.output else args.output + ".yaml",
    )
    return 0


def _serve(args: argparse.Namespace) -> int:
    """The model loads once the port is bound, so that a busy port fails before a long load."""
    options = _from_args(serve_options.ServeOptions, args)
    serve_options.require_extra()
    from seq2seq.serve.engine import open_engine
    from seq2seq.serve.server import serve

    shared = _model_options(args)  # engine, device, threads and overrides; each model its own paths
    models = {
        name: dataclasses.replace(shared, paths=paths)
        for name, paths in serve_options.served_models(args.checkpoint or [], args.model, args.compare)
    }
    return serve(lambda: {name: open_engine(model) for name, model in models.items()}, options)


def _recipe(args: argparse.Namespace) -> int:
    from seq2seq.app.recipe import StepFailed, markdown, run_recipe

    try:
        results = run_recipe(recipe_args.options(args))
    except StepFailed as e:  # the subcommand said why on stderr; its exit code is the recipe's
        print(f"seq2seq: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        return interrupt.report(e, "; run the same command to go on from where it stopped")
    print(markdown(results), end="")
    return 0
