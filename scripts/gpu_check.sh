#!/usr/bin/env bash
# Proves the CUDA path on a machine with a GPU; says so and exits 0 where there is none.
#
# 1. the equivalence tests parametrized by device (tests/conftest.py `device`) on CUDA;
# 2. the quickstart config for $STEPS updates (default 300) in each of $PRECISIONS (default fp32, bf16 and
#    fp16 with its gradient scaler) on CUDA, with the median training tok/s of each;
# 3. `seq2seq train` against its own update step on the same batches (scripts/bench/bench_train.py --compare trainer)
#    with the model FLOPs utilisation, for the quickstart, the en-de recipe and a 6+6 d512 shape, fp32 and bf16,
#    and the quickstart (fp32) and the 6+6 shape (bf16) with train.compile in its default and CUDA-graph modes;
#    then translate and evaluate of the fp32 run on CUDA, and serve answering one request on CUDA;
# 4. greedy and beam 5 decoding against HF `generate` on the GPU, same model and batches (64 sentences, 1,000);
# 5. the whole test suite last, since it is the longest and mostly runs on the CPU.
# Everything is written to $OUT (default runs/gpu_check); the summary is $OUT/summary.txt.
#
# PYTHON and SEQ2SEQ name an interpreter that already has the package (for a machine with its own
# CUDA build of torch and no network); without them the project's .venv is used, made if missing.
# PYTEST_ARGS adds arguments to the whole-suite run (default: `-n 8` where pytest-xdist is installed). That run
# logs every test's outcome as it ends (-v), so a run stopped by a time limit still names what failed so far.
# The peer suite (../shared/bench-peers) is not run here: its adapters train and decode on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} && ! -x .venv/bin/python ]]; then bash scripts/setup.sh; fi
PY=${PYTHON:-.venv/bin/python}
S2S=${SEQ2SEQ:-.venv/bin/seq2seq}
STEPS=${STEPS:-300}
PRECISIONS=${PRECISIONS:-fp32 bf16 fp16}
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device: nothing to check (torch $($PY -c 'import torch; print(torch.__version__)'))"
  exit 0
fi
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "device: $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__, "cuda", torch.version.cuda)')"

note "== equivalence tests on CUDA"
if $PY -m pytest -q -p no:cacheprovider -k cuda -rs > "$OUT/tests_cuda.log" 2>&1; then
  note "equivalence tests on CUDA: $(grep -E '(passed|failed)' "$OUT/tests_cuda.log" | tail -1)"
else
  note "equivalence tests on CUDA FAILED: $(grep -E '^(FAILED|ERROR)' "$OUT/tests_cuda.log" | head -8 | tr '\n' ' ')"
fi

note "== quickstart, $STEPS updates on CUDA"
SEQ2SEQ_DATA_MIRROR=${SEQ2SEQ_DATA_MIRROR:-../shared/data/multi30k} $S2S download --langs de,en --dest data/multi30k
median_tok_s() {  # the median training tokens/s of a run's metrics.jsonl
  $PY -c "import json, statistics, sys
rates = [r['tokens_per_s'] for r in map(json.loads, open(sys.argv[1])) if r.get('event') == 'train']
print(f'{statistics.median(rates):.0f} tok/s (median of {len(rates)})' if rates else 'no tok/s logged')" "$1"
}
# The same model in each precision: the quickstart's by_precision block would widen d_ff to 1,024 in bf16
QS_WIDTH=model.transformer.d_ff=512
for precision in $PRECISIONS; do
  run="$OUT/quickstart_$precision"
  rm -rf "$run"
  if $S2S train --config configs/quickstart.yaml "train.run_dir=$run" train.device=cuda "train.precision=$precision" $QS_WIDTH \
      "train.max_steps=$STEPS" train.max_minutes=0 > "$OUT/train_$precision.log" 2>&1; then
    note "train $precision: $(grep -o "step $STEPS: valid .*" "$run/train.log" | tail -1); $(median_tok_s "$run/metrics.jsonl")"
  else
    note "train $precision FAILED: $(tail -3 "$OUT/train_$precision.log" | tr '\n' ' ')"
  fi
done

note "== seq2seq train against its own update step on CUDA (scripts/bench/bench_train.py --compare trainer)"
bench_trainer() {  # LABEL ARGS...: the loop's share of its update step's tok/s, and the model FLOPs utilisation
  local label=$1
  shift
  if $PY scripts/bench/bench_train.py --device cuda --compare trainer --rounds 5 --steps 20 "$@" \
      > "$OUT/bench_$label.log" 2>&1; then
    note "$label: $(grep -E 'median:|model FLOPs|^ratio' "$OUT/bench_$label.log" | sed 's/^ *//' | tr '\n' ' ')"
  else
    note "$label FAILED: $(tail -3 "$OUT/bench_$label.log" | tr '\n' ' ')"
  fi
}
BASE=(model.d_model=512 model.transformer.n_heads=8 model.transformer.d_ff=2048 model.transformer.encoder_layers=6
  model.transformer.decoder_layers=6 train.max_tokens=16384)
