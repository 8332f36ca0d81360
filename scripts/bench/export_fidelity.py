"""How faithfully CTranslate2 exports translate: identical lines and BLEU against the PyTorch path.

    python scripts/bench/export_fidelity.py NAME=CHECKPOINT [NAME=CHECKPOINT ...] [--out DIR] [--threads N]

Each checkpoint is exported to float32 and int8 (into --out/NAME-float32, --out/NAME-int8),
then its config's test set is translated greedy and with beam 5 (the config's length
penalty) by the checkpoint and both exports. For every export and search it prints the
share of lines identical to the checkpoint's and the BLEU of each (sacreBLEU, and the
lower-cased tokenized BLEU when the dataset has its reference), as a markdown table.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from seq2seq.app.evaluation import EvalSet, eval_set, score
from seq2seq.decoding.translate import TextTranslator, Translator
from seq2seq.deploy.export import export_ctranslate2
from seq2seq.deploy.exported import CTranslate2Translator, import_ctranslate2
from seq2seq.errors import run_script
from seq2seq.runs import checkpoint

SEARCHES = {"greedy": {"strategy": "greedy"}, "beam 5": {"strategy": "beam", "beam_size": 5}}
QUANTIZATIONS = ("float32", "int8")


def bleu(hypotheses: list[str], test: EvalSet) -> tuple[float, float | None]:
    report = score(hypotheses, test).report
    tokenized = report.tokenized_bleu.score if report.tokenized_bleu is not None else None
    return round(report.bleu.score, 2), None if tokenized is None else round(tokenized, 2)


def rows_for(name: str, path: Path, out: Path, threads: int) -> list[dict]:
    """One row per search and engine: the checkpoint's own, then each export's against it."""
    stored = checkpoint.read(path)
    test = eval_set(stored.config.data)
    exports = {q: export_ctranslate2(path, out / f"{name}-{q}", q) for q in QUANTIZATIONS}
    rows = []
    for search, settings in SEARCHES.items():
        engines: dict[str, TextTranslator] = {"pytorch": Translator.from_checkpoint(path, **settings)}
        for q, directory in exports.items():
            engines[f"ct2 {q}"] = CTranslate2Translator.from_directory(directory, threads=threads, **settings)
        reference: list[str] = []
        for engine, translator in engines.items():
            hypotheses = translator.translate(test.sources)
            reference = reference or hypotheses
            same = sum(a == b for a, b in zip(hypotheses, reference)) / len(reference)
            sacre, tokenized = bleu(hypotheses, test)
            rows.append(
                {"variant": name, "search": search, "engine": engine, "identical": round(100 * same, 1)}
                | {"bleu": sacre, "tok_lc_bleu": tokenized}
            )
            print(markdown(rows[-1:], header=False), flush=True)  # progress; the full table comes last
    return rows


def markdown(rows: list[dict], header: bool = True) -> str:
    lines = ["| variant | search | engine | identical to PyTorch | BLEU | lc tok BLEU |", "|---|---|---|---|---|---|"]
    lines = lines if header else []
    for r in rows:
        tok = "-" if r["tok_lc_bleu"] is None else r["tok_lc_bleu"]
        lines.append(f"| {r['variant']} | {r['search']} | {r['engine']} | {r['identical']}% | {r['bleu']} | {tok} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+", metavar="NAME=CHECKPOINT")
    parser.add_argument("--out", default="runs/export_fidelity", help="where the exports go")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for item in args.checkpoints:
        name, _, path = item.partition("=")
        if not path:
            parser.error(f"expected NAME=CHECKPOINT, got {item!r}")
        rows += rows_for(name, Path(path), out, args.threads)
    (out / "fidelity.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    print(f"\nCTranslate2 {import_ctranslate2().__version__}, torch {torch.__version__}, {args.threads} thread(s)\n")
    print(markdown(rows))


if __name__ == "__main__":
    run_script("export_fidelity", main)
