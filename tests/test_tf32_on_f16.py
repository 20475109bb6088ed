"""TF32 products on f16 tensor cores (`Config.tf32_on_f16`), in Pallas interpret mode.

f16 keeps TF32's 11 significant bits, so operands scaled by the right power
of two convert to f16 as exactly their TF32 roundings. These tests hold that
to the bit for the conversion, and hold the whole backward to a float64
oracle whose products take TF32-rounded operands (ties to even, as f16
converts), elementwise within `bounds.tf32_on_f16_oracle_and_bounds`: there
the only differences are fp32 accumulation (gamma_K) and the pre-GELU
gradient, which may round to the TF32 neighbour of the oracle's (one TF32
ulp, u = 2^-11 of it), plus the f16 subnormal grid for elements far below
their row's or column's largest. The plain fp32 bound must fail (the TF32
rounding did happen). Also for inputs far outside f16's range and with NaN
and Inf.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vision_mlp_bwd import precision
from vision_mlp_bwd.backends import triton as triton_backend
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.triton.config import Config, TileConfig
from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem
from tests import bounds, helpers

F32 = jax.lax.DotAlgorithmPreset.F32_F32_F32


def check_tf32_products(outs, inputs, label=""):
  """Within the TF32-operand oracle's bounds, typed fp32 and finite (chex)."""
  oracle, limits = bounds.tf32_on_f16_oracle_and_bounds(inputs)
  bounds.assert_within_bounds(outs, oracle, limits, jnp.float32, label)


def test_f16_scale_puts_the_largest_magnitude_in_2_14_to_2_15():
  key = helpers.fresh_key()
  x = jnp.abs(jax.random.normal(key, (4000,))) * jnp.exp2(
      jax.random.randint(jax.random.fold_in(key, 1), (4000,), -100, 100).astype(jnp.float32))
  scaled = np.asarray(x * precision.f16_scale(x), np.float64)
  assert np.all((scaled >= 2.0 ** 14) & (scaled < 2.0 ** 15)), scaled[(scaled < 2.0 ** 14)
                                                                      | (scaled >= 2.0 ** 15)]
  assert np.isfinite(np.asarray(precision.f16_scale(jnp.zeros(3)))).all()


def test_scaled_f16_is_the_tf32_rounding_times_the_scale():
  key = helpers.fresh_key()
  rows = jax.random.normal(key, (64, 256)) * jnp.exp2(
      jax.random.randint(jax.random.fold_in(key, 1), (64, 1), -60, 60).astype(jnp.float32))
  scale = precision.f16_scale(jnp.max(jnp.abs(rows), axis=1))[:, None]
  converted = np.asarray(precision.scaled_f16_operand(rows, scale), np.float64)
  expected = np.asarray(precision.round_to_tf32(rows) * scale, np.float64)
  # f16 rounds ties to even, TF32 (cvt.rna) away from zero: exact ties may differ, and are
  # the TF32 rounding with ties to even (the oracle's, bounds.tf32_rne) everywhere.
  bits = np.asarray(rows).view(np.uint32) & 0x1FFF
  ties = bits == 0x1000
  np.testing.assert_array_equal(converted[~ties], expected[~ties])
  np.testing.assert_array_equal(converted, bounds.tf32_rne(np.asarray(rows)) * np.asarray(scale))


@pytest.mark.parametrize("axis,parts,cast", [(0, 1, True), (1, 1, True), (0, 3, False),
                                             (1, 2, False)])
@pytest.mark.parametrize("step", [16, 512])   # several loop steps, or one kept tile
def test_scales_job_gives_maxima_sums_and_the_scaled_cast(axis, parts, cast, step):
  key = helpers.fresh_key()
  x = jax.random.normal(key, (300, 70)) * jnp.exp2(jax.random.randint(
      jax.random.fold_in(key, 1), (300, 70), -20, 20).astype(jnp.float32))
  x = x.at[5, 7].set(jnp.inf).at[9, 3].set(jnp.nan)
  job = staging.Scales(x.shape, axis=axis, cast=cast, sums=True, parts=parts, block=16, step=step)
  [(maxima, *copy, sums)] = staging.grouped_launch([job], [(x,)], mode=DotMode.TF32,
                                                   interpret=True)
  v = np.asarray(x, np.float64)
  finite = np.where(np.isfinite(v), np.abs(v), 0.0)
  np.testing.assert_array_equal(np.asarray(maxima).max(axis=0), finite.max(axis=axis))
  with np.errstate(invalid="ignore"):   # Inf - Inf in the lines checked for equality below
    ours, ref = np.asarray(sums, np.float64).sum(axis=0), v.sum(axis=axis)
    error = np.abs(ours - ref)
  ok = np.isfinite(ref)   # a line with NaN or Inf sums to it in both
  # fp32 partial sums of K terms, summed here in float64: gamma_K sum|v| (tests/bounds.py)
  assert np.all(error[ok] <= bounds.gamma(v.shape[axis]) * np.abs(v).sum(axis=axis)[ok])
  np.testing.assert_array_equal(ours[~ok], ref[~ok])
  if cast:
    scale = np.asarray(precision.f16_scale(jnp.asarray(finite.max(axis=axis), jnp.float32)))
    scale = scale[None, :] if axis == 0 else scale[:, None]
    np.testing.assert_array_equal(np.asarray(copy[0]),
                                  np.asarray(precision.scaled_f16_operand(x, scale)))


