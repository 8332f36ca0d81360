"""A Multi30k recipe end to end, as resumable steps with typed results (`seq2seq recipe CONFIG ...`).

1. Download the language pair (SEQ2SEQ_DATA_MIRROR for a local copy; `no_download` for a corpus already
   in data.dir).
2. `train`: train (or resume) the model; with seeds, one model per seed (`train.seed`), one after the
   other, each in its own run directory `RUN/seed1`, `RUN/seed2` (RUN is train.run_dir), sharing one
   prepared corpus and so one vocabulary (`RUN/prepared`, unless data.prepared_dir names another).
3. `average`: average the last k step checkpoints, for each k of `average`.
4. `pick`: the best on val of checkpoint_best and the averages, decoding with the config's decode
   settings; with seeds, each model picks its own, and the ensemble of the picked ones is scored on val.
5. `test`: decode the test split once with the picked system and score it as `seq2seq evaluate
   --bootstrap 1000 --format json` does (`app.evaluation.score`, in this process): sacreBLEU's default,
   and the lower-cased Moses-tokenized BLEU when the dataset has its references, each with its 95%
   interval.
6. `distill` and `student/...`: with distillation, the picked system translates the training source in
   saved chunks (`app.distill`), a student trains on it in RUN/student, is averaged, picked and tested
   like the teacher, and is timed exported to CTranslate2 int8 (`student/int8`).

Each step's result is a typed dataclass (`results`), recorded with what the step depended on in
RUN/recipe_state.json (`state`): running the same command again skips the finished steps and takes their
results from there, so a finished recipe only writes its tables again, and an interrupted one goes on
with the step it was in. A translation keeps a record of what made it (`NAME.json`), so a step that must
run again still decodes only what changed. RUN/results.json (the layout of `RecipeResults.to_json`) and
RUN/results.md (`report.markdown`) are written from the typed results.

Training runs as a child process, `python -m seq2seq train --config ... [overrides]`, as `seq2seq train`
would on the command line; its result is read back from the run directory (metrics.jsonl), never from its
output. A child process because training owns its process: it sets torch's threads, seeds, determinism
and precision flags, installs its own signal handling (a signal saves the step, then stops), may start
DataLoader workers or a data-parallel group, and leaves memory behind that the decoding steps after it
would otherwise share. In a child of its own, each member and the student start from the same state as a
command-line run, a crash in training ends the recipe with one line and its exit code, and a signal to
the recipe is passed on once (`commands`), the recipe waiting while the training saves its step. Decoding
and scoring run in this process: they are library calls over the checkpoints the training left.
"""

from seq2seq.app.recipe.commands import StepFailed
from seq2seq.app.recipe.report import markdown
from seq2seq.app.recipe.results import RecipeResults
from seq2seq.app.recipe.run import RecipeOptions, run_recipe
from seq2seq.app.recipe.state import STATE_FILE, RecipeState

__all__ = ["STATE_FILE", "RecipeOptions", "RecipeResults", "RecipeState", "StepFailed", "markdown", "run_recipe"]
