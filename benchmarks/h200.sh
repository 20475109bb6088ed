#!/usr/bin/env bash
# Everything that needs the GPU, in one go (the order used on the H200): GPU
# tests, memcheck, the benchmark suite, the bf16 subset and the Flax step time.
# Writes into the run's dated folder, ${RESULTS_DIR:-benchmarks/results/runs/<UTC date>}:
# h200_<date>.{json,md,png} (the suite), h200_bf16_<date>.* (the bf16 subset) and
# bench_h200_<date>.log (everything printed). Set GIT_COMMIT when the tree is a
# copy without git history. About 12 minutes on an H200; where one job may run
# at most 10 minutes, run the steps in two parts.
set -uo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."
stamp=$(date -u +%Y%m%d-%H%M%S)
dir=${RESULTS_DIR:-benchmarks/results/runs/$(date -u +%Y-%m-%d)}
mkdir -p "$dir/bf16"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
{
  python3 -m pytest tests/test_gpu.py tests/test_gpu_acceptance.py -q -p no:cacheprovider --tb=short
  compute-sanitizer --tool memcheck --print-limit 5 python3 -m tests.sanitize_run 1 131 293 | tail -3
  python3 -m benchmarks.run --out "$dir"
  python3 -m benchmarks.run --precisions bf16 --seq-lens 64 128 131 211 256 --out "$dir/bf16"
  python3 examples/train_vit.py --gpu-compare --tokens 256,1024 --batch 1 --steps 20 --warmup 5
} 2>&1 | grep -v DeprecationWarning | tr '\r' '\n' | grep -v "run/s\|s/run\|it/s" \
  | tee "$dir/bench_h200_$stamp.log"
for f in "$dir"/bf16/h200_2*; do mv "$f" "$dir/h200_bf16_${f##*/h200_}"; done
rm -f "$dir"/h200_latest.* "$dir"/bf16/h200_latest.*   # the dated copies are the record
rmdir "$dir/bf16" 2>/dev/null || true
