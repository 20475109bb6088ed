"""Other ways to write the GELU derivative, to time against `reference.gelu_tanh_grad`.

`use(form)` puts one in place of the shared derivative in the Triton and
Mosaic GPU kernels (for `tune` and `mosaic_probe`), so the same kernels run
with only the elementwise epilogue changed. Each form is the contract's
derivative rewritten exactly: with u = sqrt(2/pi) (x + 0.044715 x^3) and
r = sigmoid(2u) = (1 + tanh u) / 2, gelu'(x) = r (1 + 2 sqrt(2/pi) x
(1 + 3 * 0.044715 x^2) (1 - r)), one exp instead of a tanh.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from vision_mlp_bwd import reference
from vision_mlp_bwd.reference import GELU_CUBIC, SQRT_2_OVER_PI


def _one_exp(x, reciprocal):
  x2 = x * x
  e = jnp.exp(x * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x2))
  r = reciprocal(1.0 + e)
  slope = x * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x2)
  return r + r * (slope * (1.0 - r))


FORMS = {
    "tanh": reference.gelu_tanh_grad,
    # r as a division
    "one_exp": lambda x: _one_exp(x, lambda y: 1.0 / y),
    # r as rsqrt squared: rsqrt(inf) = 0 keeps the x -> -inf limit
    "one_exp_rsqrt": lambda x: _one_exp(x, lambda y: jnp.square(lax.rsqrt(y))),
}


def use(form: str) -> None:
  """Makes the kernels compute the GELU derivative as `FORMS[form]`."""
  from vision_mlp_bwd.backends import mosaic_gpu
  from vision_mlp_bwd.backends.triton import kernels
  kernels.gelu_tanh_grad = mosaic_gpu.gelu_tanh_grad = FORMS[form]