def _backward_on_f16(inputs, pre_block_m=16, sum_splits_in_kernel=False, cast_inputs=False):
  s, h = inputs[0].shape
  problem = Problem(s, h, inputs[2].shape[0], jnp.dtype(jnp.float32), DotMode.TF32)
  config = triton_backend.interpret_config(problem)
  config = dataclasses.replace(
      config, tf32_on_f16=True, sum_splits_in_kernel=sum_splits_in_kernel,
      cast_inputs=cast_inputs,
      pre_activation=dataclasses.replace(config.pre_activation, block_m=pre_block_m))
  return triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)


# pre_block_m 16 or 64: the pre-activation product's outputs from one or several
# blocks of rows (its row maxima, column sums and f16 copy); cast_inputs: the
# pre-activation product takes grad_output cast by rows, or converts it itself.
@pytest.mark.parametrize("tokens,pre_block_m,in_kernel,cast_inputs", [
    (1, 16, False, False), (37, 64, True, True), (67, 16, False, True)])
def test_backward_on_f16_computes_tf32_products(tokens, pre_block_m, in_kernel, cast_inputs):
  inputs = helpers.backward_inputs(tokens, 40, 72)
  ours = _backward_on_f16(inputs, pre_block_m, in_kernel, cast_inputs)
  check_tf32_products(ours, inputs, f"S={tokens}")
  # Against fp32 products' bound they fail: the TF32 rounding did happen.
  with pytest.raises(AssertionError, match="outside the bound"):
    bounds.check_backward(ours, inputs, F32)


# Activations and weights far outside f16's range, and single columns far
# below the others: the weights' speculated scales miss there, and their
# products redo those tiles with exact scales.
@pytest.mark.parametrize("whole", [True, False], ids=["tensors", "columns"])
def test_backward_on_f16_scales_operands_far_outside_f16s_range(whole):
  inputs = list(helpers.backward_inputs(37, 40, 72))
  for index, exponent in [(0, -40), (1, -20), (2, 20), (4, -30), (7, 30)]:
    if whole:
      inputs[index] = inputs[index] * 2.0 ** exponent
    else:
      inputs[index] = inputs[index].at[:, 3].multiply(2.0 ** exponent)
  inputs[7] = inputs[7].at[:, 5].multiply(2.0 ** -50)
  pre_block_m = 16 if whole else 64   # one block of rows, or several with their own maxima
  ours = _backward_on_f16(inputs, pre_block_m, cast_inputs=not whole)
  check_tf32_products(ours, inputs, f"block_m {pre_block_m}")


@pytest.mark.parametrize("pre_block_m", [16])
def test_backward_on_f16_propagates_nan_and_inf_like_the_reference(pre_block_m):
  inputs = list(helpers.backward_inputs(20, 32, 48))
  inputs[0] = inputs[0].at[3, 5].set(jnp.nan)
  inputs[6] = inputs[6].at[7, 2].set(jnp.inf)
  inputs[1] = inputs[1].at[11, 4].set(-jnp.inf)
  ours = _backward_on_f16(inputs, pre_block_m)
  ref = helpers.backward_float64(*inputs)
  for name, a, b in zip(helpers.OUT_NAMES, ours, ref):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
    np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=name)
    assert np.any(~np.isfinite(a)), name


# S = 37 = 32 + 5: the pre-activation and input-gradient tiles of one block of
# rows with a 16-row tail; with scaled inputs the speculated weight scales
# miss, so the redo path runs with the tails too.
@pytest.mark.parametrize("in_kernel,far", [(True, False), (False, True)])
def test_backward_on_f16_with_tail_tiles(in_kernel, far):
  inputs = list(helpers.backward_inputs(37, 40, 72))
  if far:
    for index, exponent in [(0, -40), (2, 20), (4, -30)]:
      inputs[index] = inputs[index] * 2.0 ** exponent
  problem = Problem(37, 40, 72, jnp.dtype(jnp.float32), DotMode.TF32)
  tile = TileConfig(32, 32, 32, tail_m=16)
  config = Config(tile, tile, dataclasses.replace(tile, split_k=2), tf32_on_f16=True,
                  cast_inputs=not far, sum_splits_in_kernel=in_kernel)
  ours = triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)
  check_tf32_products(ours, inputs, f"far={far}")
