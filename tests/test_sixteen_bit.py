"""bf16 and f16 inputs: `precision` means what it means to `jnp.matmul`, and nothing is widened.

On 16-bit inputs every 32-bit precision multiplies the 16-bit values as they
are with fp32 accumulation (`precision.for_inputs`), so the lowered programs
carry 16-bit dot operands, the precisions agree bit for bit, and what
`vision_mlp` saves for its backward stays in the input dtype and no larger
than what jnp's autodiff of the same model saves.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import vision_mlp_bwd
from vision_mlp_bwd.precision import DotMode, canonicalize, for_inputs
from tests import bounds, helpers

SIXTEEN_BIT = (jnp.bfloat16, jnp.float16)
THIRTY_TWO_BIT_PRECISIONS = (None, "default", "high", "highest", lax.Precision.HIGHEST,
                             lax.DotAlgorithmPreset.TF32_TF32_F32,
                             lax.DotAlgorithmPreset.F32_F32_F32,
                             lax.DotAlgorithmPreset.BF16_BF16_F32_X3)


def plain_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  """The MLP as a JAX user writes it."""
  return jax.nn.gelu(x @ fc1_weight.T + fc1_bias, approximate=True) @ fc2_weight.T + fc2_bias


def _params(dtype, hidden=16, intermediate=40, tokens=12):
  inputs = helpers.backward_inputs(tokens, hidden, intermediate, dtype=dtype)
  return inputs[1], inputs[2:6]   # hidden_state, (fc1_weight, fc1_bias, fc2_weight, fc2_bias)


def _dot_operand_types(hlo_text):
  """The (lhs, rhs) element types of every dot_general in StableHLO text."""
  tensor = r"tensor<(?:\d+x)*(\w+)>"
  return re.findall(rf"stablehlo\.dot_general[^\n]*?:\s*\({tensor},\s*{tensor}\)", hlo_text)


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "f16"])
@pytest.mark.parametrize("precision", THIRTY_TWO_BIT_PRECISIONS, ids=str)
def test_every_32_bit_precision_runs_as_the_input_dtypes_own(dtype, precision):
  expected = DotMode.BF16 if dtype == jnp.bfloat16 else DotMode.F16
  assert for_inputs(canonicalize(precision), dtype) is expected
  assert for_inputs(canonicalize(precision), jnp.float32) is canonicalize(precision)


def test_16_bit_presets_keep_their_operand_dtype():
  f16, bf16 = lax.DotAlgorithmPreset.F16_F16_F32, lax.DotAlgorithmPreset.BF16_BF16_F32
  assert for_inputs(canonicalize(f16), jnp.bfloat16) is DotMode.F16
  assert for_inputs(canonicalize(bf16), jnp.float16) is DotMode.BF16


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "f16"])
@pytest.mark.parametrize("implementation", [None, "xla"])
def test_lowered_backward_and_forward_have_16_bit_dot_operands(dtype, implementation):
  name = jnp.dtype(dtype).name.replace("float16", "f16").replace("bfloat16", "bf16")
  inputs = helpers.backward_inputs(24, 16, 40, dtype=dtype)
  backward = jax.jit(lambda *a: vision_mlp_bwd.mlp_backward(*a, implementation=implementation))
  hidden_state, params = inputs[1], inputs[2:6]
  forward = jax.jit(lambda x, *p: vision_mlp_bwd.vision_mlp(x, *p, implementation=implementation))
  for text in (backward.lower(*inputs).as_text(), forward.lower(hidden_state, *params).as_text()):
    operands = _dot_operand_types(text)
    assert all(pair == (name, name) for pair in operands), operands
    if not operands:   # the GPU kernels' products: no XLA dot, and nothing widened for them
      assert implementation is None and jax.default_backend() == "gpu"
      widened = re.findall(rf"stablehlo\.convert[^\n]*tensor<24x\d+x{name}>\) -> "
                           r"tensor<24x\d+xf32>", text)
      assert not widened, widened


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "f16"])
def test_all_32_bit_precisions_agree_bit_for_bit_on_16_bit_inputs(dtype):
  inputs = helpers.backward_inputs(20, 16, 40, dtype=dtype)
  outs = [vision_mlp_bwd.mlp_backward(*inputs, precision=p, implementation="xla")
          for p in (None, "highest", lax.DotAlgorithmPreset.F32_F32_F32)]
  for other in outs[1:]:
    for a, b in zip(outs[0], other):
      assert a.dtype == dtype
      np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


@pytest.mark.parametrize("implementation", [None, "xla"])
@pytest.mark.parametrize("dtype", (jnp.bfloat16, jnp.float16, jnp.float32),
                         ids=["bf16", "f16", "fp32"])
def test_residuals_stay_in_the_input_dtype_and_are_no_larger_than_plain_autodiffs(
    dtype, implementation):
  hidden_state, params = _params(dtype, hidden=32, intermediate=96, tokens=40)
  _, ours = jax.vjp(functools.partial(vision_mlp_bwd.vision_mlp, implementation=implementation),
                    hidden_state, *params)
  _, plain = jax.vjp(plain_mlp, hidden_state, *params)
  saved = jax.tree.leaves(ours)
  assert saved and all(r.dtype == dtype for r in saved), [r.dtype for r in saved]
  size = lambda leaves: sum(r.size * r.dtype.itemsize for r in leaves)
  assert size(saved) <= size(jax.tree.leaves(plain)), (size(saved), size(jax.tree.leaves(plain)))
  if implementation is None and dtype != jnp.float32:
    return   # jax's autodiff of the jnp model here (the next test): plain's residuals
  # Besides the arguments, the two [S, I] activations and nothing else.
  activations = [r for r in saved if r.shape == (40, 96)]
  assert len(activations) == 2


def _lowered_value_and_grad(f, *args):
  """StableHLO of `value_and_grad(sum(f(x)^2))` lowered for CUDA, without locations."""
  loss = lambda x, *p: jnp.sum(f(x, *p).astype(jnp.float32) ** 2)
  fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  return re.sub(r"#loc.*", "", re.sub(r" loc\([^\n]*", "", text))


@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "f16"])
def test_where_xla_would_run_on_16_bit_inputs_auto_is_plain_jnps_own_program(dtype):
  """There (on the H200 every S but those the Triton kernels take, every S on the CPU) jnp's
  autodiff is faster than our XLA backward (`backends.jnp_autodiff_preferred`): auto lowers
  to exactly plain jnp's program."""
  from vision_mlp_bwd.backends import jnp_autodiff_preferred
  from vision_mlp_bwd.problem import Problem
  hidden_state, params = _params(dtype, hidden=32, intermediate=96, tokens=40)
  ours = _lowered_value_and_grad(vision_mlp_bwd.vision_mlp, hidden_state, *params)
  assert ours == _lowered_value_and_grad(plain_mlp, hidden_state, *params)
  xla = _lowered_value_and_grad(functools.partial(vision_mlp_bwd.vision_mlp, implementation="xla"),
                                hidden_state, *params)
  assert xla != ours
  mode = for_inputs(canonicalize(None), dtype)
  on_gpu = lambda s, m=mode, d=dtype: jnp_autodiff_preferred(
      Problem(s, 1280, 3584, jnp.dtype(d), m), "gpu")
  assert on_gpu(131) and on_gpu(4096) and on_gpu(16384)
  assert not any(on_gpu(s) for s in (1, 64, 128, 211, 256))   # the Triton kernels run there
  assert not on_gpu(4096, DotMode.F16 if dtype == jnp.bfloat16 else DotMode.BF16)
  assert not on_gpu(4096, DotMode.TF32, jnp.float32)


