"""The public API: autodiff through `vision_mlp`, dispatch, and input errors.

Gradients are held elementwise to the float64 gradient of the model within the stated
bounds of tests/bounds.py (`gradient_oracle_and_bounds`: the backward on the forward's
activations, the forward's own rounding included), on both public paths (`mlp_backward`
and `jax.grad` of `vision_mlp`) with and without jit (chex.variants). That oracle is the
gradient of the same model written in plain jnp (jax.nn.gelu), checked with `jax.grad` in
float64 against the float64 bound.
"""

from __future__ import annotations

import functools
import re

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized

import vision_mlp_bwd
from vision_mlp_bwd import backends
from vision_mlp_bwd.precision import DotMode, canonicalize
from tests import bounds, helpers

HIGHEST = jax.lax.Precision.HIGHEST
ARGNUMS = (0, 1, 2, 3, 4)
GRAD_NAMES = ("d hidden_state", "d fc1_weight", "d fc1_bias", "d fc2_weight", "d fc2_bias")


def plain_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  """The same model written with jnp and jax.nn.gelu: autodiff is the oracle."""
  x = jnp.matmul(hidden_state, fc1_weight.T, precision=HIGHEST) + fc1_bias
  return jnp.matmul(jax.nn.gelu(x, approximate=True), fc2_weight.T, precision=HIGHEST) + fc2_bias


def params_and_input(batch, hidden=24, intermediate=40, dtype=jnp.float32):
  inputs = helpers.backward_inputs(None, hidden, intermediate, batch=batch, dtype=dtype)
  return inputs[1], inputs[2:6]  # hidden_state, (fc1_weight, fc1_bias, fc2_weight, fc2_bias)


def cotangent_like(x):
  """A fresh random cotangent: the loss sum(out * cotangent) hands it to the backward exactly."""
  return jax.random.normal(helpers.fresh_key(), x.shape).astype(x.dtype)


def loss_of(mlp, cotangent, **kwargs):
  def loss(hidden_state, *params):
    return jnp.sum(mlp(hidden_state, *params, **kwargs) * cotangent)
  return loss


def check_gradient(grads, hidden_state, params, cotangent, precision="highest", label=""):
  """The five gradients within their bounds of the float64 gradient (chex: shapes, dtypes,
  finite), and HIGHEST's contract (fp32-class: relative Frobenius error <= 1e-5) beside."""
  oracle, limits = bounds.gradient_oracle_and_bounds(cotangent, hidden_state, params, precision)
  bounds.assert_within_bounds(grads, oracle, limits,
                              [hidden_state.dtype, *(p.dtype for p in params)], label,
                              names=GRAD_NAMES)
  tolerance = bounds.relative_frobenius_tolerance(precision, hidden_state.dtype)
  if tolerance == bounds.HIGHEST_RELATIVE_ERROR:
    helpers.assert_close_to_oracle(grads, oracle, tolerance, label)


@pytest.mark.transcendental
class PublicPathsWithAndWithoutJit(chex.TestCase):
  """`jax.grad` of `vision_mlp` and `mlp_backward` itself hold their bounds both ways."""

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("triton", "xla")
  def test_grad_of_vision_mlp_with_batch_dims(self, implementation):
    hidden_state, params = params_and_input((2, 9))
    cotangent = cotangent_like(hidden_state)
    grad = self.variant(jax.grad(loss_of(vision_mlp_bwd.vision_mlp, cotangent,
                                         precision="highest", implementation=implementation),
                                 argnums=ARGNUMS))
    check_gradient(grad(hidden_state, *params), hidden_state, params, cotangent,
                   label=implementation)

  @chex.variants(with_jit=True, without_jit=True)
  @parameterized.parameters("triton", "xla")
  def test_mlp_backward_with_batch_dims(self, implementation):
    inputs = helpers.backward_inputs(None, 24, 40, batch=(3, 7))

    def backward(*arrays):
      return vision_mlp_bwd.mlp_backward(*arrays, precision="highest",
                                         implementation=implementation)
    outs = self.variant(backward)(*inputs)
    bounds.check_backward(outs, inputs, "highest", implementation)


