#!/usr/bin/env bash
# One-shot kernel check on whatever accelerator this machine has, within ~8 minutes:
#   GPU: the GPU kernel tests compiled on the device (pytest --kernel-device), then the kernel
#        benchmark (reference vs gpu kernel vs JAX's shipped Pallas GPU paged_attention).
#   TPU: the same with the TPU kernel tests and benchmark.
#   none: the interpret-mode subset of both kernels' tests and the benchmark at tiny sizes.
# Results (logs, junit XML, kernels.jsonl) go to $OUT if set, else benchmarks/results/.
#
#   bash benchmarks/device_check.sh            # PYTHON=/path/to/python to override
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
RES=${OUT:-benchmarks/results}
mkdir -p "$RES"
LOG="$RES/device_check.log"
: > "$LOG"
say() { echo "[device_check $(date +%H:%M:%S)] $*" | tee -a "$LOG"; }

# Detect the backend with JAX's own default (an inherited JAX_PLATFORMS=cpu is dropped).
BACKEND=$(env -u JAX_PLATFORMS timeout 120 "$PY" -c \
  "import jax; print(jax.default_backend())" 2>>"$LOG" | tail -1)
BACKEND=${BACKEND:-cpu}
say "backend: $BACKEND  python: $PY"
env -u JAX_PLATFORMS timeout 60 "$PY" -c \
  "import jax; print(jax.__version__, jax.devices())" >>"$LOG" 2>&1
command -v nvidia-smi >/dev/null && nvidia-smi -L >>"$LOG" 2>&1

status=0
run() {  # run <seconds> <name> <cmd...>: time-boxed, output to $LOG and $RES/<name>.log
  local secs=$1 name=$2; shift 2
  say "start $name (limit ${secs}s): $*"
  timeout "$secs" "$@" >"$RES/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$RES/$name.log" >>"$LOG"
  say "end $name rc=$rc"
  [ $rc -eq 0 ] || status=1
}

case "$BACKEND" in
  gpu)
    run 270 gpu_kernel_tests env -u JAX_PLATFORMS "$PY" -m pytest -q -p no:cacheprovider \
      tests/pallas_kernels/test_gpu_kernel.py --kernel-device \
      --junitxml="$RES/gpu_kernel_tests.xml"
    run 180 kernel_benchmark env -u JAX_PLATFORMS "$PY" benchmarks/kernel_benchmark.py \
      --out "$RES/kernels.jsonl"
    ;;
  tpu)
    run 270 tpu_kernel_tests env -u JAX_PLATFORMS "$PY" -m pytest -q -p no:cacheprovider \
      tests/pallas_kernels/test_tpu_kernel.py --kernel-device \
      --junitxml="$RES/tpu_kernel_tests.xml"
    run 180 kernel_benchmark env -u JAX_PLATFORMS "$PY" benchmarks/kernel_benchmark.py \
      --out "$RES/kernels.jsonl"
    ;;
  *)
    say "no GPU/TPU: interpret-mode subset at small sizes"
    run 200 kernel_tests_interpret env JAX_PLATFORMS=cpu "$PY" -m pytest -q \
      -p no:cacheprovider tests/pallas_kernels/test_gpu_kernel.py \
      tests/pallas_kernels/test_tpu_kernel.py -k "random_ragged_batches or lowers" \
      --junitxml="$RES/kernel_tests_interpret.xml"
    run 150 kernel_benchmark env JAX_PLATFORMS=cpu "$PY" benchmarks/kernel_benchmark.py \
      --small --impls reference gpu-interpret --out "$RES/kernels.jsonl"
    ;;
esac
say "done, status=$status (results in $RES)"
exit $status
