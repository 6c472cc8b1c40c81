#!/usr/bin/env bash
# The one prepared check for the day a GPU (or TPU) is lent, within ~10 minutes (570 s of steps):
# kernel tests on the device, kernel GB/s against the copy-bandwidth roofline and JAX's shipped
# kernel, golden parity of the default model, step throughput of a Llama-3-8B-shaped model on
# random weights at 1/8/64/256 sequences, one served request. One JSON line per step in
# <out>/device_check.jsonl, each step's output in <out>/<step>.log (benchmarks/device_check.py
# says what each step runs).
#
#   bash benchmarks/device_check.sh              # on the device; results in $OUT, else benchmarks/results/device_check
#   bash benchmarks/device_check.sh --rehearse   # the same steps on this CPU at tiny sizes
#   PYTHON=/path/to/python bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
ARGS=("$@")
if [ -n "${OUT:-}" ]; then ARGS+=(--out "$OUT"); fi
exec "$PY" benchmarks/device_check.py "${ARGS[@]}"
