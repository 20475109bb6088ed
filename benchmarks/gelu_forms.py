"""The GELU derivative's forms that were timed, to time them again.

`use(form)` puts one in place of the shared derivative
(`reference.gelu_tanh_grad`) in the Triton and Mosaic GPU kernels (for `tune`
and `mosaic_probe`), so the same kernels run with only the elementwise
epilogue changed. "tanh" is the contract's formula as written, which the
package used until the one-exp form ("one_exp_rsqrt", the package's now)
measured faster in the Mosaic launch 1 (benchmarks/NOTES.md, 24). A third
form, r as the division 1 / (1 + exp(-2u)), timed as the tanh form did
(commit 7acd28c).
"""

from __future__ import annotations

import jax.numpy as jnp

from vision_mlp_bwd import reference
from vision_mlp_bwd.reference import GELU_CUBIC, SQRT_2_OVER_PI


def contract_tanh_form(x):
  """The contract's derivative as written: 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x), t = tanh u."""
  x2 = x * x
  t = jnp.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x2 * x))
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x2)


FORMS = {"tanh": contract_tanh_form, "one_exp_rsqrt": reference.gelu_tanh_grad}


def use(form: str) -> None:
  """Makes the kernels compute the GELU derivative as `FORMS[form]`."""
  from vision_mlp_bwd.backends import mosaic_gpu
  from vision_mlp_bwd.backends.triton import kernels
  kernels.gelu_tanh_grad = mosaic_gpu.gelu_tanh_grad = FORMS[form]
