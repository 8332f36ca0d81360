"""Validation BLEU of a checkpoint over a grid of beam sizes and length penalties.

    python scripts/bench/decode_grid.py runs/m30k_en_de/checkpoint_avg10.pt --beams 1 5 10 --alphas 0.6 1.0 1.4

Tunes decoding on val (never on test): prints a markdown table of sacreBLEU
(cased, detokenized) with beam sizes as rows and GNMT length-penalty alphas as
columns; beam 1 is greedy search, which has no length penalty.
"""

from __future__ import annotations

import argparse

import torch

from seq2seq import metrics
from seq2seq.decoding.translate import Translator
from seq2seq.errors import run_script
from seq2seq.text.corpus import find_file, read_lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--split", default="val")
    parser.add_argument("--beams", type=int, nargs="+", default=[1, 5, 10])
    parser.add_argument("--alphas", type=float, nargs="+", default=[0.6, 1.0, 1.4])
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads; 0 keeps torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    translator = Translator.from_checkpoint(args.checkpoint, strategy="beam", nbest=1)  # whatever it was trained with
    data = translator.data
    assert data is not None  # loaded from a checkpoint
    src = read_lines(find_file(data.dir, args.split, data.src_lang))
    refs = read_lines(find_file(data.dir, args.split, data.tgt_lang))
    print(f"{args.checkpoint}, {args.split}: sacreBLEU by beam size (rows) and length penalty (columns)\n")
    print("| beam | " + " | ".join(f"alpha {a}" for a in args.alphas) + " |")
    print("|---" * (len(args.alphas) + 1) + "|")
    for beam in args.beams:
        cells: list[str] = []
        for alpha in args.alphas:
            if beam == 1 and cells:  # greedy ignores the length penalty
                cells.append(cells[0])
                continue
            # with_decode re-runs DecodeConfig's checks, so a bad --beams value fails with its message
            hyps = translator.with_decode(beam_size=beam, length_penalty=alpha).translate(src)
            cells.append(f"{metrics.bleu(hyps, refs).score:.2f}")
        print(f"| {beam} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    run_script("decode_grid", main)
