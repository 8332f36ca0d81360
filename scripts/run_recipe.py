"""Run a Multi30k recipe end to end and write its results table.

    python scripts/run_recipe.py configs/m30k_de_en.yaml --average 5,10 [section.key=value ...]
    python scripts/run_recipe.py configs/m30k_de_en_ens.yaml --average 5,10 --seeds 1,2 --distill

1. Download the language pair (SEQ2SEQ_DATA_MIRROR for a local copy;
   --no-download for a corpus already in data.dir).
2. Train. A run directory with a checkpoint resumes; a run that already
   reached its budget just stops again, so re-running only re-scores.
   Training stopped by a signal (or failing) ends the recipe there; a
   signal to the recipe alone reaches the training too, and the recipe
   waits while it saves its step.
   With `--seeds 1,2`, one model per seed (`train.seed`), one after the
   other, each in its own run directory `RUN/seed1`, `RUN/seed2` (RUN is
   train.run_dir), sharing one prepared corpus and so one vocabulary
   (`RUN/prepared`, unless data.prepared_dir names another); the time budget
   of the config is each model's.
3. Average the last k epoch checkpoints, for each k of --average.
4. Pick, on val, the best of checkpoint_best and the averages, decoding with
   the config's decode settings (the command line's overrides included).
   checkpoint_best was itself chosen for its greedy val BLEU, so its val
   score flatters it a little against the averages. With --seeds, each
   model picks its own, and the ensemble of the picked ones (the mean of
   their next-token log-probabilities) is scored on val.
5. Decode test_2016_flickr once, with the picked checkpoint (with --seeds:
   the ensemble alone), and score it:
   - sacreBLEU's default (cased, detokenized, 13a): the headline score;
   - lower-cased Moses-tokenized BLEU against the dataset's `lc.norm.tok`
     references with `tokenize='none'`: the convention of published Multi30k
     numbers (see seq2seq.metrics.tokenized_bleu);
   each BLEU with its 95% bootstrap interval (1,000 resampled test sets).
6. With --distill, sequence-level knowledge distillation: the picked system
   (the teacher) translates the training source with the config's decode
   settings into RUN/distilled/chunks, CHUNK lines a file (--distill-chunk),
   each saved when done, so a rerun translates only the chunks missing (a
   changed teacher, decode setting or source discards them); a line per
   chunk on stderr says how far it is. RUN/distilled/data then holds the
   distilled pairs (with --distill-mix the original training pairs too) and
   the original val and test splits. A student trains on it in RUN/student:
   the recipe's config and overrides, or the config given to --distill;
   then `--student section.key=value` (repeatable) on top. It is picked on
   val like a model of step 4, decodes test once, and is reported beside its
   teacher with the test translation speed (sentences/s, the same threads)
   of teacher, student, and the student exported to CTranslate2 int8
   (skipped, with a line saying why, when CTranslate2 is not installed).

Writes `results.json`, `results.md` and the val/test translations into the
run directory (with --distill, the teacher's results before the student
trains, and all of them at the end). results.json holds the newest student;
each student's results also stay in its own run directory
(`student_results.json`), so a second student trained with
`--student train.run_dir=...` leaves the first one's on record. Each
translation made with PyTorch keeps a record of what made it (`NAME.json`:
the checkpoints' bytes, the decode settings, the sources, the seconds it
took); a rerun reads it back instead of decoding again, so test is decoded
once per system even across reruns, and its speed is that decode's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from seq2seq import checkpoint, interrupt, metrics
from seq2seq.app.distill import (
    CHUNK_LINES,
    teacher_identity,
    training_pairs,
    translate_in_chunks,
    translation_identity,
    write_student_data,
)
from seq2seq.app.evaluation import EvalSet, decode, eval_set, score
from seq2seq.app.model import Engine, ModelOptions, open_translator
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.data import read_lines, read_split
from seq2seq.errors import ConfigError, UserError
from seq2seq.run_dir import RunDirectory
from seq2seq.translate import TextTranslator

BOOTSTRAP = 1000  # resampled test sets for the 95% intervals of the test BLEU scores


@dataclass(frozen=True)
class Member:
    """One trained model of the recipe: its run, the val BLEU of its candidates, the one picked."""

    name: str  # "" for the recipe's one model, "seed1" for a model of --seeds 1,...
    run: RunDirectory
    val: dict[str, float]
    picked: str

    @property
    def checkpoint(self) -> Path:
        return self.run.path / f"{self.picked}.pt"


@dataclass(frozen=True)
class Split:
    """The val split's lines, which every candidate is decoded on."""

    sources: list[str]
    references: list[str]


