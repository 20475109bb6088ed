"""The GELU derivative's forms that were timed, to time them again.

`use(form)` puts one in place of the shared derivative
(`reference.gelu_tanh_grad`) in the Triton and Mosaic GPU kernels (for `tune`
and `mosaic_probe`), so the same kernels run with only the elementwise
epilogue changed. "tanh" is the contract's formula as written;
"one_exp_rsqrt" the package's form until 2026-12 (r = rsqrt(1 + exp(-2u))^2,
r (1 - r) formed by cancellation: fp32 error up to 5.4e-6 on some CPUs);
"no_cancellation" the package's form from 2026-12 (benchmarks/NOTES.md, 25), and two
variants of it that timed the same in the Mosaic launch 1; "folded", the package's
form now: the same terms with the constants folded into fewer instructions (NOTES 66,
68; a variant with 1 / (1 + t) as rsqrt((1 + t)^2) was 0.5 us ahead alone at
S=4096 and 2.6 us behind in the backward at 16384).
"""

from __future__ import annotations

import contextlib

import jax.numpy as jnp
from jax import lax

from vision_mlp_bwd import reference
from vision_mlp_bwd.reference import GELU_CUBIC, SQRT_2_OVER_PI


def contract_tanh_form(x):
  """The contract's derivative as written: 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x), t = tanh u."""
  t = jnp.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x))
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * SQRT_2_OVER_PI * (1 + 3 * GELU_CUBIC * x * x)


def one_exp_rsqrt_form(x):
  """r + r (1 - r) u'(x) with r = rsqrt(1 + exp(-2u))^2 (the package's form until 2026-12)."""
  x2 = x * x
  e = jnp.exp(x * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x2))
  r = jnp.square(lax.rsqrt(1.0 + e))
  slope = x * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x2)
  return r + r * (slope * (1.0 - r))


def no_cancellation_form(x):
  """The package's form from NOTES 25 until the constants were folded (NOTES 68):
  t = exp(-2|u|), p = 1 / (1 + t), r + t p^2 x u'(x) * 2."""
  x2 = x * x
  t = jnp.exp(jnp.abs(x) * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x2))
  p = 1.0 / (1.0 + t)
  r = jnp.where(x >= 0, p, t * p)
  q = t * p * p
  return r + (q * x) * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x * x)


def clamped_exp_form(x):
  """No cancellation without |x| or a select: e = exp(min(-2u, 80)), r = 1 / (1 + e) as
  rsqrt((1 + e)^2) (0 where that overflows), r (1 - r) = e r^2."""
  e = jnp.exp(jnp.minimum(x * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x * x), 80.0))
  r = lax.rsqrt((1.0 + e) * (1.0 + e))
  return r + (e * r * r * x) * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x * x)


def shared_tp_form(x):
  """The package's form with t p computed once and 1 / (1 + t) as rsqrt((1 + t)^2)."""
  t = jnp.exp(jnp.abs(x) * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x * x))
  p = lax.rsqrt((1.0 + t) * (1.0 + t))
  tp = t * p
  return (jnp.where(x >= 0, p, tp)
          + (tp * p * x) * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x * x))


FORMS = {"tanh": contract_tanh_form, "one_exp_rsqrt": one_exp_rsqrt_form,
         "no_cancellation": no_cancellation_form,
         "clamped_exp": clamped_exp_form, "shared_tp": shared_tp_form,
         "folded": reference.gelu_tanh_grad}
PACKAGE_FORM = reference.gelu_tanh_grad


def use(form: str | None) -> None:
  """Makes the kernels compute the GELU derivative as `FORMS[form]`; None: the package's own.

  The engine's epilogues call `reference.gelu_backward`, which looks the derivative up
  in `reference` when traced, so that name is replaced too (and the XLA path follows).
  """
  from vision_mlp_bwd.backends.mosaic import launch_1_sm90
  from vision_mlp_bwd.backends.triton import kernels
  fn = PACKAGE_FORM if form is None else FORMS[form]
  kernels.gelu_tanh_grad = launch_1_sm90.gelu_derivative = reference.gelu_tanh_grad = fn


@contextlib.contextmanager
def using(form: str | None):
  """`use(form)` for the kernels traced inside, then the package's form again."""
  use(form)
  try:
    yield
  finally:
    use(None)


def kernel_errors(n_rows: int = 8192):
  """Max |error| against float64 of each form on [-12, 12], computed by XLA, a Triton
  kernel and a Mosaic GPU kernel (approx_math on and off), on the GPU.

  The kernels load fp32 tiles as the backward's epilogues do (Mosaic: swizzled
  tiles in wgmma's register layout, `launch_1_sm90.load_wgmma`) and apply the form.
  """
  import numpy as np
  import jax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax.experimental.pallas import triton as pl_triton

  from vision_mlp_bwd.backends.mosaic import launch_1_sm90

  x = np.linspace(-12, 12, n_rows * 128, dtype=np.float32).reshape(n_rows, 128)
  with jax.enable_x64():
    exact = np.asarray(contract_tanh_form(jnp.asarray(x, jnp.float64)))
  rows = []
  for name, form in FORMS.items():
    def triton(x_ref, o_ref, form=form):
      o_ref[...] = form(x_ref[...])

    def mosaic(x_gmem, o_gmem, form=form):
      block = pl.ds(jax.lax.axis_index("block") * 128, 128)

      def tile(x_smem, arrived):
        plgpu.copy_gmem_to_smem(x_gmem.at[block], x_smem, arrived)
        plgpu.barrier_wait(arrived)
        launch_1_sm90.write_tile(form(launch_1_sm90.load_wgmma(x_smem)), o_gmem.at[block])

      pl.run_scoped(tile, plgpu.SMEM((128, 128), jnp.float32,
                                     transforms=launch_1_sm90.swizzled_tiles(jnp.float32)),
                    plgpu.Barrier(num_arrivals=1))

    out = jax.ShapeDtypeStruct(x.shape, jnp.float32)
    runs = {"xla": jax.jit(form),
            "triton": pl.pallas_call(triton, out_shape=out, grid=(n_rows // 64,),
                                     in_specs=[pl.BlockSpec((64, 128), lambda i: (i, 0))],
                                     out_specs=pl.BlockSpec((64, 128), lambda i: (i, 0)),
                                     compiler_params=pl_triton.CompilerParams(num_warps=4))}
    for approx in (True, False):
      runs[f"mosaic{'_approx' if approx else ''}"] = plgpu.kernel(
          mosaic, out_type=out, grid=(n_rows // 128,), grid_names=("block",),
          compiler_params=plgpu.CompilerParams(approx_math=approx))
    for backend, fn in runs.items():
      error = np.abs(np.asarray(fn(jnp.asarray(x)), np.float64) - exact)
      worst = int(error.argmax())
      rows.append(dict(form=name, backend=backend, max_abs_error=float(error.max()),
                       at=float(x.flat[worst])))
      print(f"{name:16s} {backend:14s} max |error| {error.max():.2e} at x = {x.flat[worst]:+.4f}",
            flush=True)
  return rows


if __name__ == "__main__":
  import json
  import sys
  results = kernel_errors()
  if len(sys.argv) > 1:
    with open(sys.argv[1], "w") as f:
      json.dump(results, f, indent=1)