@pytest.mark.transcendental
def test_forward_matches_float64():
  hidden_state, params = params_and_input((11,))
  out = vision_mlp_bwd.vision_mlp(hidden_state, *params, precision="highest")
  (_, _, oracle), (_, _, limit) = bounds.forward_oracle_and_bounds(hidden_state, *params,
                                                                    "highest")
  bounds.assert_within_bounds([out], [oracle], [limit], jnp.float32, names=("output",))


@pytest.mark.transcendental
@pytest.mark.parametrize("gelu", [vision_mlp_bwd.reference.gelu_tanh,
                                  functools.partial(jax.nn.gelu, approximate=True)],
                         ids=["reference", "jax.nn.gelu"])
def test_fp32_gelu_within_its_stated_error_on_this_isa(gelu):
  """The forward's fp32 GELU is within bounds.GELU_ERROR_PER_X |x| of float64, which assumes
  XLA's fp32 tanh within bounds.TANH_ERROR of tanh: both held here, on whatever vector ISA XLA
  picked (CI also runs under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2)."""
  rng = np.random.default_rng()
  x = np.concatenate([np.linspace(-12, 12, 400_001), rng.normal(size=100_000),
                      rng.uniform(-12, 12, 100_000)]).astype(np.float32)
  x64 = x.astype(np.float64)
  error = np.abs(np.asarray(jax.jit(gelu)(jnp.asarray(x)), np.float64) - bounds.gelu64(x64))
  limit = (bounds.GELU_ERROR_PER_X + bounds.GELU_FLOAT64_ERROR_PER_X) * np.abs(x64)
  worst = int(np.argmax(error - limit))
  assert error[worst] <= limit[worst], f"{error[worst]:.3g} > {limit[worst]:.3g} at x={x[worst]!r}"
  v = x[::3]
  tanh_error = np.abs(np.asarray(jax.jit(jnp.tanh)(jnp.asarray(v)), np.float64)
                      - np.tanh(v.astype(np.float64)))
  assert tanh_error.max() <= bounds.TANH_ERROR, (tanh_error.max(), v[tanh_error.argmax()])


def test_oracle_is_the_gradient_of_the_plain_model():
  """In float64, `jax.grad` of the plain-jnp model equals the bounds' oracle (both sides' float64
  roundings: the float64 error model on either, summed)."""
  hidden_state, params = params_and_input((2, 9))
  cotangent = cotangent_like(hidden_state)
  with jax.enable_x64():
    as64 = lambda t: jnp.asarray(np.asarray(t, np.float64))
    x64, p64, c64 = as64(hidden_state), tuple(map(as64, params)), as64(cotangent)
    theirs = jax.grad(loss_of(plain_mlp, c64), argnums=ARGNUMS)(x64, *p64)
    oracle, limits = bounds.gradient_oracle_and_bounds(c64, x64, p64)
  bounds.assert_within_bounds(theirs, oracle, [2 * b for b in limits], jnp.float64,
                              names=GRAD_NAMES)


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
  cotangent = cotangent_like(hidden_state)
  loss = jax.checkpoint(loss_of(vision_mlp_bwd.vision_mlp, cotangent, precision="highest",
                                implementation="triton"))
  value, grads = jax.jit(jax.value_and_grad(loss, argnums=ARGNUMS))(hidden_state, *params)
  (_, _, out), (_, _, out_error) = bounds.forward_oracle_and_bounds(hidden_state, *params,
                                                                    "highest")
  c = np.abs(bounds.f64(cotangent))
  # sum(out * cotangent) in fp32: each out within its bound, then a product and a sum of N terms
  terms = (np.abs(out) + out_error) * c
  value_bound = float((out_error * c).sum() + bounds.gamma(c.size) * terms.sum())
  bounds.assert_within_bounds([value], [(out * bounds.f64(cotangent)).sum()],
                              [np.asarray(value_bound)], jnp.float32, names=("loss",))
  check_gradient(grads, hidden_state, params, cotangent)