def seq2seq(*args: str) -> None:
    """Run a `seq2seq` subcommand; if it fails or was stopped, so does the recipe (its message is on stderr)."""
    code = _wait(subprocess.Popen([sys.executable, "-m", "seq2seq", *args], process_group=0))
    interrupt.check()  # stopped by a signal: say so, not "failed"
    if code:
        print(f"run_recipe: `seq2seq {args[0]}` exited with code {code}; nothing was scored", file=sys.stderr)
        sys.exit(code)


def _wait(child: subprocess.Popen[bytes]) -> int:
    """The subcommand's exit code, once it has stopped in its own time.

    A signal to the recipe is passed on to it, and the recipe waits: a training saves its step before it
    stops. (subprocess.run would kill it at once, losing the updates since its last checkpoint.) The
    subcommand runs in its own process group, so a Ctrl-C reaches it once, through the recipe: reaching
    both, it would arrive twice, and a late second copy means "quit without saving".
    """
    passed_on = False
    try:
        while True:
            try:
                return child.wait(timeout=0.2)
            except subprocess.TimeoutExpired:
                pass
            if not passed_on:
                try:
                    interrupt.check()
                except interrupt.Interrupted as e:
                    child.send_signal(e.signal)
                    passed_on = True
    except interrupt.Interrupted as e:  # a second signal, later: the user will not wait, nor will the subcommand
        child.send_signal(e.signal)
        raise


def averages(run: RunDirectory, sizes: list[int]) -> list[Path]:
    """checkpoint_avg{k}.pt from the run's last k epoch checkpoints, for each k (fewer if fewer exist)."""
    available = len(run.step_checkpoints(run.current_run_id()))
    if available < 2:
        return []
    out = []
    for k in sorted({min(k, available) for k in sizes}):
        out.append(run.path / f"checkpoint_avg{k}.pt")
        run.average_last(k, out[-1])
    return out


def open_system(paths: list[Path], cfg: ExperimentConfig, engine: Engine = "torch") -> TextTranslator:
    """One checkpoint, several as an ensemble, or a CTranslate2 export, on the CPU with the recipe's
    decode settings and threads."""
    settings = tuple(f"decode.{key}={value}" for key, value in dataclasses.asdict(cfg.decode).items())
    paths_text = tuple(str(p) for p in paths)
    threads = torch.get_num_threads()
    return open_translator(ModelOptions(paths_text, engine, "cpu", threads, settings, token_scores=False))


def translate(translator: TextTranslator, sources: list[str], save: Path) -> tuple[list[str], float]:
    """The translations (also written to `save`) and the seconds they took."""
    start = time.monotonic()
    hyps = decode(translator, sources)
    seconds = time.monotonic() - start
    save.write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return hyps, seconds


def translate_once(paths: list[Path], cfg: ExperimentConfig, sources: list[str], save: Path) -> tuple[list[str], float]:
    """The checkpoints' translation of `sources` and the seconds it took, decoded at most once.

    `save` keeps the translation and `save`.json what made it (the checkpoints' bytes, the decode settings,
    the sources) with its seconds; a rerun with the same identity reads them back instead of decoding
    again, so re-scoring a finished recipe, or going on to its student, costs seconds, not minutes.
    """
    identity = translation_identity(paths, cfg.decode, sources)
    record = save.with_name(save.name + ".json")
    saved = _saved_translation(save, record, identity)
    if saved is not None:
        note(f"run_recipe: {save} reused (same checkpoints, decode settings and sources)")
        return saved
    hyps, seconds = translate(open_system(paths, cfg), sources, save)
    record.write_text(json.dumps({"identity": identity, "seconds": seconds}, indent=2), encoding="utf-8")
    return hyps, seconds


def _saved_translation(save: Path, record: Path, identity: dict) -> tuple[list[str], float] | None:
    """The translation in `save` and its seconds, if `record` says that `identity` made it; else None."""
    if not (save.is_file() and record.is_file()):
        return None
    made = json.loads(record.read_text(encoding="utf-8"))
    if made.get("identity") != identity:
        return None
    hyps = read_lines(save)
    return (hyps, float(made["seconds"])) if len(hyps) == identity["lines"] else None


