#!/usr/bin/env bash
# The main job: set up, fetch Multi30k de-en, train the quickstart model,
# translate a few sentences and score the test set with sacreBLEU.
# Offline, SEQ2SEQ_DATA_MIRROR points at a local copy of the raw files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
S2S=.venv/bin/seq2seq
RUN=${RUN:-runs/quickstart}
$S2S download --langs de,en --dest data/multi30k
$S2S train --config configs/quickstart.yaml "train.run_dir=$RUN" "$@"
printf 'Ein Mann fährt Fahrrad auf einer Straße.\nZwei Hunde spielen im Schnee.\n' \
  | $S2S translate --checkpoint "$RUN/checkpoint_best.pt"
# With the dataset's tokenized references in data/multi30k/tok/, evaluate adds the tokenized BLEU of older papers.
$S2S evaluate --checkpoint "$RUN/checkpoint_best.pt" --save "$RUN/test_2016_flickr.hyp.en" | tee "$RUN/test_scores.txt"
