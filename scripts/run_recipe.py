"""Run a Multi30k recipe end to end and write its results table.

    python scripts/run_recipe.py configs/m30k_de_en.yaml [section.key=value ...]

Downloads the language pair (SEQ2SEQ_DATA_MIRROR for a local copy), trains
(resuming if the run directory has a checkpoint), averages the last
checkpoints when the config asks for it, decodes test_2016_flickr with the
config's decode settings, and scores it two ways:

- sacreBLEU's default (cased, detokenized, 13a): the headline score;
- lower-cased Moses-tokenized BLEU against the dataset's `lc.norm.tok`
  references with `tokenize='none'`: the convention of published Multi30k
  numbers (see seq2seq.metrics.tokenized_bleu).

Writes `results.json` and `results.md` into the run directory.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from seq2seq import metrics
from seq2seq.config import load_config
from seq2seq.data import find_file, read_lines
from seq2seq.translate import Translator


def seq2seq(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "seq2seq", *args], check=True)


def score(checkpoint: Path, src: list[str], refs: list[str], tok_refs: list[str] | None, lang: str) -> dict:
    start = time.monotonic()
    translator = Translator.from_checkpoint(checkpoint)
    hyps = translator.translate(src)
    result = {
        "checkpoint": checkpoint.name,
        "sacrebleu": round(metrics.bleu(hyps, refs).score, 2),
        "chrf": round(metrics.chrf(hyps, refs).score, 2),
        "signature": metrics.bleu(hyps, refs).signature,
        "decode_seconds": round(time.monotonic() - start, 1),
    }
    if tok_refs is not None:
        result["tok_lc_bleu"] = round(metrics.tokenized_bleu(hyps, tok_refs, lang).score, 2)
    (checkpoint.parent / f"test.{checkpoint.stem}.{lang}").write_text("".join(h + "\n" for h in hyps), encoding="utf-8")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_config(args.config, args.overrides)
    d, run_dir = cfg.data, Path(cfg.train.run_dir)
    seq2seq("download", "--langs", f"{d.src_lang},{d.tgt_lang}", "--dest", d.dir)
    start = time.monotonic()
    seq2seq("train", "--config", args.config, *args.overrides)
    train_minutes = (time.monotonic() - start) / 60
    src = read_lines(find_file(d.dir, d.test, d.src_lang))
    refs = read_lines(find_file(d.dir, d.test, d.tgt_lang))
    tok_path = Path(d.dir) / "tok" / f"{d.test}.lc.norm.tok.{d.tgt_lang}"
    tok_refs = read_lines(tok_path) if tok_path.is_file() else None
    checkpoints = [run_dir / name for name in ("checkpoint_best.pt", "checkpoint_avg.pt") if (run_dir / name).is_file()]
    results = {
        "config": args.config,
        "overrides": args.overrides,
        "pair": f"{d.src_lang}-{d.tgt_lang}",
        "train_wall_minutes": round(train_minutes, 1),
        "scores": [score(c, src, refs, tok_refs, d.tgt_lang) for c in checkpoints],
    }
    (run_dir / "results.json").write_text(json.dumps(results, indent=2), encoding="utf-8")
    lines = [
        f"| {results['pair']} | {s['checkpoint']} | {s['sacrebleu']} | {s.get('tok_lc_bleu', '-')} | {s['chrf']} "
        f"| {results['train_wall_minutes']} |"
        for s in results["scores"]
    ]
    header = "| pair | checkpoint | sacreBLEU | lc tok BLEU | chrF | train minutes |\n|---|---|---|---|---|---|\n"
    (run_dir / "results.md").write_text(header + "\n".join(lines) + "\n", encoding="utf-8")
    print(header + "\n".join(lines))


if __name__ == "__main__":
    main()
