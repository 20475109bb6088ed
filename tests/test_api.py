"""The public API: autodiff through `vision_mlp`, dispatch, and input errors.

Gradients are compared with `jax.grad` of a plain-jnp model (jax.nn.gelu,
HIGHEST precision) or with float64 NumPy; interpret mode computes in true
fp32, so 1e-5 relative error covers fp32 rounding (bf16x3 kernels: 1e-5 by
contract).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vision_mlp_bwd
from vision_mlp_bwd import backends
from vision_mlp_bwd.precision import DotMode, canonicalize
from tests import helpers

HIGHEST = jax.lax.Precision.HIGHEST


def plain_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  """The same model written with jnp and jax.nn.gelu: autodiff is the oracle."""
  x = jnp.matmul(hidden_state, fc1_weight.T, precision=HIGHEST) + fc1_bias
  return jnp.matmul(jax.nn.gelu(x, approximate=True), fc2_weight.T, precision=HIGHEST) + fc2_bias


def params_and_input(batch, hidden=24, intermediate=40):
  inputs = helpers.backward_inputs(None, hidden, intermediate, batch=batch)
  return inputs[1], inputs[2:6]  # hidden_state, (fc1_weight, fc1_bias, fc2_weight, fc2_bias)


def loss_of(mlp, **kwargs):
  def loss(hidden_state, *params):
    out = mlp(hidden_state, *params, **kwargs)
    return jnp.sum(jnp.sin(out))  # a non-trivial cotangent
  return loss


def assert_grads_close(ours, theirs, tolerance=1e-5):
  for i, (a, b) in enumerate(zip(ours, theirs)):
    assert a.shape == b.shape and a.dtype == b.dtype, i
    err = helpers.relative_error(a, b)
    assert err <= tolerance, f"argument {i}: relative error {err:.2e}"


ARGNUMS = (0, 1, 2, 3, 4)


@pytest.mark.parametrize("implementation", ["triton", "xla"])
def test_grad_under_jit_with_batch_dims(implementation):
  hidden_state, params = params_and_input((2, 9))
  ours = jax.jit(jax.grad(loss_of(vision_mlp_bwd.vision_mlp, precision="highest",
                                  implementation=implementation), argnums=ARGNUMS))
  theirs = jax.grad(loss_of(plain_mlp), argnums=ARGNUMS)
  assert_grads_close(ours(hidden_state, *params), theirs(hidden_state, *params))


def test_forward_matches_float64():
  hidden_state, params = params_and_input((11,))
  out = vision_mlp_bwd.vision_mlp(hidden_state, *params, precision="highest")
  assert helpers.relative_error(out, helpers.forward_float64(hidden_state, *params)) < 1e-6


def test_gelu_derivative_is_the_contracts():
  """The one-exp form equals the contract's tanh formula and `jax.grad` of the GELU in float64,
  is within 3e-6 of them in fp32 (the tanh formula's own fp32 error is 3.5e-6), and keeps the
  limits and NaN."""
  from benchmarks.gelu_forms import contract_tanh_form
  from vision_mlp_bwd.reference import gelu_tanh, gelu_tanh_grad
  rng = np.random.default_rng()
  x = np.concatenate([rng.uniform(-12, 12, 200_000), rng.normal(size=100_000)])
  with jax.enable_x64():
    exact = np.asarray(contract_tanh_form(jnp.asarray(x)))
    np.testing.assert_allclose(gelu_tanh_grad(jnp.asarray(x)), exact, rtol=0, atol=1e-13)
    autodiff = jax.vmap(jax.grad(gelu_tanh))(jnp.asarray(x[:1000]))
    np.testing.assert_allclose(autodiff, exact[:1000], rtol=0, atol=1e-13)
  x32 = x.astype(np.float32)
  with jax.enable_x64():
    exact32 = np.asarray(contract_tanh_form(jnp.asarray(x32, jnp.float64)))
  assert np.abs(np.asarray(gelu_tanh_grad(jnp.asarray(x32))) - exact32).max() < 3e-6
  ends = np.asarray(gelu_tanh_grad(jnp.asarray([-1e4, -30.0, 30.0, 1e4, np.nan], jnp.float32)))
  np.testing.assert_array_equal(ends[:4], [0.0, 0.0, 1.0, 1.0])
  assert np.isnan(ends[4])


def test_value_and_grad_and_checkpoint():
  hidden_state, params = params_and_input((13,))
  loss = jax.checkpoint(loss_of(vision_mlp_bwd.vision_mlp, precision="highest",
                                implementation="triton"))
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS))(hidden_state, *params)
  ref_value, ref_grads = jax.value_and_grad(loss_of(plain_mlp), argnums=ARGNUMS)(hidden_state,
                                                                                 *params)
  np.testing.assert_allclose(value, ref_value, rtol=1e-5)
  assert_grads_close(grads, ref_grads)


def test_vmap_over_a_batch_of_inputs():
  hidden_state, params = params_and_input((3, 7))
  per_example = jax.vmap(jax.grad(loss_of(vision_mlp_bwd.vision_mlp, precision="highest",
                                          implementation="triton"), argnums=ARGNUMS),
                         in_axes=(0, None, None, None, None))
  reference = jax.vmap(jax.grad(loss_of(plain_mlp), argnums=ARGNUMS),
                       in_axes=(0, None, None, None, None))
  assert_grads_close(per_example(hidden_state, *params), reference(hidden_state, *params))


def test_automatic_choice_is_xla_off_gpu_and_triton_when_named():
  problem = vision_mlp_bwd.problem.Problem(64, 8, 16, jnp.dtype(jnp.float32), DotMode.TF32)
  assert backends.choose(None, problem, "cpu").name == "xla"
  assert backends.choose("triton", problem, "cpu").name == "triton"
  assert backends.choose(None, problem, "gpu").name in backends.names()


@pytest.mark.parametrize("precision,mode", [
    (None, DotMode.TF32), ("highest", DotMode.HIGHEST), (HIGHEST, DotMode.HIGHEST),
    (jax.lax.DotAlgorithmPreset.F16_F16_F32, DotMode.F16),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32, DotMode.BF16),
    (jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3, DotMode.BF16X3),
])
def test_precision_mapping(precision, mode):
  assert canonicalize(precision) is mode


# --- errors -------------------------------------------------------------------

def _inputs():
  return list(helpers.backward_inputs(5, 8, 16))


def _call(inputs, **kwargs):
  return vision_mlp_bwd.mlp_backward(*inputs, **kwargs)


@pytest.mark.parametrize("index,bad,pattern", [
    (0, jnp.ones((5, 9)), r"grad_output has shape \(5, 9\) and dtype float32; expected shape \(5, 8\)"),
    (1, jnp.ones((5, 7)), r"hidden_state has shape \(5, 7\).*expected last dimension H = 8"),
    (2, jnp.ones((16, 8, 1)), r"fc1_weight must have rank 2; got shape \(16, 8, 1\)"),
    (3, jnp.ones((15,)), r"fc1_bias has shape \(15,\).*expected shape \(16,\)"),
    (4, jnp.ones((16, 8)), r"fc2_weight has shape \(16, 8\).*expected shape \(8, 16\)"),
    (5, jnp.ones((8, 1)), r"fc2_bias must have rank 1"),
    (6, jnp.ones((4, 16)), r"fc1_output has shape \(4, 16\).*expected shape \(5, 16\)"),
    (7, jnp.ones((5, 15)), r"gelu_output has shape \(5, 15\).*expected shape \(5, 16\)"),
])
def test_shape_errors_name_the_argument(index, bad, pattern):
  inputs = _inputs()
  inputs[index] = bad
  with pytest.raises(ValueError, match=pattern):
    _call(inputs)


def test_mixed_dtypes_are_rejected():
  inputs = _inputs()
  inputs[6] = inputs[6].astype(jnp.bfloat16)
  with pytest.raises(TypeError, match=r"fc1_output has shape \(5, 16\) and dtype bfloat16; "
                                      r"expected dtype float32"):
    _call(inputs)


def test_integer_inputs_are_rejected():
  inputs = _inputs()
  inputs = [x.astype(jnp.int32) for x in inputs]
  with pytest.raises(TypeError, match="hidden_state has shape .* dtype int32; expected a floating"):
    _call(inputs)


def test_non_arrays_are_rejected():
  inputs = _inputs()
  inputs[2] = [[1.0]]
  with pytest.raises(TypeError, match="fc1_weight must be a JAX or NumPy array, got list"):
    _call(inputs)


@pytest.mark.parametrize("precision", ["fastest", jax.lax.DotAlgorithmPreset.F16_F16_F16, 3])
def test_unknown_precision(precision):
  with pytest.raises(ValueError, match=re.escape(f"precision={precision!r} is not supported")):
    _call(_inputs(), precision=precision)


def test_unknown_implementation():
  with pytest.raises(ValueError, match=r"implementation='cuda' is unknown; expected None or one of"):
    _call(_inputs(), implementation="cuda")
  hidden_state, params = params_and_input((3,), 8, 16)
  with pytest.raises(ValueError, match=r"implementation='mosaic' is unknown"):
    vision_mlp_bwd.vision_mlp(hidden_state, *params, implementation="mosaic")
