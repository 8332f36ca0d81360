#!/usr/bin/env bash
# The lecture table at the tutorials' own budget: 10 epochs of Multi30k de-en
# per model, each on both cores, one after another (docs/lectures.md).
#
#   bash scripts/lectures_epochs.sh [RUNS] [NAME ...]
#
# RUNS defaults to runs/lectures10; NAMEs pick some of the models below
# (default: all, in this order). Each model trains to 10 epochs with no time
# limit, then evaluates its best-val checkpoint on test_2016_flickr with beam
# 5 and greedy. Rerunning resumes: a stopped model continues, a finished one
# stops again, and scores already written are kept. Ends with the table.
set -euo pipefail
TIMEFORMAT=%R  # `time`: wall seconds only
cd "$(dirname "$0")/.."
R=${1:-runs/lectures10}
shift || true
S2S=${SEQ2SEQ:-.venv/bin/seq2seq}
PY=${PYTHON:-.venv/bin/python}
EPOCHS="train.max_epochs=10 train.max_minutes=0"
RNN=configs/m30k_de_en_rnn.yaml
ATTENTION=configs/m30k_de_en_rnn_attention.yaml

# The quickstart's settings when the tables were made (it now decays a cosine from 2e-3, without dropout,
# and has a feed-forward width of 512).
TABLES="model.dropout=0.1 optim.lr=1e-3 optim.warmup_steps=300 optim.schedule=inverse_sqrt model.transformer.d_ff=1024"

# name: config and overrides
declare -A MODELS=(
  [rnn_lstm]="$RNN"
  [rnn_gru]="$RNN model.rnn.cell=gru"
  [rnn_gru_context]="$RNN model.rnn.cell=gru model.rnn.context_every_step=true"
  [rnn_attention_mlp]="$ATTENTION model.rnn.attention=mlp"
  [transformer_rope]="configs/quickstart.yaml $TABLES model.transformer.positions=rope"
  [transformer_sinusoidal]="configs/quickstart.yaml $TABLES model.transformer.positions=sinusoidal"
)
ORDER=(transformer_rope rnn_lstm rnn_gru_context rnn_attention_mlp rnn_gru transformer_sinusoidal)
(($#)) && ORDER=("$@")

run() {  # name: train 10 epochs, then score test with beam 5 and greedy
  local name=$1 dir=$R/$1
  # shellcheck disable=SC2086  # the config and its overrides are words
  $S2S train --config ${MODELS[$name]} $EPOCHS "train.run_dir=$dir"
  if [[ ! -s $dir/test_scores.txt ]]; then
    { time $S2S evaluate -c "$dir/checkpoint_best.pt" --format json > "$dir/test_scores.part" 2> "$dir/eval.log"; } \
      2> "$dir/eval_seconds"
    mv "$dir/test_scores.part" "$dir/test_scores.txt"
  fi
  if [[ ! -s $dir/test_scores_greedy.txt ]]; then
    $S2S evaluate -c "$dir/checkpoint_best.pt" --format json decode.beam_size=1 > "$dir/test_scores_greedy.part"
    mv "$dir/test_scores_greedy.part" "$dir/test_scores_greedy.txt"
  fi
}

for name in "${ORDER[@]}"; do
  [[ -n ${MODELS[$name]:-} ]] || { echo "unknown model: $name (one of ${!MODELS[*]})" >&2; exit 2; }
done
mkdir -p "$R"
lscpu | grep -i '^flags' > "$R/cpu_flags.txt"
for name in "${ORDER[@]}"; do run "$name"; done
seconds=()
for name in "${ORDER[@]}"; do seconds+=("$name=$(cat "$R/$name/eval_seconds")"); done
$PY scripts/lectures_table.py "${ORDER[@]/#/$R/}" --decode-seconds "${seconds[@]}"