for precision in fp32 bf16; do
  bench_trainer "quickstart_$precision" --config configs/quickstart.yaml --set "train.precision=$precision" $QS_WIDTH
  bench_trainer "en_de_$precision" --config configs/m30k_en_de.yaml --set "train.precision=$precision"
  bench_trainer "base_$precision" --config configs/quickstart.yaml --set "train.precision=$precision" "${BASE[@]}"
done
# train.compile: bounded batch shapes, a graph each (compile times in the log); CUDA graphs with reduce-overhead
for mode in default reduce-overhead; do
  bench_trainer "quickstart_fp32_compile_$mode" --config configs/quickstart.yaml --set train.precision=fp32 \
    "train.compile=$mode"
  bench_trainer "base_bf16_compile_$mode" --config configs/quickstart.yaml --set train.precision=bf16 \
    "train.compile=$mode" "${BASE[@]}"
done

note "== translate / evaluate / serve on CUDA"
ckpt="$OUT/quickstart_fp32/checkpoint_best.pt"
if printf 'Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n' | $S2S translate -c "$ckpt" --device cuda \
    > "$OUT/translate.txt" 2> "$OUT/translate.log"; then
  note "translate: $(tr '\n' '|' < "$OUT/translate.txt")"
else
  note "translate FAILED: $(tail -3 "$OUT/translate.log" | tr '\n' ' ')"
fi
if $S2S evaluate -c "$ckpt" --device cuda > "$OUT/evaluate.txt" 2> "$OUT/evaluate.log"; then
  note "evaluate: $(head -1 "$OUT/evaluate.txt")"
else
  note "evaluate FAILED: $(tail -3 "$OUT/evaluate.log" | tr '\n' ' ')"
fi
port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$S2S serve -c "$ckpt" --device cuda --port "$port" > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
answer=""
for _ in $(seq 120); do
  kill -0 $server 2>/dev/null || break
  answer=$(curl -s -X POST "http://127.0.0.1:$port/translate" -H 'content-type: application/json' \
    -d '{"text": ["Ein Mann fährt Fahrrad."]}' || true)
  [[ -n $answer ]] && break
  sleep 1
done
note "serve: ${answer:-no answer: $(tail -2 "$OUT/serve.log" | tr '\n' ' ')}"
kill $server 2>/dev/null || true

note "== decoding on CUDA against HF generate (scripts/bench/bench_decode.py --compare engines)"
# The peer benchmark's shapes (random weights, post-norm: what a Marian directory holds), every hypothesis
# exactly 32 tokens + EOS, the same val sentences in the same batches for both: 64 sentences, then all 1,000 at once.
if $PY -c "import transformers" 2> /dev/null; then
  for batch in 64 1000; do
    if $PY scripts/bench/bench_decode.py --compare engines --device cuda --systems pytorch,hf \
        -c "$ckpt" --src data/multi30k/val.de.gz -n 1000 --shapes tiny,small --shape-length 32 \
        --batch-sentences $batch --rounds 3 --json "$OUT/decode_b$batch.json" > "$OUT/decode_b$batch.log" 2>&1; then
      note "decode, batches of $batch: $(grep -E '^(tiny|small) |^pytorch |^hf ' "$OUT/decode_b$batch.log" | tr -s ' ' | tr '\n' '|')"
    else
      note "decode, batches of $batch FAILED: $(tail -3 "$OUT/decode_b$batch.log" | tr '\n' ' ')"
    fi
  done
else
  note "decode against HF generate: skipped (transformers is not installed: pip install -e \".[hf]\")"
fi

note "== the whole suite"
if [[ -z ${PYTEST_ARGS+set} ]] && $PY -c "import xdist" 2> /dev/null; then PYTEST_ARGS="-n 8"; fi
# shellcheck disable=SC2086  # PYTEST_ARGS is words
if $PY -m pytest -v -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/tests.log" 2>&1; then
  note "tests: $(grep -E '(passed|failed)' "$OUT/tests.log" | tail -1)"
else
  note "tests FAILED: $(grep -E ' (FAILED|ERROR) ' "$OUT/tests.log" | head -30 | tr '\n' ' ') $(grep -E '(passed|failed)' "$OUT/tests.log" | tail -1)"
fi
note "gpu_check: done; summary in $SUMMARY"