def pick(run: RunDirectory, cfg: ExperimentConfig, sizes: list[int], val: Split, name: str = "") -> Member:
    """The best on val of checkpoint_best and the averages of the last k epoch checkpoints."""
    scores = {}
    for candidate in [run.best, *averages(run, sizes)]:
        save = run.path / f"{cfg.data.valid}.{candidate.stem}.{cfg.data.tgt_lang}"
        hyps, _ = translate_once([candidate], cfg, val.sources, save)
        scores[candidate.stem] = round(metrics.bleu(hyps, val.references).score, 2)
    return Member(name, run, scores, max(scores, key=scores.__getitem__))


def train_member(args: argparse.Namespace, cfg: ExperimentConfig, seed: int | None) -> ExperimentConfig:
    """Train (or resume) the recipe's model, or its model of one seed; its config."""
    overrides = list(args.overrides)
    if seed is not None:
        top = Path(cfg.train.run_dir)
        overrides += [f"train.seed={seed}", f"train.run_dir={top / f'seed{seed}'}"]
        if not cfg.data.prepared_dir:  # one prepared corpus: one vocabulary, which an ensemble needs
            overrides.append(f"data.prepared_dir={top / 'prepared'}")
    seq2seq("train", "--config", args.config, *overrides)
    return load_config(args.config, overrides)


def sizes_of(args: argparse.Namespace, cfg: ExperimentConfig) -> list[int]:
    """The k of the last-k averages: --average, or the config's train.average_last."""
    return args.average if args.average is not None else [cfg.train.average_last] * (cfg.train.average_last > 0)


def training_summary(member: Member) -> dict:
    """Size and training of a member, from its checkpoint_last."""
    last = checkpoint.read(member.run.last)
    assert last.training is not None, "seq2seq train always saves its state in checkpoint_last"
    progress = last.training.progress
    return {
        "run_dir": str(member.run.path),
        "params_millions": round(sum(p.numel() for p in last.build_model().parameters()) / 1e6, 1),
        "updates": progress.step,
        "epochs": progress.epoch - 1,  # completed; a time budget may stop training inside the next one
        "train_minutes": round(progress.elapsed / 60, 1),
        "val": member.val,
        "picked": member.picked,
    }


def test_scores(report: metrics.Report) -> dict:
    """The scores of `seq2seq evaluate`, the tokenized BLEU included when the dataset has its references."""
    scores = {
        **_with_interval("sacrebleu", report.bleu),
        "chrf": round(report.chrf.score, 2),
        "ter": round(report.ter.score, 2),
        "signature": report.bleu.signature,
    }
    if report.tokenized_bleu is not None:
        scores.update(_with_interval("tok_lc_bleu", report.tokenized_bleu))
    return scores


def _with_interval(key: str, score: metrics.Score) -> dict[str, float]:
    assert score.ci95 is not None  # BOOTSTRAP > 1
    return {key: round(score.score, 2), f"{key}_ci95": round(score.ci95, 2)}


def examples(src: list[str], refs: list[str], hyps: list[str], every: int = 200) -> list[dict[str, str]]:
    """Every `every`-th test sentence with its reference and our translation (a fixed, unpicked sample)."""
    return [{"source": src[i], "reference": refs[i], "ours": hyps[i]} for i in range(0, len(hyps), every)]


def scored_test(paths: list[Path], cfg: ExperimentConfig, test: EvalSet, save: Path) -> dict:
    """The test set decoded once (a rerun reads that translation back) and scored, with the decoding speed."""
    return scored(*translate_once(paths, cfg, test.sources, save), test)


def scored(hyps: list[str], seconds: float, test: EvalSet) -> dict:
    """The test translation's scores and speed, with a fixed sample of it."""
    return {
        "test": test_scores(score(hyps, test, BOOTSTRAP).report),
        "test_sentences_per_second": round(len(hyps) / max(seconds, 1e-9), 1),
        "examples": examples(test.sources, test.references, hyps),
    }


