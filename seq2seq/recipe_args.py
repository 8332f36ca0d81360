"""The command line of `seq2seq recipe` (and of scripts/run_recipe.py, which takes the same): its arguments,
their types, and the `RecipeOptions` they make. Standard library alone until the options are built."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from seq2seq.app.recipe import RecipeOptions

CHUNK_LINES = 1000  # seq2seq.app.distill.CHUNK_LINES, without importing torch to build a parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML experiment file")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")
    parser.add_argument(
        "--average",
        type=average_sizes,
        metavar="K[,K...]",
        help="sizes of last-k averages (default: checkpoint.average_last)",
    )
    parser.add_argument("--no-download", action="store_true", help="use the corpus already in data.dir")
    parser.add_argument(
        "--seeds", type=seed_list, metavar="S[,S...]", help="one model per seed, in RUN/seedS; test the ensemble"
    )
    parser.add_argument(
        "--distill",
        nargs="?",
        const="",
        metavar="STUDENT_CONFIG",
        help="train a student on the teacher's translations of the training source (default config: the recipe's)",
    )
    parser.add_argument("--distill-mix", action="store_true", help="the student trains on the original pairs too")
    parser.add_argument(
        "--distill-chunk",
        type=positive,
        default=CHUNK_LINES,
        metavar="LINES",
        help=f"lines of training source a saved chunk of the teacher's translation (default {CHUNK_LINES})",
    )
    parser.add_argument(
        "--student",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of the student (repeatable), on top of its config",
    )
    parser.add_argument(
        "--teacher",
        metavar="CONFIG",
        help="the recipe's system is this config's model instead of its own (trained in that config's run "
        "directory unless it finished there, picked on this recipe's val, tested and distilled on its pair; "
        "a model of several pairs translates into the recipe's target language)",
    )
    parser.add_argument(
        "--teacher-set",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="a setting of the --teacher model (repeatable), on top of its config",
    )


def options(args: argparse.Namespace) -> RecipeOptions:
    """The recipe's options from the parsed arguments (checked when the recipe starts)."""
    from seq2seq.app.recipe import RecipeOptions

    return RecipeOptions(
        config=args.config,
        overrides=tuple(args.overrides),
        average=args.average,
        no_download=args.no_download,
        seeds=args.seeds,
        distill=args.distill,
        distill_mix=args.distill_mix,
        distill_chunk=args.distill_chunk,
        student=tuple(args.student),
        teacher=args.teacher,
        teacher_settings=tuple(args.teacher_set),
    )


def average_sizes(text: str) -> list[int]:
    """`5,10` -> [5, 10]: one comma-separated value, so that overrides may follow the option."""
    return _positive_list(text, "5,10")


def seed_list(text: str) -> list[int]:
    """`1,2` -> [1, 2]: the seeds of the ensemble's models, each once."""
    seeds = _positive_list(text, "1,2")
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"each seed once, please; got {text!r}")
    return seeds


def positive(text: str) -> int:
    """One positive integer, such as 1000."""
    values = _positive_list(text, "1000")
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, such as 1000; got {text!r}")
    return values[0]


def _positive_list(text: str, example: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(
            f"expected positive integers separated by commas, such as {example}; got {text!r}"
        )
    return values
