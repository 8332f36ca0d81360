"""Run a Multi30k recipe end to end and write its results table (the same as `seq2seq recipe`).

    python scripts/run_recipe.py configs/m30k_de_en.yaml --average 5,10 [section.key=value ...]
    python scripts/run_recipe.py configs/m30k_de_en_ens.yaml --average 5,10 --seeds 1,2 --distill

Downloads the pair (SEQ2SEQ_DATA_MIRROR for a local copy; --no-download for a corpus already in
data.dir), trains (with --seeds, one model per seed in RUN/seedS), averages the last k step checkpoints
for each k of --average, picks on val between checkpoint_best and the averages (with --seeds, the
ensemble of the picked ones), decodes the test split once and scores it (sacreBLEU, and the lower-cased
Moses-tokenized BLEU when the dataset has its references, each with its 95% bootstrap interval). With
--distill, the picked system translates the training source in saved chunks (--distill-chunk), a student
trains on it in RUN/student (the recipe's config, or the one given to --distill, then each --student
section.key=value; --distill-mix adds the original pairs) and is picked, tested and timed beside its
teacher, and exported to CTranslate2 int8 when it is installed.

Writes RUN/results.json, RUN/results.md and RUN/recipe_state.json (the finished steps): running the same
command again skips what is finished, and resumes an interrupted training where it stopped. A signal stops
the recipe at a safe point; a training in progress saves its step first. The steps, their typed results
and why training runs as a child process: seq2seq/app/recipe/__init__.py.
"""

from __future__ import annotations

import argparse
import sys

from seq2seq import interrupt, recipe_args
from seq2seq.app.logs import setup_logging
from seq2seq.errors import ConfigError, UserError


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    recipe_args.add_arguments(parser)
    args = parser.parse_args()
    setup_logging(verbose=False)
    from seq2seq.app.recipe import StepFailed, markdown, run_recipe

    try:
        with interrupt.Interrupts():  # a signal stops the recipe at a safe point, never mid-file
            results = run_recipe(recipe_args.options(args))
    except StepFailed as e:  # the subcommand said why on stderr; its exit code is the recipe's
        print(f"run_recipe: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except UserError as e:
        print(f"run_recipe: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    except KeyboardInterrupt as e:
        print("run_recipe: interrupted; run the same command to go on from where it stopped", file=sys.stderr)
        sys.exit(e.exit_code if isinstance(e, interrupt.Interrupted) else 130)
    print(markdown(results), end="")


if __name__ == "__main__":
    main()