def one_model(cfg: ExperimentConfig, member: Member, test: EvalSet) -> dict:
    """The results of the recipe's one model: its training, its candidates on val, the picked one on test."""
    save = member.run.path / f"{cfg.data.test}.{member.picked}.{cfg.data.tgt_lang}"
    return {
        **training_summary(member),
        "checkpoints": [str(member.checkpoint)],
        **scored_test([member.checkpoint], cfg, test, save),
    }


def ensemble(cfg: ExperimentConfig, members: list[Member], val: Split, test: EvalSet) -> dict:
    """The results of the ensemble of the members' picked checkpoints: each member, the ensemble on val
    and, once, on test."""
    summaries = [{"seed": int(m.name.removeprefix("seed")), **training_summary(m)} for m in members]
    paths, top, d = [m.checkpoint for m in members], Path(cfg.train.run_dir), cfg.data
    hyps, _ = translate_once(paths, cfg, val.sources, top / f"{d.valid}.ensemble.{d.tgt_lang}")
    return {
        "members": summaries,
        "params_millions": round(sum(s["params_millions"] for s in summaries), 1),
        "updates": sum(s["updates"] for s in summaries),
        "train_minutes": round(sum(s["train_minutes"] for s in summaries), 1),
        "val": {"ensemble": round(metrics.bleu(hyps, val.references).score, 2)},
        "picked": "ensemble",
        "checkpoints": [str(p) for p in paths],
        **scored_test(paths, cfg, test, top / f"{d.test}.ensemble.{d.tgt_lang}"),
    }


def distill(args: argparse.Namespace, cfg: ExperimentConfig, teacher: dict, val: Split, test: EvalSet) -> dict:
    """Translate the training source with the teacher, train a student on it, pick it on val, test it once,
    and time it beside the teacher (in PyTorch, and exported to CTranslate2 int8)."""
    top, config = Path(cfg.train.run_dir), args.distill or args.config
    base = [] if args.distill else list(args.overrides)  # the recipe's overrides go with the recipe's config
    check_same_pair(cfg, load_config(config, [*base, *args.student]))
    data_overrides = distilled_data(args, cfg, [Path(p) for p in teacher["checkpoints"]], top / "distilled")
    overrides = [*base, f"train.run_dir={top / 'student'}", *data_overrides, *args.student]
    seq2seq("train", "--config", config, *overrides)
    student_cfg = load_config(config, overrides)
    member = pick(RunDirectory(student_cfg.train.run_dir), student_cfg, sizes_of(args, student_cfg), val, "student")
    d = student_cfg.data
    save = member.run.path / f"{d.test}.{member.picked}.{d.tgt_lang}"
    student = {
        "config": config,
        "overrides": overrides,
        "mix": args.distill_mix,
        **training_summary(member),
        "checkpoints": [str(member.checkpoint)],
        **scored_test([member.checkpoint], student_cfg, test, save),
        "ctranslate2_int8": int8_student(member, student_cfg, test),
    }
    # RUN/results.json keeps the newest student; each student's own directory keeps its results.
    (member.run.path / "student_results.json").write_text(json.dumps(student, indent=2), encoding="utf-8")
    return student


def check_same_pair(teacher: ExperimentConfig, student: ExperimentConfig) -> None:
    """The student learns the teacher's pair: another pair would train on translations it cannot use."""
    t, s = teacher.data, student.data
    if (t.src_lang, t.tgt_lang) != (s.src_lang, s.tgt_lang):
        raise ConfigError(
            f"--distill: the student translates {s.src_lang}-{s.tgt_lang}, its teacher {t.src_lang}-{t.tgt_lang}"
        )


def distilled_data(args: argparse.Namespace, cfg: ExperimentConfig, teacher: list[Path], directory: Path) -> list[str]:
    """The teacher's translation of the training source (in resumable chunks) written as the student's
    data directory; the `data.*` overrides that train on it."""
    sources, _ = training_pairs(cfg.data)
    identity = teacher_identity(teacher, cfg.decode, sources, args.distill_chunk)
    hyps = translate_in_chunks(lambda: open_system(teacher, cfg), sources, directory / "chunks", identity, note)
    return write_student_data(cfg.data, directory / "data", hyps, args.distill_mix)


def note(line: str) -> None:
    """A progress or skip line on stderr, at once (the recipe runs for hours)."""
    print(line, file=sys.stderr, flush=True)


