"""Run a Multi30k recipe end to end and write its results table.

    python scripts/run_recipe.py configs/m30k_de_en.yaml --average 5,10 [section.key=value ...]

1. Download the language pair (SEQ2SEQ_DATA_MIRROR for a local copy;
   --no-download for a corpus already in data.dir).
2. Train. A run directory with a checkpoint resumes; a run that already
   reached its budget just stops again, so re-running only re-scores.
   Training stopped by a signal (or failing) ends the recipe there.
3. Average the last k epoch checkpoints, for each k of --average.
4. Pick, on val, the best of checkpoint_best and the averages, decoding with
   the config's decode settings (the command line's overrides included).
   checkpoint_best was itself chosen for its greedy val BLEU, so its val
   score flatters it a little against the averages.
5. Decode test_2016_flickr once, with the picked checkpoint, and score it:
   - sacreBLEU's default (cased, detokenized, 13a): the headline score;
   - lower-cased Moses-tokenized BLEU against the dataset's `lc.norm.tok`
     references with `tokenize='none'`: the convention of published Multi30k
     numbers (see seq2seq.metrics.tokenized_bleu);
   each BLEU with its 95% bootstrap interval (1,000 resampled test sets).

Writes `results.json`, `results.md` and the val/test translations into the
run directory.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from seq2seq import checkpoint, metrics
from seq2seq.app.evaluation import decode, eval_set, score
from seq2seq.config import ExperimentConfig, load_config
from seq2seq.data import find_file, read_lines
from seq2seq.run_dir import RunDirectory
from seq2seq.translate import Translator

BOOTSTRAP = 1000  # resampled test sets for the 95% intervals of the test BLEU scores


def seq2seq(*args: str) -> None:
    """Run a `seq2seq` subcommand; if it fails or was stopped, so does the recipe (its message is on stderr)."""
    code = subprocess.run([sys.executable, "-m", "seq2seq", *args]).returncode
    if code:
        print(f"run_recipe: `seq2seq {args[0]}` exited with code {code}; nothing was scored", file=sys.stderr)
        sys.exit(code)


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


def translate(checkpoint: Path, cfg: ExperimentConfig, split: str, sources: list[str]) -> list[str]:
    """Translate one split with the recipe's decode settings; the output is saved beside the checkpoint."""
    translator = Translator.from_checkpoint(checkpoint, **dataclasses.asdict(cfg.decode))
    hyps = decode(translator, sources)
    (checkpoint.parent / f"{split}.{checkpoint.stem}.{cfg.data.tgt_lang}").write_text(
        "".join(h + "\n" for h in hyps), encoding="utf-8"
    )
    return hyps


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


def markdown(results: dict) -> str:
    t = results["test"]
    lines = [
        "| pair | params | updates | full epochs | train min | checkpoint (picked on val) | val BLEU | test sacreBLEU "
        "| test lc tok BLEU | test chrF |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {results['pair']} | {results['params_millions']}M | {results['updates']} | {results['epochs']} "
        f"| {results['train_minutes']} | {results['picked']} | {results['val'][results['picked']]} "
        f"| {_interval(t, 'sacrebleu')} | {_interval(t, 'tok_lc_bleu')} | {t['chrf']} |",
        "",
        "Test BLEU ± the half-width of its 95% interval over 1,000 resampled test sets (sacreBLEU's bootstrap).",
        "",
        "| candidate | val sacreBLEU |",
        "|---|---|",
        *(f"| {name} | {score} |" for name, score in results["val"].items()),
        "",
        "| source | reference | ours |",
        "|---|---|---|",
        *(
            "| " + " | ".join(e[k].replace("|", "\\|") for k in ("source", "reference", "ours")) + " |"
            for e in results["examples"]
        ),
    ]
    return "\n".join(lines) + "\n"


def _interval(scores: dict, key: str) -> str:
    return f"{scores[key]} ± {scores[key + '_ci95']}" if key in scores else "-"


def average_sizes(text: str) -> list[int]:
    """`5,10` -> [5, 10]: one comma-separated value, so that overrides may follow the option."""
    try:
        sizes = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, such as 5,10; got {text!r}")
    return sizes


def main() -> None:
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
    args = parser.parse_args()
    start = time.monotonic()
    cfg = load_config(args.config, args.overrides)
    d, run = cfg.data, RunDirectory(cfg.train.run_dir)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if not args.no_download:
        seq2seq("download", "--langs", f"{d.src_lang},{d.tgt_lang}", "--dest", d.dir)
    seq2seq("train", "--config", args.config, *args.overrides)

    sizes = args.average if args.average is not None else [cfg.train.average_last] * (cfg.train.average_last > 0)
    candidates = [run.best, *averages(run, sizes)]
    val_src, val_refs = (read_lines(find_file(d.dir, d.valid, lang)) for lang in (d.src_lang, d.tgt_lang))
    val = {c.stem: round(metrics.bleu(translate(c, cfg, d.valid, val_src), val_refs).score, 2) for c in candidates}
    picked = max(val, key=val.__getitem__)
    test = eval_set(d)  # the test split and, when the dataset has one, its tokenized reference
    test_hyps = translate(run.path / f"{picked}.pt", cfg, d.test, test.sources)
    evaluation = score(test_hyps, test, BOOTSTRAP)

    last = checkpoint.read(run.last)
    assert last.training is not None, "seq2seq train always saves its state in checkpoint_last"
    progress = last.training.progress
    results = {
        "config": args.config,
        "overrides": args.overrides,
        "pair": f"{d.src_lang}-{d.tgt_lang}",
        "params_millions": round(sum(p.numel() for p in last.build_model().parameters()) / 1e6, 1),
        "updates": progress.step,
        "epochs": progress.epoch - 1,  # completed; a time budget may stop training inside the next one
        "train_minutes": round(progress.elapsed / 60, 1),
        "decode": dataclasses.asdict(cfg.decode),
        "val": val,
        "picked": picked,
        "test": test_scores(evaluation.report),
        "examples": examples(test.sources, test.references, test_hyps),
        "this_invocation_minutes": round((time.monotonic() - start) / 60, 1),
    }
    (run.path / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    (run.path / "results.md").write_text(markdown(results), encoding="utf-8")
    print(markdown(results))


if __name__ == "__main__":
    main()
