#!/usr/bin/env bash
# Proves the CUDA path on a machine with a GPU; says so and exits 0 where there is none.
#
# 1. the equivalence tests parametrized by device (tests/conftest.py `device`) on CUDA, then the whole suite;
# 2. the quickstart config for 300 updates in fp32, bf16 and fp16 (gradient scaler) on CUDA;
# 3. translate and evaluate of the fp32 run on CUDA, and serve answering one request on CUDA;
# 4. the peer suite's training and decoding against HF on the GPU, where ../shared/bench-peers exists.
# Everything is written to $OUT (default runs/gpu_check); the summary is $OUT/summary.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
PY=.venv/bin/python
S2S=.venv/bin/seq2seq
if ! $PY -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check: no CUDA device: nothing to check (torch $($PY -c 'import torch; print(torch.__version__)'))"
  exit 0
fi
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }
note "device: $($PY -c 'import torch; print(torch.cuda.get_device_name(0), "torch", torch.__version__)')"

note "== tests"
if $PY -m pytest -q -k cuda -rs > "$OUT/tests_cuda.log" 2>&1; then note "equivalence tests on CUDA: $(tail -1 "$OUT/tests_cuda.log")"; else note "equivalence tests on CUDA FAILED: $(grep -E '^FAILED' "$OUT/tests_cuda.log" | head -5 | tr '\n' ' ')"; fi
if $PY -m pytest -q -x > "$OUT/tests.log" 2>&1; then note "tests: $(tail -1 "$OUT/tests.log")"; else note "tests FAILED: $(tail -1 "$OUT/tests.log")"; fi

note "== quickstart, 300 updates on CUDA"
SEQ2SEQ_DATA_MIRROR=${SEQ2SEQ_DATA_MIRROR:-../shared/data/multi30k} $S2S download --langs de,en --dest data/multi30k
for precision in fp32 bf16 fp16; do
  run="$OUT/quickstart_$precision"
  rm -rf "$run"
  if $S2S train --config configs/quickstart.yaml "train.run_dir=$run" train.device=cuda "train.precision=$precision" \
      train.max_steps=300 train.max_minutes=0 > "$OUT/train_$precision.log" 2>&1; then
    note "train $precision: $(grep -o 'step 300: valid .*' "$run/train.log" | tail -1)"
  else
    note "train $precision FAILED: $(tail -1 "$OUT/train_$precision.log")"
  fi
done

note "== translate / evaluate / serve on CUDA"
ckpt="$OUT/quickstart_fp32/checkpoint_best.pt"
printf 'Ein Mann fährt Fahrrad.\nZwei Hunde spielen im Schnee.\n' | $S2S translate -c "$ckpt" --device cuda > "$OUT/translate.txt"
note "translate: $(tr '\n' '|' < "$OUT/translate.txt")"
$S2S evaluate -c "$ckpt" --device cuda > "$OUT/evaluate.txt" 2>&1 && note "evaluate: $(head -1 "$OUT/evaluate.txt")"
port=$($PY -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
$S2S serve -c "$ckpt" --device cuda --port "$port" > "$OUT/serve.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true' EXIT
answer=""
for _ in $(seq 120); do
  answer=$(curl -s -X POST "http://127.0.0.1:$port/translate" -H 'content-type: application/json' \
    -d '{"text": ["Ein Mann fährt Fahrrad."]}' || true)
  [ -n "$answer" ] && break
  sleep 1
done
note "serve: ${answer:-no answer (see $OUT/serve.log)}"

if [ -d ../shared/bench-peers ]; then
  note "== peer suite on the GPU"
  bash ../shared/bench-peers/setup.sh > "$OUT/peers_setup.log" 2>&1 || note "peer setup failed (see $OUT/peers_setup.log)"
  P=${PEERS_VENV:-$HOME/.cache/peers-venv}/bin/python
  SEQ2SEQ_SRC=$PWD $P ../shared/bench-peers/train_interleaved.py --config tiny --peers train_seq2seq,train_hf \
    > "$OUT/peers_train.txt" 2>&1 && note "peers train: $(tail -2 "$OUT/peers_train.txt" | tr '\n' ' ')"
  SEQ2SEQ_SRC=$PWD $P ../shared/bench-peers/decode_interleaved.py --config tiny --beam 5 \
    > "$OUT/peers_decode.txt" 2>&1 && note "peers decode: $(tail -2 "$OUT/peers_decode.txt" | tr '\n' ' ')"
fi
note "gpu_check: done; summary in $SUMMARY"