def int8_student(member: Member, cfg: ExperimentConfig, test: EvalSet) -> dict:
    """The student exported to CTranslate2 int8, decoding test with the recipe's threads and decode settings."""
    if importlib.util.find_spec("ctranslate2") is None:
        reason = "CTranslate2 is not installed (pip install 'seq2seq[export]'): no int8 speed for the student"
        note(f"run_recipe: {reason}")
        return {"skipped": reason}
    from seq2seq.export import export_ctranslate2

    try:
        exported = export_ctranslate2(member.checkpoint, member.run.path / "ctranslate2_int8", "int8")
    except UserError as e:  # an architecture that CTranslate2 does not run
        note(f"run_recipe: no CTranslate2 int8 student: {e}")
        return {"skipped": str(e)}
    translator = open_system([exported], cfg, "ctranslate2")
    save = member.run.path / f"{cfg.data.test}.ctranslate2_int8.{cfg.data.tgt_lang}"
    return {"dir": str(exported), **scored(*translate(translator, test.sources, save), test)}  # timed every run


HEADER = (
    "| pair | params | updates | full epochs | train min | checkpoint (picked on val) | val BLEU | test sacreBLEU "
    "| test lc tok BLEU | test chrF |"
)


def markdown(results: dict) -> str:
    lines = [
        HEADER,
        "|---|---|---|---|---|---|---|---|---|---|",
        *system_rows(results),
        "",
        "Test BLEU ± the half-width of its 95% interval over 1,000 resampled test sets (sacreBLEU's bootstrap).",
        "",
        "| candidate | val sacreBLEU |",
        "|---|---|",
        *(f"| {name} | {bleu} |" for name, bleu in candidates(results).items()),
        "",
        "| source | reference | ours |",
        "|---|---|---|",
        *(
            "| " + " | ".join(e[k].replace("|", "\\|") for k in ("source", "reference", "ours")) + " |"
            for e in results["examples"]
        ),
    ]
    if "student" in results:
        lines += ["", *student_rows(results)]
    return "\n".join(lines) + "\n"


def system_rows(results: dict) -> list[str]:
    """A row for the recipe's model; with --seeds, one for each member (val only) and one for the ensemble."""
    pair = results["pair"]
    if "members" not in results:
        return [_row(pair, results, results["picked"], results["val"][results["picked"]], results["test"])]
    rows = [_row(f"{pair}, seed {m['seed']}", m, m["picked"], m["val"][m["picked"]], None) for m in results["members"]]
    picked = " + ".join(f"seed{m['seed']}/{m['picked']}" for m in results["members"])
    ensemble = {**results, "epochs": "-"}
    return [
        *rows,
        _row(f"{pair}, ensemble of {len(rows)}", ensemble, picked, results["val"]["ensemble"], results["test"]),
    ]


def _row(label: str, r: dict, picked: str, val_bleu: float, test: dict | None) -> str:
    t = test or {}
    return (
        f"| {label} | {r['params_millions']}M | {r['updates']} | {r['epochs']} | {r['train_minutes']} | {picked} "
        f"| {val_bleu} | {_interval(t, 'sacrebleu')} | {_interval(t, 'tok_lc_bleu')} | {t.get('chrf', '-')} |"
    )


def candidates(results: dict) -> dict[str, float]:
    """Every candidate's val BLEU, the members' named by their seed, and the ensemble's."""
    if "members" not in results:
        return results["val"]
    named = {f"seed{m['seed']}/{name}": bleu for m in results["members"] for name, bleu in m["val"].items()}
    return {**named, **results["val"]}


def student_rows(results: dict) -> list[str]:
    """The student beside its teacher: val, test and test decoding speed."""
    s, int8 = results["student"], results["student"]["ctranslate2_int8"]
    teacher = "ensemble" if "members" in results else results["picked"]
    data = "distilled + original" if s["mix"] else "distilled"
    rows = [
        "| system | params | train min | val BLEU | test sacreBLEU | test lc tok BLEU | test chrF | test sentences/s |",
        "|---|---|---|---|---|---|---|---|",
        _speed_row(f"teacher ({teacher})", results, results["val"][teacher]),
        _speed_row(f"student on {data} ({s['picked']})", s, s["val"][s["picked"]]),
    ]
    if "skipped" in int8:
        return [*rows, "", f"Student in CTranslate2 int8: skipped ({int8['skipped']})."]
    rows.append(_speed_row("student, CTranslate2 int8", {**int8, "params_millions": s["params_millions"]}, "-"))
    speed = f"Speed: {results['test_set']} decoded with {results['threads']} thread(s), tokenization included."
    return [*rows, "", speed]