def test_vmap_over_a_batch_of_inputs():
  hidden_state, params = params_and_input((3, 7))
  cotangent = cotangent_like(hidden_state)

  def loss(x, c, *params):
    return jnp.sum(vision_mlp_bwd.vision_mlp(x, *params, precision="highest",
                                             implementation="triton") * c)
  per_example = jax.vmap(jax.grad(loss, argnums=(0, 2, 3, 4, 5)),
                         in_axes=(0, 0, None, None, None, None))
  grads = per_example(hidden_state, cotangent, *params)
  for i in range(hidden_state.shape[0]):
    check_gradient([g[i] for g in grads], hidden_state[i], params, cotangent[i], label=f"{i}")


def test_repeated_calls_at_one_shape_do_not_retrace(monkeypatch):
  """chex.assert_max_traces: a jitted gradient of `vision_mlp` and a jitted `mlp_backward` trace
  once per shape; eager `mlp_backward` calls trace the backend once per shape too."""
  def loss(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, cotangent):
    return jnp.sum(vision_mlp_bwd.vision_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight,
                                             fc2_bias, implementation="xla") * cotangent)

  def gradient(*arrays):
    return jax.grad(loss, argnums=ARGNUMS)(*arrays)

  def backward(*arrays):
    return vision_mlp_bwd.mlp_backward(*arrays, implementation="xla")

  grad = jax.jit(chex.assert_max_traces(gradient, n=2))
  jitted_backward = jax.jit(chex.assert_max_traces(backward, n=2))
  for tokens in (5, 5, 5, 6, 6):          # fresh values each call; one new shape: two traces
    hidden_state, params = params_and_input((tokens,), 8, 16)
    grad(hidden_state, *params, cotangent_like(hidden_state))
    jitted_backward(*helpers.backward_inputs(tokens, 8, 16))
  hidden_state, params = params_and_input((7,), 8, 16)   # a third shape is a third trace
  with pytest.raises(AssertionError, match="'gradient' is traced > 2 times"):
    grad(hidden_state, *params, cotangent_like(hidden_state))
  with pytest.raises(AssertionError, match="'backward' is traced > 2 times"):
    jitted_backward(*helpers.backward_inputs(7, 8, 16))

  # Eager calls: mlp_backward's own jit traces the backend once per shape.
  from vision_mlp_bwd.backends import xla
  original = xla.BACKEND.backward

  def backend_backward(*args, **kwargs):
    return original(*args, **kwargs)
  monkeypatch.setattr(xla.BACKEND, "backward", chex.assert_max_traces(backend_backward, n=2))
  for tokens in (9, 9, 9, 10, 10):
    vision_mlp_bwd.mlp_backward(*helpers.backward_inputs(tokens, 8, 16), implementation="xla")
  with pytest.raises(AssertionError, match="'backend_backward' is traced > 2 times"):
    vision_mlp_bwd.mlp_backward(*helpers.backward_inputs(11, 8, 16), implementation="xla")


def test_precision_for_inputs_is_what_the_bounds_assume():
  """`precision.for_inputs` maps (mode, input dtype) as bounds.mode_for states jnp.matmul's
  meaning: fp32 inputs keep every mode; on bf16/f16 inputs every 32-bit mode is the input
  dtype's 16-bit mode and the 16-bit presets keep theirs."""
  from vision_mlp_bwd.precision import for_inputs
  for mode in DotMode:
    for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
      assert for_inputs(mode, dtype) is bounds.mode_for(mode, dtype), (mode, dtype)
  assert bounds.mode_for(None, jnp.bfloat16) is DotMode.BF16
  assert bounds.mode_for(jax.lax.DotAlgorithmPreset.F16_F16_F32, jnp.bfloat16) is DotMode.F16


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
  with pytest.raises(ValueError, match=r"implementation='cutlass' is unknown"):
    vision_mlp_bwd.vision_mlp(hidden_state, *params, implementation="cutlass")
