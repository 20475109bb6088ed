"""Pure-`jnp` forward and backward of the vision MLP: the oracle for every test.

Layouts follow torch `nn.Linear` (and the SOL-ExecBench contract): weights are
`[out_features, in_features]`, so `fc1_weight` is `[I, H]` and `fc2_weight` is
`[H, I]`. Activations are `[S, H]` / `[S, I]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vision_mlp_bwd.precision import DotMode, canonicalize, for_inputs, xla_dot_general

SQRT_2_OVER_PI = 0.7978845608028654
GELU_CUBIC = 0.044715
# -2 sqrt(2/pi) log2(e) and its product with 0.044715: exp(-2|u|) as one exp2
_EXP2_LINEAR = -2.0 * SQRT_2_OVER_PI * 1.4426950408889634
_EXP2_CUBIC = _EXP2_LINEAR * GELU_CUBIC

# dot_general dimension numbers for the four products of the MLP.
_ROWS_TIMES_WEIGHT_T = (((1,), (1,)), ((), ()))   # [S,K] x [N,K] -> [S,N]
_ROWS_TIMES_WEIGHT = (((1,), (0,)), ((), ()))    # [S,K] x [K,N] -> [S,N]
_COLUMNS_OUTER = (((0,), (0,)), ((), ()))         # [S,M] x [S,N] -> [M,N]


def gelu_tanh(x):
  """tanh-approximate GELU, as `jax.nn.gelu(x, approximate=True)`."""
  return 0.5 * x * (1.0 + jnp.tanh(SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x)))


def gelu_tanh_grad(x):
  """d gelu_tanh(x) / dx: the contract's derivative, rewritten with one exp and no cancellation.

  With u = sqrt(2/pi) (x + 0.044715 x^3), t = exp(-2|u|) <= 1 and p = 1 / (1 + t),
  the contract's 0.5 (1 + tanh u) + 0.5 x (1 - tanh(u)^2) u'(x) is exactly
  r + q x * 2 sqrt(2/pi) (1 + 3 * 0.044715 x^2), where r = (1 + tanh u) / 2 is p
  for u >= 0 and t p for u < 0, and q = r (1 - r) = t p^2. No term is formed
  by subtracting nearly equal numbers (`1 - r` was, for x >~ 3), and t <= 1
  cannot overflow. t is one exp2 with the constants folded in (-2 sqrt(2/pi)
  log2(e) and its product with 0.044715): fewer instructions in the kernels'
  epilogues (benchmarks/NOTES.md, 66 and 68). In fp32 it is within 5e-7 of the
  float64 value on [-12, 12] whichever exp XLA's CPU backend picks
  (tests/test_gelu.py). The last factor keeps the contract's (3 * 0.044715 x) x,
  so it overflows to NaN where that formula does (|x| >~ 5e19, x = +-inf) and
  keeps the limits 0 and 1 elsewhere. Shared by the reference and every kernel
  (plain `jnp`, so it traces inside Pallas too); computed in the dtype of `x`,
  and kernels pass fp32.
  """
  x2 = x * x
  t = jnp.exp2(jnp.abs(x) * (x2 * _EXP2_CUBIC + _EXP2_LINEAR))
  p = 1.0 / (1.0 + t)
  tp = t * p
  return (jnp.where(x >= 0, p, tp)
          + ((tp * p * x) * (2.0 * SQRT_2_OVER_PI)) * ((3.0 * GELU_CUBIC * x) * x + 1.0))


def mlp_forward(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *, precision=None):
  """Returns `(output, fc1_output, gelu_output)` for `hidden_state` of shape `[S, H]`.

  Each product runs as `precision` means to `jnp.matmul` on these inputs
  (`precision.for_inputs`) and, like `jnp.matmul`, returns the input dtype
  (accumulated in fp32); the bias, the GELU and the activations follow in
  the input dtype, as in the same model written with jnp.
  """
  dtype = hidden_state.dtype
  mode = for_inputs(canonicalize(precision), dtype)
  # The bias is added in the input dtype, as jnp adds it (one rounding of the exact sum
  # either way), so XLA can fold it into the product's epilogue.
  fc1_output = (xla_dot_general(hidden_state, fc1_weight, _ROWS_TIMES_WEIGHT_T, mode, dtype)
                + fc1_bias.astype(dtype))
  gelu_output = gelu_tanh(fc1_output.astype(jnp.float32)).astype(dtype)
  output = (xla_dot_general(gelu_output, fc2_weight, _ROWS_TIMES_WEIGHT_T, mode, dtype)
            + fc2_bias.astype(dtype))
  return output, fc1_output, gelu_output


def jnp_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *, precision=None):
  """The model as a JAX user writes it, for jax's own autodiff:
  `jax.nn.gelu(x @ fc1_weight.T + fc1_bias, approximate=True) @ fc2_weight.T + fc2_bias`
  on `hidden_state` `[..., H]`, each product as `precision` means to `jnp.matmul`."""
  dtype = hidden_state.dtype
  mode = for_inputs(canonicalize(precision), dtype)
  rows = hidden_state.reshape(-1, hidden_state.shape[-1])
  # `w.T` spelled out as jnp spells it, so that XLA sees the very program plain jnp gives.
  fc1_output = xla_dot_general(rows, fc1_weight.T, _ROWS_TIMES_WEIGHT, mode, dtype) + fc1_bias
  output = xla_dot_general(jax.nn.gelu(fc1_output, approximate=True), fc2_weight.T,
                           _ROWS_TIMES_WEIGHT, mode, dtype) + fc2_bias
  return output.reshape(*hidden_state.shape[:-1], -1)


def pre_activation_grad(grad_output, fc2_weight, fc1_output, mode: DotMode):
  """`grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output)`, fp32.

  The product comes in the input dtype, as `jnp.matmul` returns it (on 16-bit
  inputs it is rounded there once before the GELU derivative multiplies it,
  as in jnp's autodiff; on fp32 inputs it stays fp32)."""
  grad_gelu = xla_dot_general(grad_output, fc2_weight, _ROWS_TIMES_WEIGHT, mode,
                              grad_output.dtype)
  return gelu_backward(grad_gelu, fc1_output)


def gelu_backward(grad_gelu, fc1_output):
  """`grad_gelu * gelu'(fc1_output)` in fp32, whatever the dtypes of the two."""
  return grad_gelu.astype(jnp.float32) * gelu_tanh_grad(fc1_output.astype(jnp.float32))


def pre_gelu_operand_and_bias_grad(grad_fc1_output, mode: DotMode, dtype):
  """(what the two products read of the fp32 pre-GELU gradient, `grad_fc1_bias` in fp32).

  On 16-bit inputs (`dtype`), as in jnp's autodiff, the gradient is stored in
  the input dtype and the bias gradient sums what is stored: the products'
  operand. On fp32 inputs the bias gradient sums the fp32 values, and 16-bit
  modes round the operand once for both products.
  """
  if jnp.dtype(dtype).itemsize == 2:
    operand = grad_fc1_output.astype(mode.operand_dtype)
    return operand, jnp.sum(operand.astype(jnp.float32), axis=0)
  bias_grad = jnp.sum(grad_fc1_output, axis=0)
  if mode.operand_dtype is not None:
    grad_fc1_output = grad_fc1_output.astype(mode.operand_dtype)
  return grad_fc1_output, bias_grad


def input_grad(grad_fc1_output, fc1_weight, mode: DotMode, out_dtype=jnp.float32):
  """`grad_hidden_state = grad_fc1_output @ fc1_weight`, as `out_dtype`."""
  return xla_dot_general(grad_fc1_output, fc1_weight, _ROWS_TIMES_WEIGHT, mode, out_dtype)


def weight_grad(rows_a, rows_b, mode: DotMode, out_dtype=jnp.float32):
  """`rows_a.T @ rows_b`, the contraction over the S rows of a weight gradient."""
  return xla_dot_general(rows_a, rows_b, _COLUMNS_OUTER, mode, out_dtype)


def mlp_backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                 fc1_output, gelu_output, *, precision=None):
  """The five gradients of the SOL-ExecBench contract, in its order.

  Returns `(grad_hidden_state, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight,
  grad_fc2_bias)`, each in the dtype of the input it is the gradient of.
  Accumulation is fp32; `precision` says how each product is computed.
  """
  # The biases are not read, only their dtypes. On 16-bit inputs the products
  # read the pre-GELU gradient rounded to that dtype (`precision.for_inputs`).
  mode: DotMode = for_inputs(canonicalize(precision), hidden_state.dtype)
  dtype = jnp.dtype(hidden_state.dtype)   # every input's, and every gradient's
  grad_fc2_bias = jnp.sum(grad_output.astype(jnp.float32), axis=0)
  grad_fc2_weight = weight_grad(grad_output, gelu_output, mode, dtype)
  grad_fc1_output, grad_fc1_bias = pre_gelu_operand_and_bias_grad(
      pre_activation_grad(grad_output, fc2_weight, fc1_output, mode), mode, dtype)
  grad_fc1_weight = weight_grad(grad_fc1_output, hidden_state, mode, dtype)
  grad_hidden_state = input_grad(grad_fc1_output, fc1_weight, mode, dtype)
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias.astype(dtype), grad_fc2_weight,
          grad_fc2_bias.astype(dtype))