@pytest.mark.transcendental
@pytest.mark.parametrize("implementation", ["triton", "xla"])
@pytest.mark.parametrize("dtype", SIXTEEN_BIT, ids=["bf16", "f16"])
def test_16_bit_gradients_match_float64_and_are_no_worse_than_plain_autodiff(dtype,
                                                                               implementation):
  """The gradient of sum(vision_mlp(x) * cotangent) on 16-bit inputs: within the bounds of
  tests/bounds.py (16-bit roundings of the operands, the pre-GELU gradient and the outputs)
  of the float64 gradient of the model, and, per gradient, no further from it in relative
  Frobenius error than jnp's autodiff of the plain model in the same dtype, measured in the
  same test, or than the stated random-rounding estimate (`REL_FROBENIUS_GROWTH` u)."""
  hidden_state, params = _params(dtype, hidden=24, intermediate=56, tokens=37)
  cotangent = jax.random.normal(helpers.fresh_key(), hidden_state.shape).astype(dtype)
  loss = lambda f: lambda x, *p: jnp.sum((f(x, *p) * cotangent).astype(jnp.float32))
  ours = jax.jit(jax.grad(loss(functools.partial(vision_mlp_bwd.vision_mlp,
                                                 implementation=implementation)),
                          argnums=(0, 1, 2, 3, 4)))(hidden_state, *params)
  plain = jax.grad(loss(plain_mlp), argnums=(0, 1, 2, 3, 4))(hidden_state, *params)
  oracle, limits = bounds.gradient_oracle_and_bounds(cotangent, hidden_state, params, None)
  names = ("d hidden_state", "d fc1_weight", "d fc1_bias", "d fc2_weight", "d fc2_bias")
  bounds.assert_within_bounds(ours, oracle, limits, [dtype] * 5, implementation, names=names)
  estimate = bounds.relative_frobenius_tolerance(None, dtype)
  for name, mine, theirs, ref in zip(names, ours, plain, oracle):
    assert theirs.dtype == dtype
    error, plain_error = helpers.relative_error(mine, ref), helpers.relative_error(theirs, ref)
    assert error <= max(plain_error, estimate), (name, error, plain_error, estimate)
