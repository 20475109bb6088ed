"""`python -m benchmarks.engine`: the Mosaic GEMM engine against cuBLAS on the backward's products.

For each S and each of the four products of the backward (f16 operands
already in HBM, in the layouts the backward has them, fp32 output), this
times cuBLAS (an XLA `dot_general`, which reads transposed operands in place)
and the engine (`vision_mlp_bwd.backends.mosaic.engine.matmul`) over a few
configurations, in the same run: CUPTI device time, L2 flushed before every
call, median (`benchmarks/timing.py`). Each engine result is checked first
against the componentwise bound |C - C_ref| <= 2 γ_K (|A| |B|) of two fp32
accumulations of the same exact products, and for bitwise equality of two
calls. Writes `engine_<device>_<date>.{json,md}`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import cases, timing
from benchmarks.run import result_stem
from vision_mlp_bwd.backends.mosaic import backward_sm90, engine

C = engine.GemmConfig
# name -> (M, K, N as functions of S, H, I; A transposed?)
PRODUCTS = {
    "grad_output @ fc2_weight": (lambda s, h, i: (s, h, i), False),
    "grad_output.T @ gelu_output": (lambda s, h, i: (h, s, i), True),
    "grad_pre @ fc1_weight": (lambda s, h, i: (s, i, h), False),
    "grad_pre.T @ hidden_state": (lambda s, h, i: (i, s, h), True),
}
CONFIGS = {   # block (rows x columns), contraction step, stages, ...; "fN": N wgmma groups
    # left in flight; "eRxC": epilogue pieces; "tN": the last wave's blocks split along K
    # into up to N parts. The tables' configs (backends/mosaic/configs/h200.json):
    "128x128 k64 st6 f1 e64x32 t16": C(tile_n=64, stages=6, mma_in_flight=1,
                                       epilogue_tile=(64, 32), tail_splits=16),
    "128x128 k64 st5 f1 e64x64 t16": C(tile_n=64, stages=5, mma_in_flight=1,
                                       epilogue_tile=(64, 64), tail_splits=16),
    "128x256 k64 st3 minor-m t16": C(stages=3, grid_minor="m", tail_splits=16),
}


def dims(transpose_a: bool):
  """dot_general dimension numbers of op(a) @ b, with a stored [K, M] when transposed."""
  return (((0,), (0,)), ((), ())) if transpose_a else (((1,), (0,)), ((), ()))


def reference_and_bound(a, b, transpose_a: bool):
  """cuBLAS's fp32-accumulated op(a) @ b, and the componentwise bound 2 γ_K (|op(a)| |b|)
  within which any other fp32 accumulation of the same exact products lies from it."""
  k = a.shape[0] if transpose_a else a.shape[1]
  ref = lax.dot_general(a, b, dims(transpose_a), preferred_element_type=jnp.float32)
  magnitude = lax.dot_general(jnp.abs(a).astype(jnp.float32), jnp.abs(b).astype(jnp.float32),
                              dims(transpose_a), precision=lax.Precision.HIGHEST)
  u = 2.0 ** -24   # fp32 unit roundoff
  return ref, 2 * (k * u / (1 - k * u)) * magnitude


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.engine", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
  parser.add_argument("--variants", nargs="*", default=[],
                      help="more configs, as JSON objects of GemmConfig fields (named by the JSON)")
  parser.add_argument("--products", nargs="+", choices=list(PRODUCTS), default=list(PRODUCTS))
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--out", default=os.path.join("benchmarks", "results", "probes", "engine"))
  args = parser.parse_args(argv)
  h, i = cases.HIDDEN, cases.INTERMEDIATE
  configs = {label: CONFIGS[label] for label in args.configs}
  for text in args.variants:
    configs[text] = C(**backward_sm90.config_fields(json.loads(text)))
  rows = []
  for s in args.seq_lens:
    for name in args.products:
      shape, transpose_a = PRODUCTS[name]
      m, k, n = shape(s, h, i)
      ka, kb = jax.random.split(jax.random.key(s * 7 + len(rows)))
      a = jax.random.normal(ka, (k, m) if transpose_a else (m, k), jnp.float16)
      b = jax.random.normal(kb, (k, n), jnp.float16)
      cublas = jax.jit(lambda a, b, d=dims(transpose_a): lax.dot_general(
          a, b, d, preferred_element_type=jnp.float32))
      ref, bound = reference_and_bound(a, b, transpose_a)
      flops = 2 * m * n * k
      us = timing.device_times_us(cublas, a, b, iterations=args.iterations).median_us
      row = dict(seq_len=s, product=name, m=m, k=k, n=n, cublas_us=us,
                 cublas_tflops=flops / us / 1e6, engine={})
      print(f"S={s:6d} {name:30s} cuBLAS {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
      for label, config in configs.items():
        fn = jax.jit(functools.partial(engine.matmul, transpose_a=transpose_a, config=config))
        try:
          out = fn(a, b)
          excess = float(jnp.max(jnp.abs(out - ref) - bound))
          if not excess <= 0:
            print(f"    {label:28s} WRONG: exceeds the bound by {excess:.3e}", flush=True)
            row["engine"][label] = dict(error="exceeds bound")
            continue
          if not bool(jnp.array_equal(out, fn(a, b))):
            print(f"    {label:28s} WRONG: two calls differ", flush=True)
            row["engine"][label] = dict(error="not deterministic")
            continue
          us = timing.device_times_us(fn, a, b, iterations=args.iterations).median_us
        except Exception as e:  # noqa: BLE001 - a config that does not fit: report, go on
          print(f"    {label:28s} {type(e).__name__}: {str(e).splitlines()[0][:160]}", flush=True)
          row["engine"][label] = dict(error=type(e).__name__)
          continue
        plan = engine.schedule(m, n, k, config, engine.num_sms())
        row["engine"][label] = dict(us=us, tflops=flops / us / 1e6, whole_blocks=plan.whole,
                                    tail_blocks=plan.tail, tail_splits=plan.splits)
        print(f"    {label:34s} {us:8.1f} us {flops / us / 1e6:6.0f} TFLOP/s "
              f"({row['cublas_us'] / us:.2f}x cuBLAS; {plan.whole} whole blocks, {plan.tail} "
              f"in {plan.splits} parts)", flush=True)
      rows.append(row)
  stem, date = result_stem(args.out, "engine")
  md = [f"# Mosaic GEMM engine against cuBLAS ({jax.devices()[0].device_kind}, {date}, "
        f"jax {jax.__version__}; f16 operands, fp32 output; µs, CUPTI, cold L2, median)", "",
        "| S | product (M, K, N) | cuBLAS | engine, best | config | × cuBLAS |",
        "|---|---|---|---|---|---|"]
  for r in rows:
    timed = {k: v["us"] for k, v in r["engine"].items() if "us" in v}
    best = min(timed, key=timed.get) if timed else None
    md.append(f"| {r['seq_len']} | {r['product']} ({r['m']}, {r['k']}, {r['n']}) | "
              f"{r['cublas_us']:.1f} | " + (f"{timed[best]:.1f} | {best} | "
                                            f"{r['cublas_us'] / timed[best]:.2f} |" if best
                                            else "— | — | — |"))
  with open(stem + ".json", "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, date=date, jax=jax.__version__,
                   commit=os.environ.get("GIT_COMMIT", "unknown"), rows=rows), f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write("\n".join(md) + "\n")
  print("\n".join(md))


if __name__ == "__main__":
  main()
