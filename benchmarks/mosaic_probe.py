"""Open questions about the Mosaic GPU launch 1, timed on the GPU.

`launch1` times the package's Mosaic GPU launch 1 (`launch_1_sm90.launch_1`)
per variant: GELU-derivative form, approximate math, pre-activation tile and
pipeline depths. Run on the GPU:

    python -m benchmarks.mosaic_probe --seq-lens 211 256 --kernels launch1 \
        [--launch1-variants one_exp_rsqrt tanh:exact:64x64x64 ...]

A launch 2 prototype on Mosaic GPU (`--kernels launch2`, NOTES.md 24h: 5 us
under Triton's launch 2 at S=211 before the sum of its split partials, which
it left to XLA) did not ship; commit e9931c8 is the last to have it.

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
  parser.add_argument("--kernels", nargs="+", default=["launch1"], choices=["launch1"])
  parser.add_argument("--launch1-variants", type=_launch_1_variants, nargs="+",
                      default=[_launch_1_variants("no_cancellation")],
                      help="form[:exact]:MxNxK:stages:weight_grad_stages, for --kernels launch1")
  parser.add_argument("--out", default=os.environ.get("RESULTS_DIR", "."))
  args = parser.parse_args()
  h, i = 1280, 3584
  probes = {"launch1": lambda: launch_1_probe(args.seq_lens, h, i, args.launch1_variants)}
  for name in dict.fromkeys(args.kernels):
    rows = probes[name]()
    with open(os.path.join(args.out, f"mosaic_probe_{name}.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                indent=1)


if __name__ == "__main__":
  main()
