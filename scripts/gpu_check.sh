#!/usr/bin/env bash
# GPU checks in one call: the gpu-marked tests, then the benchmarks. Run from the repo root on a CUDA
# machine; results land under $OUT (default ./out): device.txt, gpu_tests.log, and each benchmark's
# table (.md) and plot (.png). Arguments: "tests" or "bench" to run one half only.
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONPATH=src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
what=${1:-all}
status=0
{ date -u; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv;
  python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; } \
  >"$OUT/device.txt" 2>&1
cat "$OUT/device.txt"
if [ "$what" != bench ]; then
  python3 -m pytest -q -m gpu tests -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
fi
if [ "$what" != tests ]; then
  peer=()
  [ -d .peers/ddtree ] && peer=(--peer official=.peers/ddtree)
  python3 -m kdtree_engine bench tree --out "$OUT" "${peer[@]}" 2>&1 | tee "$OUT/bench_tree.log" || status=1
  python3 -m kdtree_engine bench attention --out "$OUT" 2>&1 | tee "$OUT/bench_attention.log" || status=1
fi
exit $status
