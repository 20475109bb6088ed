#!/usr/bin/env bash
# Everything that needs the GPU, in one call (the order used on the H200):
# GPU tests, memcheck, the benchmark suite, the bf16 subset and the Flax step
# time. Writes logs and results under ${OUT:-benchmarks/results/run}; set
# GIT_COMMIT when the tree is a copy without git history. About 12 minutes on an
# H200: through the device tool (10 minutes a call) split it across two calls.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-benchmarks/results/run}
mkdir -p "$out/main" "$out/bf16"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{
  python3 -m pytest tests/test_gpu.py tests/test_gpu_acceptance.py -q -p no:cacheprovider --tb=short
  compute-sanitizer --tool memcheck --print-limit 5 python3 -m tests.sanitize_run 1 131 293 | tail -3
  python3 -m benchmarks.run --out "$out/main"
  python3 -m benchmarks.run --precisions bf16 --seq-lens 64 128 131 211 256 --out "$out/bf16"
  python3 examples/train_vit.py --gpu-compare --tokens 256,1024 --batch 1 --steps 20 --warmup 5
} 2>&1 | grep -v DeprecationWarning | tr '\r' '\n' | grep -v "run/s\|s/run\|it/s" | tee "$out/h200.log"
rm -f "$out"/*/*latest*   # the dated copies are the record
