"""A toy parallel corpus to try the framework on in seconds: sentences of made-up words and their reversal.

    python scripts/make_toy_data.py data/toy                 # train/val/test.tsv: source<TAB>target
    python scripts/make_toy_data.py data/toy --format text   # train.src, train.tgt, ... (one side a file)
    python scripts/make_toy_data.py data/toy --format text --also-copy
        # and train.same ...: the source copied, a second "language" for a multilingual model (src-tgt, src-same)

The task (reverse the word order) is learnt by the tiny model of configs/tiny.yaml in a few hundred updates.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = "red blue green cat dog sun moon tree car house bird fish".split()
SPLITS = {"train": 5000, "val": 200, "test": 200}


def sentences(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 7))) for _ in range(n)]


def write_split(out: Path, split: str, sources: list[str], fmt: str, also_copy: bool) -> None:
    targets = [" ".join(reversed(s.split())) for s in sources]
    if fmt == "tsv":
        (out / f"{split}.tsv").write_text("".join(f"{s}\t{t}\n" for s, t in zip(sources, targets)), encoding="utf-8")
    elif fmt == "jsonl":
        lines = (json.dumps({"src": s, "tgt": t}) + "\n" for s, t in zip(sources, targets))
        (out / f"{split}.jsonl").write_text("".join(lines), encoding="utf-8")
    else:
        for lang, lines in (("src", sources), ("tgt", targets), *((("same", sources),) if also_copy else ())):
            (out / f"{split}.{lang}").write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--format", choices=["tsv", "jsonl", "text"], default="tsv")
    p.add_argument("--also-copy", action="store_true", help="text format: a second target language, the copy")
    p.add_argument("--seed", type=int, default=0, help="another seed, other sentences (e.g. new data to fine-tune on)")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for number, (split, n) in enumerate(SPLITS.items()):
        write_split(out, split, sentences(n, 3 * args.seed + number), args.format, args.also_copy)
    print(f"wrote {', '.join(f'{split} ({n} pairs)' for split, n in SPLITS.items())} to {out} ({args.format})")


if __name__ == "__main__":
    main()
