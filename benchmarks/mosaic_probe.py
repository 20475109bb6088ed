"""How fast is a plain Pallas Mosaic-GPU TF32 matmul with K-major operands on this GPU?

The question behind a Hopper backend for TF32 (benchmarks/NOTES.md, 16-17):
fp32 wgmma wants both operands K-major, which in our backward means
transposed copies of the weights (and of the small `[S, ·]` activations).
This times, per seed S, each of the backward's four products computed as
`A[M, K] @ B[N, K].T` by one pipelined wgmma kernel, beside XLA's TF32 dot of
the same operands and XLA's transpose of a weight. Run on the GPU:

    python -m benchmarks.mosaic_probe --seq-lens 128 256
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.timing import device_times_us

SWIZZLE = 128                 # bytes: one 128-byte row of fp32 is 32 elements
TILE_K = SWIZZLE // 4


def k_major_matmul(a, b, *, tile_m, tile_n, stages):
  """`a @ b.T` for fp32 `a [M, K]`, `b [N, K]` (M, N, K multiples of the tiles) on wgmma."""
  (m, k), (n, _) = a.shape, b.shape
  transforms = (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(SWIZZLE))

  def kernel(a_gmem, b_gmem, o_gmem, o_smem):
    rows = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    cols = pl.ds(lax.axis_index("n") * tile_n, tile_n)

    def product(acc_ref):
      def step(_, a_smem, b_smem):
        plgpu.wgmma(acc_ref, a_smem, plgpu.transpose_ref(b_smem, (1, 0)))
        plgpu.wgmma_wait(1)

      plgpu.emit_pipeline(
          step, grid=(k // TILE_K,), max_concurrent_steps=stages,
          in_specs=[plgpu.BlockSpec((tile_m, TILE_K), lambda s: (0, s), transforms=transforms,
                                    delay_release=1),
                    plgpu.BlockSpec((tile_n, TILE_K), lambda s: (0, s), transforms=transforms,
                                    delay_release=1)],
      )(a_gmem.at[rows], b_gmem.at[cols])
      return acc_ref[...]

    o_smem[...] = pl.run_scoped(product, plgpu.ACC((tile_m, tile_n), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
      scratch_types=[plgpu.SMEM((tile_m, tile_n), jnp.float32, transforms=transforms)],
      grid=(m // tile_m, n // tile_n), grid_names=("m", "n"))(a, b)


def products(s, h, i):
  """The backward's four products as (name, M, N, K), all operands K-major."""
  return [("pre", s, i, h), ("input_grad", s, h, i), ("fc2_weight_grad", h, i, s),
          ("fc1_weight_grad", i, h, s)]


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--out", default=os.environ.get("OUT", "."))
  args = parser.parse_args()
  h, i = 1280, 3584
  rows = []
  w = jax.random.normal(jax.random.key(0), (h, i))
  t = device_times_us(jax.jit(lambda x: x.T), w)
  print(f"XLA transpose of a [{h}, {i}] weight: {t.median_us:.1f} us", flush=True)
  rows.append(dict(name="xla_transpose_weight", us=t.median_us))
  for s in args.seq_lens:
    for name, m, n, k in products(s, h, i):
      a = jax.random.normal(jax.random.key(1), (m, k))
      b = jax.random.normal(jax.random.key(2), (n, k)) / 30
      exact = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
      xla = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ()))))
      flops = 2 * m * n * k
      best = (float("inf"), None)
      for tile_m, tile_n, stages in itertools.product((64, 128), (64, 128, 256), (2, 4)):
        if m % tile_m or n % tile_n:
          continue
        fn = jax.jit(functools.partial(k_major_matmul, tile_m=tile_m, tile_n=tile_n,
                                       stages=stages))
        try:
          out = fn(a, b)
        except Exception as e:  # noqa: BLE001 - shared memory limits, lowering gaps
          print(f"  {name} S={s} {tile_m}x{tile_n} st{stages}: {type(e).__name__}: "
                f"{(str(e).splitlines() or [repr(e)])[0][:160]}", flush=True)
          continue
        error = float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
        us = device_times_us(fn, a, b).median_us
        rows.append(dict(name=name, s=s, tile=(tile_m, tile_n), stages=stages, us=us,
                         error=error))
        best = min(best, (us, (tile_m, tile_n, stages, error)))
      x = device_times_us(xla, a, b).median_us
      rows.append(dict(name=name, s=s, xla_us=x))
      print(f"S={s:4d} {name:16s} M={m} N={n} K={k}: mosaic {best[0]:6.1f} us "
            f"({flops / best[0] / 1e6:5.0f} TFLOP/s, tile/stages/error {best[1]}), "
            f"XLA TF32 {x:6.1f} us", flush=True)
  with open(os.path.join(args.out, "mosaic_probe.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()
