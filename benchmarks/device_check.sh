#!/usr/bin/env bash
# The one prepared check for the day a GPU (or TPU) is lent, in one call of ~9 minutes (540 s of
# steps): the device's copy bandwidth and bfloat16 matmul rate, Llama-3-8B bfloat16 step
# throughput on random weights made on the device at 1/8/64/256 sequences and a 2,048-token
# prefill (each cell's bytes against the HBM and copy bandwidths), a per-kernel profile of one
# decode step at 1 and 64 sequences, a served run (1/16/64 concurrent streams, 1,024 tokens in,
# 128 out), speculative decoding's step times (plain, n-gram verifying and EAGLE-3 drafting steps
# of the default model at 1/4/16 sequences, with the speed-ups they predict), the kernel benchmark, the kernel tests on the device and golden parity. One JSON
# line per step in <out>/device_check.jsonl, each step's output in <out>/<step>.log
# (benchmarks/device_check.py says what each step runs).
#
#   bash benchmarks/device_check.sh              # on the device; results in benchmarks/results/device_check_<chip>/
#   OUT=/some/dir bash benchmarks/device_check.sh  # results in $OUT, packed: device_check.jsonl + one .tar.gz
#   bash benchmarks/device_check.sh --rehearse   # the same steps on this CPU at tiny sizes
#   PYTHON=/path/to/python bash benchmarks/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
ARGS=("$@")
if [ -n "${OUT:-}" ]; then ARGS+=(--out "$OUT" --pack); fi
exec "$PY" benchmarks/device_check.py "${ARGS[@]}"
