"""`python -m benchmarks.engine_shapes`: the engine at ragged shapes, each case in its own process.

For each (M, K, N, transposed A, config, output dtype), runs `engine.matmul` on
fresh f16 operands and checks every element against the componentwise bound
2 γ_K (|A| |B|) of cuBLAS's fp32-accumulated product; a case that faults the
GPU (or that the engine refuses) is reported as CRASH without taking the
others down. Prints one line per case (and writes nothing): a check of where
the engine is correct, not a timing.
"""

from __future__ import annotations

import json
import subprocess
import sys

CASES = [  # M, K, N, transpose_a, GemmConfig fields, out dtype
    (1280, 4096, 3584, True, dict(tile_n=64, stages=6, mma_in_flight=1, epilogue_tile=(64, 32),
                                  tail_splits=16), "float32"),
    (256, 1280, 3584, False, dict(tile_n=64, stages=5), "float32"),
    (216, 1280, 3584, False, dict(tile_n=64, stages=5), "float32"),
    (64, 1280, 3584, False, dict(tile_n=64, stages=5), "float32"),
    (8, 1280, 3584, False, dict(tile_n=64, stages=5), "float32"),
    (1280, 256, 3584, True, dict(tile_n=64, stages=6), "float32"),
    (1280, 216, 3584, True, dict(tile_n=64, stages=6), "float32"),
    (1280, 8, 3584, True, dict(tile_n=64, stages=6), "float32"),
    (1280, 8, 3584, True, dict(tile_n=64, stages=6, mma_in_flight=1, epilogue_tile=(64, 32),
                               tail_splits=16), "float32"),
    (1280, 64, 3584, True, dict(tile_n=64, stages=6, mma_in_flight=1, epilogue_tile=(64, 32),
                                tail_splits=16), "float32"),
    (1280, 128, 3584, True, dict(tile_n=64, stages=6, mma_in_flight=1, epilogue_tile=(64, 32),
                                 tail_splits=16), "float32"),
    (64, 1280, 3584, False, dict(tile_n=64, stages=6, mma_in_flight=1, epilogue_tile=(64, 32),
                                 tail_splits=16), "float32"),
    (64, 1280, 3584, False, dict(tile_n=64, stages=5, tail_splits=4), "float32"),
    (64, 1280, 3584, False, dict(tile_n=64, stages=5, tail_splits=2), "float32"),
    (1280, 4096, 3584, True, dict(tile_n=64, stages=5, mma_in_flight=1, epilogue_tile=(64, 64),
                                  tail_splits=16), "bfloat16"),
    (4096, 1280, 3584, False, dict(stages=3, grid_minor="m", tail_splits=16), "bfloat16"),
]


def run_case(index):
  import jax
  import jax.numpy as jnp
  from benchmarks.engine import reference_and_bound
  from vision_mlp_bwd.backends.mosaic import engine
  m, k, n, transpose_a, fields, out_dtype = CASES[index]
  config = engine.GemmConfig(**fields)
  ka, kb = jax.random.split(jax.random.key(index))
  a = jax.random.normal(ka, (k, m) if transpose_a else (m, k), jnp.float16)
  b = jax.random.normal(kb, (k, n), jnp.float16)
  out = jax.jit(lambda a, b: engine.matmul(a, b, transpose_a=transpose_a, config=config,
                                           out_dtype=out_dtype))(a, b).astype(jnp.float32)
  ref, bound = reference_and_bound(a, b, transpose_a)
  if out_dtype != "float32":   # plus one rounding of the output
    bound = bound + jnp.abs(ref) * 2.0 ** -(8 if out_dtype == "bfloat16" else 11)
  excess = float(jnp.max(jnp.abs(out - ref) - bound))
  plan = engine.schedule(m, n, k, config, engine.num_sms())
  return dict(ok=bool(excess <= 0), excess=excess, splits=plan.splits, tail=plan.tail)


def main():
  if len(sys.argv) == 2:
    print(json.dumps(run_case(int(sys.argv[1]))))
    return
  chosen = [int(i) for i in sys.argv[2:]] if sys.argv[1:2] == ["--cases"] else range(len(CASES))
  for index in chosen:
    case = CASES[index]
    done = subprocess.run([sys.executable, "-m", "benchmarks.engine_shapes", str(index)],
                          capture_output=True, text=True, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    status = ("PASS" if result["ok"] else f"WRONG by {result['excess']:.2e}") if result else (
        "CRASH: " + (done.stderr.strip().splitlines() or ["?"])[-1][:150])
    print(f"{case[:4]} {case[4]} {case[5]}: {status}"
          + (f" (tail {result['tail']} in {result['splits']} parts)" if result else ""),
          flush=True)


if __name__ == "__main__":
  main()
