"""Open questions about the Mosaic GPU launches, timed on the GPU.

`launch1` times the package's Mosaic GPU launch 1 (`launch_1_sm90.launch_1`)
per variant: GELU-derivative form, approximate math, pre-activation tile and
pipeline depths. `launch2` times a prototype of launch 2 on Mosaic GPU
(`launch_2_prototype`: split input gradient, grad_fc1_weight) per split and
tile, not yet in the package (benchmarks/NOTES.md, 24). Run on the GPU:

    python -m benchmarks.mosaic_probe --seq-lens 211 --kernels launch2 --launch2-variants 4:256 7:128
    python -m benchmarks.mosaic_probe --seq-lens 211 256 --kernels launch1 \
        [--launch1-variants one_exp_rsqrt tanh:exact:64x64x64 ...]

The earlier TF32 and F16 GEMM prototypes of this probe (`--kernels plain
persistent chained transposing converting`, NOTES.md 17, 19 and 22) gave way
to the package's GEMM engine (`vision_mlp_bwd/backends/mosaic/engine.py`,
timed against cuBLAS by `benchmarks/engine.py`); NOTES.md 28 names the last
commit that has them.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.timing import device_times_us
from vision_mlp_bwd.backends.mosaic import launch_1_sm90


def launch_1_probe(seq_lens, h, i, variants):
  """The package's Mosaic GPU launch 1 (`launch_1_sm90.launch_1`, F16) per variant and S.

  A variant is `(gelu form, approx_math, pre_tile, stages, weight_grad_stages)`
  (`benchmarks/gelu_forms.py` names the forms). The figures in
  results/probes/mosaic/mosaic_probe_launch1*_h200.json came from its prototype (commits
  6a3ebfd, 9bd6650), which took the GELU derivative precomputed; compare with
  the Triton launch 1 that `tune --variants default` reports as
  mlp_backward_1."""
  from benchmarks import gelu_forms
  from vision_mlp_bwd.reference import gelu_tanh_grad
  rows = []
  for s in seq_lens:
    keys = jax.random.split(jax.random.key(s), 4)
    pad = [(0, launch_1_sm90.padded_rows(s) - s), (0, 0)]
    g16 = jnp.pad(jax.random.normal(keys[0], (s, h)).astype(jnp.float16), pad)
    w2 = jax.random.normal(keys[1], (h, i)) / 36
    x = jax.random.normal(keys[2], (s, i))
    gelu16 = jnp.pad(jax.random.normal(keys[3], (s, i)).astype(jnp.float16), pad)
    f32 = lambda v: v.astype(jnp.float32)
    exact_pre = jnp.dot(f32(g16), f32(w2.astype(jnp.float16)),
                        precision=lax.Precision.HIGHEST)[:s] * gelu_tanh_grad(x)
    exact_wg = jnp.dot(f32(g16).T, f32(gelu16), precision=lax.Precision.HIGHEST)
    for form, approx_math, pre_tile, stages, weight_grad_stages in variants:
      gelu_forms.use(form)
      default_tile, default_stages = launch_1_sm90.pre_tiling(s)
      pre_tile, stages = pre_tile or default_tile, stages or default_stages
      label = (f"{form}{'' if approx_math else ' exact'} pre {pre_tile} st{stages}, "
               f"weight grad st{weight_grad_stages}")
      fn = jax.jit(functools.partial(launch_1_sm90.launch_1, stages=stages,
                                     weight_grad_stages=weight_grad_stages,
                                     pre_tile=pre_tile, approx_math=approx_math))
      try:
        pre, wg = fn(g16, w2, x, gelu16)
        errors = [float(jnp.linalg.norm(f32(out) - exact) / jnp.linalg.norm(exact))
                  for out, exact in ((pre, exact_pre), (wg, exact_wg))]
        max_error = float(jnp.max(jnp.abs(f32(pre) - exact_pre)))
      except Exception as e:  # noqa: BLE001 - e.g. shared memory: report, go on
        print(f"  S={s} {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
              flush=True)
        continue
      us = device_times_us(fn, g16, w2, x, gelu16).median_us
      rows.append(dict(name="f16_launch_1", s=s, kernel=label, us=us, errors=errors,
                       pre_max_error=max_error))
      print(f"S={s:4d} {label:60s} {us:6.1f} us  errors {errors[0]:.2e} {errors[1]:.1e} "
            f"max {max_error:.2e}", flush=True)
  gelu_forms.use(None)
  return rows


def launch_2_prototype(grad_pre16, fc1_weight, hidden16, *, split_k, tile=(256, 64, 64),
                       stages=3, weight_grad_stages=4):
  """Launch 2 as one Mosaic GPU grid, without its bias sums: `(partials, grad_fc1_weight)`.

  The input gradient `grad_pre16 @ fc1_weight` comes as `split_k` partial sums over
  I, `[split_k * rows, H]` fp32 (rows: S rounded up to `tile`'s), each block one
  tile of one split with `launch_1_sm90`'s converting pipeline; the caller sums
  them. The other blocks each compute one `[128, 128]` tile of
  `grad_fc1_weight = grad_pre16.T @ hidden16` as launch 1 does grad_fc2_weight.
  What it measures: whether a Mosaic launch 2 beats Triton's (25 us at F16
  S=211, benchmarks/NOTES.md 24) before a deterministic in-kernel split sum is
  built for it."""
  (rows_in, i), h = grad_pre16.shape, fc1_weight.shape[1]
  dtype = grad_pre16.dtype
  pm, pn, pk = tile
  gm, gn = pl.cdiv(rows_in, pm), h // pn
  k_len = i // split_k
  assert k_len * split_k == i and k_len % pk == 0, (i, split_k, pk)
  n_input = gm * gn * split_k
  wm, wn, _ = launch_1_sm90.WEIGHT_GRAD_TILE

  def kernel(x_gmem, w_gmem, z_gmem, partial_gmem, weight_grad_gmem):
    block = lax.axis_index("block")

    @pl.when(block < n_input)
    def _():
      split, r, c = block // (gm * gn), block % gm, (block // gm) % gn
      ks, cols = pl.ds(split * k_len, k_len), pl.ds(c * pn, pn)

      def tile_(acc_ref, b16):
        launch_1_sm90.converted_weight_product(acc_ref, b16, x_gmem.at[pl.ds(r * pm, pm), ks],
                                             w_gmem.at[ks, cols], stages)
        launch_1_sm90.write_tile(acc_ref[...],
                              partial_gmem.at[pl.ds((split * gm + r) * pm, pm), cols])

      pl.run_scoped(tile_, plgpu.ACC((pm, pn), jnp.float32),
                    plgpu.SMEM((2, pk, pn), dtype, transforms=launch_1_sm90.swizzled_tiles(dtype)))

    @pl.when(block >= n_input)
    def _():
      job = block - n_input
      rows, cols = pl.ds((job % (i // wm)) * wm, wm), pl.ds((job // (i // wm)) * wn, wn)
      launch_1_sm90.weight_grad_tile(x_gmem.at[:, rows], z_gmem.at[:, cols],
                                   weight_grad_gmem.at[rows, cols], weight_grad_stages)

  return plgpu.kernel(
      kernel, out_type=(jax.ShapeDtypeStruct((split_k * gm * pm, h), jnp.float32),
                        jax.ShapeDtypeStruct((i, h), jnp.float32)),
      grid=(n_input + (i // wm) * (h // wn),), grid_names=("block",),
  )(grad_pre16, fc1_weight, hidden16)


def launch_2_probe(seq_lens, h, i, variants):
  """`launch_2_prototype` (F16) per `(split_k, tile rows)` and S: the kernel alone, and with
  the XLA sum of its partials."""
  rows = []
  for s in seq_lens:
    keys = jax.random.split(jax.random.key(s), 3)
    pad = [(0, launch_1_sm90.padded_rows(s) - s), (0, 0)]
    pre16 = jnp.pad((jax.random.normal(keys[0], (s, i)) / 4).astype(jnp.float16), pad)
    w1 = jax.random.normal(keys[1], (i, h)) / 60
    x16 = jnp.pad(jax.random.normal(keys[2], (s, h)).astype(jnp.float16), pad)
    f32 = lambda v: v.astype(jnp.float32)
    exact_in = jnp.dot(f32(pre16), f32(w1.astype(jnp.float16)),
                       precision=lax.Precision.HIGHEST)[:s]
    exact_wg = jnp.dot(f32(pre16).T, f32(x16), precision=lax.Precision.HIGHEST)
    for split_k, tile_rows in variants:
      label = f"split {split_k}, {tile_rows}x64 input-gradient tiles"
      kernel = jax.jit(functools.partial(launch_2_prototype, split_k=split_k,
                                         tile=(tile_rows, 64, 64),
                                         stages=3 if tile_rows == 256 else 4))

      def summed(a, b, c, kernel=kernel, split_k=split_k):
        partials, wg = kernel(a, b, c)
        return partials.reshape(split_k, -1, h)[:, :s].sum(0), wg

      try:
        grad_in, wg = jax.jit(summed)(pre16, w1, x16)
        errors = [float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
                  for out, exact in ((grad_in, exact_in), (wg, exact_wg))]
      except Exception as e:  # noqa: BLE001 - e.g. shared memory: report, go on
        print(f"  S={s} {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
              flush=True)
        continue
      alone = device_times_us(kernel, pre16, w1, x16).median_us
      total = device_times_us(jax.jit(summed), pre16, w1, x16).median_us
      rows.append(dict(name="f16_launch_2", s=s, kernel=label, us=alone, with_sum_us=total,
                       errors=errors))
      print(f"S={s:4d} {label:40s} {alone:6.1f} us, with the XLA sum {total:6.1f} us  "
            f"errors {errors[0]:.1e} {errors[1]:.1e}", flush=True)
  return rows


def _launch_1_variants(text):
  """`form[:exact][:MxNxK[:stages[:weight_grad_stages]]]`, e.g. `tanh:exact:256x64x64:3:4`.

  `exact` turns `approx_math` off; a missing tile or depth is `launch_1`'s
  default (`launch_1_sm90.pre_tiling`)."""
  parts = text.split(":")
  approx = "exact" not in parts
  form, *rest = [p for p in parts if p != "exact"]
  tile, stages, weight_grad_stages = (rest + [None, None, "4"][len(rest):])[:3]
  return (form, approx, tile and tuple(int(d) for d in tile.split("x")),
          stages and int(stages), int(weight_grad_stages))


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[211, 256])
  parser.add_argument("--kernels", nargs="+", default=["launch1"], choices=["launch1", "launch2"])
  parser.add_argument("--launch1-variants", type=_launch_1_variants, nargs="+",
                      default=[_launch_1_variants("no_cancellation")],
                      help="form[:exact]:MxNxK:stages:weight_grad_stages, for --kernels launch1")
  parser.add_argument("--launch2-variants", nargs="+", default=["4:256"],
                      help="split_k:tile_rows, for --kernels launch2")
  parser.add_argument("--out", default=os.environ.get("RESULTS_DIR", "."))
  args = parser.parse_args()
  h, i = 1280, 3584
  launch_2_variants = [tuple(map(int, v.split(":"))) for v in args.launch2_variants]
  probes = {"launch1": lambda: launch_1_probe(args.seq_lens, h, i, args.launch1_variants),
            "launch2": lambda: launch_2_probe(args.seq_lens, h, i, launch_2_variants)}
  for name in dict.fromkeys(args.kernels):
    rows = probes[name]()
    with open(os.path.join(args.out, f"mosaic_probe_{name}.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
