"""Write a randomly initialised Marian model directory for the toy task, laid out like a downloaded OPUS-MT one.

It stands in for `huggingface-cli download Helsinki-NLP/opus-mt-de-en --local-dir DIR`
where there is no network: config.json, model.safetensors, generation_config.json,
source.spm and target.spm (SentencePiece models trained on the data's training
text), vocab.json and tokenizer_config.json. Needs the `hf` extra (transformers).

    python scripts/make_marian_toy.py opus-mt-toy --data data/toy     # data/toy/train.tsv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="the model directory to write")
    parser.add_argument("--data", required=True, help="a directory with train.tsv (source<TAB>target)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    try:
        import transformers  # noqa: F401  (the hf extra)
    except ImportError as e:
        print(f"make_marian_toy.py: {e}; install the hf extra: pip install -e '.[hf]'", file=sys.stderr)
        return 1
    from seq2seq.hf.toy import Shape, write_random_marian

    pairs = [line.split("\t") for line in (Path(args.data) / "train.tsv").read_text(encoding="utf-8").splitlines()]
    src, tgt = [p[0] for p in pairs if len(p) == 2], [p[1] for p in pairs if len(p) == 2]
    shape = Shape(d_model=64, heads=4, ffn=128, activation="swish")
    print(write_random_marian(args.output, src, tgt, shape, seed=args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
