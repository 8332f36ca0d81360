#!/usr/bin/env bash
# Run the tests that train models (`-m trains`) once per CPU kind this CPU can emulate, and say which kind failed what.
#
# What a model learns moves with the kernels, and the kernels move with the CPU: a test that holds on one machine
# can fail on another. PyTorch, oneDNN and MKL each let a process use fewer instructions than the CPU has, so one
# machine can run the tests as the other kinds would:
#   default  no vector kernels (ATEN_CPU_CAPABILITY=default, oneDNN SSE4.1, MKL SSE4.2, CTranslate2 generic);
#            `precision: auto` is fp32
#   avx2     an AVX2-only CPU (AMD EPYC without AVX-512, older Intel); `precision: auto` is fp32
#   avx512   AVX-512 with native bf16 where the CPU has it, without AMX (AMD EPYC with AVX512-BF16)
# The native kind is what `bash scripts/check.sh` runs. Kinds run side by side, one thread each, JOBS at a time
# (default: the number of cores). Usage: bash scripts/cpu_kinds.sh [KIND...] [-- PYTEST_ARGS...]
# Logs go to ${CPU_KINDS_LOGS:-/tmp/seq2seq-cpu-kinds}/KIND.log; exit status 1 when any kind failed.
set -euo pipefail
cd "$(dirname "$0")/.."

flags=$(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null || true)
has() { [[ " $flags " == *" $1 "* ]]; }

supported=(default)
has avx2 && supported+=(avx2)
has avx512f && has avx512bw && has avx512vl && has avx512dq && supported+=(avx512)

kinds=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do kinds+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
[ ${#kinds[@]} -gt 0 ] || kinds=("${supported[@]}")
for kind in "${kinds[@]}"; do
  if [[ " ${supported[*]} " != *" $kind "* ]]; then
    echo "cpu_kinds: this CPU cannot run kind '$kind' (it can run: ${supported[*]})" >&2
    exit 2
  fi
done

kind_env() {  # the environment variables that make this process a CPU of the given kind
  case "$1" in
    default)
      echo "ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=SSE41 MKL_ENABLE_INSTRUCTIONS=SSE4_2 CT2_FORCE_CPU_ISA=GENERIC" ;;
    avx2) echo "ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 CT2_FORCE_CPU_ISA=AVX2" ;;
    avx512)
      local isa=AVX512_CORE
      has avx512_bf16 && isa=AVX512_CORE_BF16
      echo "ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=$isa MKL_ENABLE_INSTRUCTIONS=AVX512 CT2_FORCE_CPU_ISA=AVX512" ;;
  esac
}

logs=${CPU_KINDS_LOGS:-/tmp/seq2seq-cpu-kinds}
mkdir -p "$logs"
jobs_max=${JOBS:-$(nproc 2>/dev/null || echo 1)}
echo "cpu_kinds: CPU flags: $(echo "$flags" | grep -o -w -E 'avx2|avx512f|avx512_bf16|amx_bf16|amx_tile' | sort -u | tr '\n' ' ')"
echo "cpu_kinds: kinds ${kinds[*]}, $jobs_max at a time, logs in $logs"

PYTEST_WITH_SIGINT='import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])'
declare -A pids=()
start=$SECONDS
for kind in "${kinds[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do sleep 1; done
  # A job started with & in a script inherits SIGINT ignored, which the signal tests' commands would inherit in
  # turn: the interpreter restores the default before it runs pytest, as a terminal would have it.
  # shellcheck disable=SC2046  # kind_env's words are separate assignments
  env $(kind_env "$kind") OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 .venv/bin/python -c "$PYTEST_WITH_SIGINT" \
    -m "trains and not slow" -q -p no:cacheprovider -o addopts="" --basetemp="$logs/$kind.tmp" "$@" \
    >"$logs/$kind.log" 2>&1 &
  pids[$kind]=$!
  echo "cpu_kinds: $kind started ($(kind_env "$kind"))"
done

failed=()
for kind in "${kinds[@]}"; do
  if wait "${pids[$kind]}"; then status=passed; else status=FAILED; failed+=("$kind"); fi
  echo "cpu_kinds: $kind $status: $(tail -n 1 "$logs/$kind.log")"
  grep -E '^(FAILED|ERROR) ' "$logs/$kind.log" | sed "s/^/cpu_kinds:   $kind: /" || true
done
echo "cpu_kinds: $(( SECONDS - start )) s; $([ ${#failed[@]} -eq 0 ] && echo "every kind passed" || echo "failed: ${failed[*]}")"
[ ${#failed[@]} -eq 0 ]
