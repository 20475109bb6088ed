"""Pure-`jnp` forward and backward of the vision MLP: the oracle for every test.

Layouts follow torch `nn.Linear` (and the SOL-ExecBench contract): weights are
`[out_features, in_features]`, so `fc1_weight` is `[I, H]` and `fc2_weight` is
`[H, I]`. Activations are `[S, H]` / `[S, I]`.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from vision_mlp_bwd.precision import DotMode, canonicalize, xla_dot_general

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715

# dot_general dimension numbers for the four products of the MLP.
_ROWS_TIMES_WEIGHT_T = (((1,), (1,)), ((), ()))   # [S,K] x [N,K] -> [S,N]
_ROWS_TIMES_WEIGHT = (((1,), (0,)), ((), ()))    # [S,K] x [K,N] -> [S,N]
_COLUMNS_OUTER = (((0,), (0,)), ((), ()))         # [S,M] x [S,N] -> [M,N]


def gelu_tanh(x):
  """tanh-approximate GELU, as `jax.nn.gelu(x, approximate=True)`."""
  return 0.5 * x * (1.0 + jnp.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)))


def gelu_tanh_grad(x):
  """d gelu_tanh(x) / dx: the contract's derivative, rewritten with one exp and no tanh.

  With u = sqrt(2/pi) (x + 0.044715 x^3) and t = tanh(u), the contract's
  0.5 (1 + t) + 0.5 x (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 x^2) is exactly
  r + r (1 - r) * 2 sqrt(2/pi) x (1 + 3 * 0.044715 x^2), where
  r = (1 + t) / 2 = 1 / (1 + exp(-2u)). r is taken as rsqrt(1 + exp(-2u))^2:
  Mosaic GPU then uses the hardware's exp2 and rsqrt (`approx_math`) where a
  division would be IEEE's, and rsqrt(inf) = 0 keeps the x -> -inf limit. In
  fp32 it is within 2.0e-6 of the float64 value, where the tanh form is within
  3.5e-6 (benchmarks/NOTES.md, 24). Shared by the reference and every kernel
  (it is plain `jnp`, so it traces inside Pallas too); computed in the dtype of
  `x`, and kernels pass fp32.
  """
  x2 = x * x
  e = jnp.exp(x * (-2.0 * SQRT_2_OVER_PI) * (1.0 + GELU_CUBIC * x2))
  r = jnp.square(lax.rsqrt(1.0 + e))
  slope = x * (2.0 * SQRT_2_OVER_PI) * (1.0 + 3.0 * GELU_CUBIC * x2)
  return r + r * (slope * (1.0 - r))


def mlp_forward(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *, precision=None):
  """Returns `(output, fc1_output, gelu_output)` for `hidden_state` of shape `[S, H]`."""
  mode = canonicalize(precision)
  dtype = hidden_state.dtype
  fc1_output = (xla_dot_general(hidden_state, fc1_weight, _ROWS_TIMES_WEIGHT_T, mode)
                + fc1_bias.astype(jnp.float32)).astype(dtype)
  gelu_output = gelu_tanh(fc1_output.astype(jnp.float32)).astype(dtype)
  output = (xla_dot_general(gelu_output, fc2_weight, _ROWS_TIMES_WEIGHT_T, mode)
            + fc2_bias.astype(jnp.float32)).astype(dtype)
  return output, fc1_output, gelu_output


def pre_activation_grad(grad_output, fc2_weight, fc1_output, mode: DotMode):
  """`grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output)`, fp32."""
  grad_gelu = xla_dot_general(grad_output, fc2_weight, _ROWS_TIMES_WEIGHT, mode)
  return grad_gelu * gelu_tanh_grad(fc1_output.astype(jnp.float32))


def input_grad(grad_fc1_output, fc1_weight, mode: DotMode):
  """`grad_hidden_state = grad_fc1_output @ fc1_weight`, fp32."""
  return xla_dot_general(grad_fc1_output, fc1_weight, _ROWS_TIMES_WEIGHT, mode)


def mlp_backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                 fc1_output, gelu_output, *, precision=None):
  """The five gradients of the SOL-ExecBench contract, in its order.

  Returns `(grad_hidden_state, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight,
  grad_fc2_bias)`, each in the dtype of the input it is the gradient of.
  Accumulation is fp32; `precision` says how each product is computed.
  """
  # The biases are not read, only their dtypes.
  mode: DotMode = canonicalize(precision)
  grad_fc2_bias = jnp.sum(grad_output.astype(jnp.float32), axis=0)
  grad_fc2_weight = xla_dot_general(grad_output, gelu_output, _COLUMNS_OUTER, mode)
  grad_fc1_output = pre_activation_grad(grad_output, fc2_weight, fc1_output, mode)
  grad_fc1_bias = jnp.sum(grad_fc1_output, axis=0)
  grad_fc1_weight = xla_dot_general(grad_fc1_output, hidden_state, _COLUMNS_OUTER, mode)
  grad_hidden_state = input_grad(grad_fc1_output, fc1_weight, mode)
  return (
      grad_hidden_state.astype(hidden_state.dtype),
      grad_fc1_weight.astype(fc1_weight.dtype),
      grad_fc1_bias.astype(fc1_bias.dtype),
      grad_fc2_weight.astype(fc2_weight.dtype),
      grad_fc2_bias.astype(fc2_bias.dtype),
  )