def _speed_row(label: str, r: dict, val_bleu: float | str) -> str:
    t = r["test"]
    return (
        f"| {label} | {r['params_millions']}M | {r.get('train_minutes', '-')} | {val_bleu} "
        f"| {_interval(t, 'sacrebleu')} | {_interval(t, 'tok_lc_bleu')} | {t['chrf']} "
        f"| {r['test_sentences_per_second']} |"
    )


def _interval(scores: dict, key: str) -> str:
    return f"{scores[key]} ± {scores[key + '_ci95']}" if key in scores else "-"


def average_sizes(text: str) -> list[int]:
    """`5,10` -> [5, 10]: one comma-separated value, so that overrides may follow the option."""
    return _positive_list(text, "5,10")


def seed_list(text: str) -> list[int]:
    """`1,2` -> [1, 2]: the seeds of the ensemble's models, each once."""
    seeds = _positive_list(text, "1,2")
    if len(set(seeds)) < len(seeds):
        raise argparse.ArgumentTypeError(f"each seed once, please; got {text!r}")
    return seeds


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


def positive(text: str) -> int:
    """One positive integer, such as 1000."""
    values = _positive_list(text, "1000")
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"expected one positive integer, such as 1000; got {text!r}")
    return values[0]


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*", help="section.key=value")
    parser.add_argument(
        "--average",
        type=average_sizes,
        metavar="K[,K...]",
        help="sizes of last-k averages (default: train.average_last)",
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
    args = parser.parse_args()
    if args.distill is None and (args.distill_mix or args.student):
        parser.error("--distill-mix and --student need --distill")
    if args.distill and not Path(args.distill).is_file():
        parser.error(f"--distill {args.distill}: no such config file (the student's settings go to --student)")
    return args


def main() -> None:
    args = parse_args()
    try:
        with interrupt.Interrupts():  # a signal stops the recipe at a safe point, never mid-file
            run_recipe(args)
    except UserError as e:
        print(f"run_recipe: {e}", file=sys.stderr)
        sys.exit(2 if isinstance(e, ConfigError) else 1)
    except KeyboardInterrupt as e:
        print("run_recipe: interrupted; run the same command to go on from where it stopped", file=sys.stderr)
        sys.exit(e.exit_code if isinstance(e, interrupt.Interrupted) else 130)


def run_recipe(args: argparse.Namespace) -> None:
    start = time.monotonic()
    cfg = load_config(args.config, args.overrides)
    d = cfg.data
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if not args.no_download:
        seq2seq("download", "--langs", f"{d.src_lang},{d.tgt_lang}", "--dest", d.dir)
    trained = [train_member(args, cfg, seed) for seed in args.seeds or [None]]
    val = Split(*read_split(d, d.valid))
    names = [f"seed{seed}" for seed in args.seeds] if args.seeds else [""]
    members = [pick(RunDirectory(c.train.run_dir), c, sizes_of(args, c), val, n) for c, n in zip(trained, names)]
    test = eval_set(d)  # the test split and, when the dataset has one, its tokenized reference
    system = ensemble(cfg, members, val, test) if args.seeds else one_model(cfg, members[0], test)
    results = {
        "config": args.config,
        "overrides": args.overrides,
        "pair": f"{d.src_lang}-{d.tgt_lang}",
        "decode": dataclasses.asdict(cfg.decode),
        "threads": torch.get_num_threads(),
        "test_set": d.test,
        **system,
    }
    top = Path(cfg.train.run_dir)
    if args.distill is not None:
        write_results(top, results, start)  # the teacher's, at once: the student takes another hour
        results["student"] = distill(args, cfg, system, val, test)
    write_results(top, results, start)
    print(markdown(results))


def write_results(top: Path, results: dict, start: float) -> None:
    """results.json and results.md as they stand, with the minutes this invocation has taken so far."""
    results["this_invocation_minutes"] = round((time.monotonic() - start) / 60, 1)
    (top / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    (top / "results.md").write_text(markdown(results), encoding="utf-8")


if __name__ == "__main__":
    main()
