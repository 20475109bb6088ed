"""The Triton kernels, run in Pallas interpret mode on the CPU, against float64.

Interpret mode fills every output with NaN before the kernel runs and reads
NaN out of bounds (`pallas_call(interpret=True)`), so a missing store or a
missing mask shows up as a non-finite value, which `bounds.assert_within_bounds`
rejects wherever the oracle is finite; the tiled-product tests also pass
NaN-filled output buffers of their own. Every element must lie within its
bound from tests/bounds.py for the mode (on the CPU, TF32 is computed in fp32,
so its bound is fp32's; bf16x3 for HIGHEST; 16-bit operands with fp32
accumulation), and where the mode rounds to a 16-bit format or is HIGHEST, the
relative Frobenius error within `bounds.relative_frobenius_tolerance` beside.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vision_mlp_bwd
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.triton import kernels
from vision_mlp_bwd.backends.triton.config import Config, TileConfig
from vision_mlp_bwd import precision
from vision_mlp_bwd.precision import DotMode
from tests import bounds, helpers

F16 = jax.lax.DotAlgorithmPreset.F16_F16_F32
BF16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
F32 = jax.lax.DotAlgorithmPreset.F32_F32_F32


# Every precision at S = 1 (one row), 131 (a row tail past whole tiles) and 300 (several
# blocks and splits); S = 7 and 64 (a partial and an exactly whole tile) under DEFAULT.
@pytest.mark.transcendental
@pytest.mark.parametrize("tokens,precision", [
    *((tokens, precision) for tokens in (1, 131, 300) for precision in (None, "highest", F16, BF16)),
    (7, None), (64, None)], ids=str)
def test_backward_matches_float64(tokens, precision):
  hidden, intermediate = 40, 72  # not multiples of the 16/32 tiles
  inputs = helpers.backward_inputs(tokens, hidden, intermediate)
  helpers.check_backward(inputs, f"S={tokens}", precision=precision)


def test_error_model_constants():
  """The constants tests/bounds.py derives its bounds from, checked in float64 (NumPy, no
  fp32 transcendental involved): sup |gelu'|, sup |gelu''|, the GPU GELU derivative's
  sensitivities, and bf16x3's per-product error."""
  x = np.linspace(-12, 12, 2_400_001)
  d = bounds.gelu_grad64(x)
  assert np.abs(d).max() <= bounds.GELU_GRAD_MAX
  # gelu'' = sech^2(u) (u' - x tanh(u) u'^2 + x u'' / 2), u' = s (1 + 3 c x^2), u'' = 6 s c x
  s, c3 = np.sqrt(2 / np.pi), 0.044715
  u = s * (x + c3 * x ** 3)
  du, ddu = s * (1 + 3 * c3 * x ** 2), 6 * s * c3 * x
  second = (1 - np.tanh(u) ** 2) * (du - x * np.tanh(u) * du ** 2 + 0.5 * x * ddu)
  assert np.abs(second).max() <= bounds.GELU_SECOND_DERIVATIVE_MAX
  # gelu' = r + q x c(x), t = exp(-2|u|), p = 1 / (1 + t), r = p (x >= 0) or t p, q = t p^2.
  t, c = np.exp(-2 * np.abs(u)), 2 * s * (1 + 3 * c3 * x ** 2)
  p = 1 / (1 + t)
  r, q = np.where(x >= 0, p, t * p), t * p * p
  np.testing.assert_allclose(r + q * x * c, d, rtol=0, atol=2 * bounds.GELU_GRAD_FLOAT64_ERROR)
  dr_dt = np.where(x >= 0, -p * p, p - t * p * p)
  dq_dt = p * p - 2 * t * p ** 3
  sensitivity = np.abs(t * (dr_dt + dq_dt * x * c))
  float64_slack = bounds.gamma(8, bounds.U64)   # a few float64 roundings of terms <= 1
  assert sensitivity.max() <= 0.25 + float64_slack
  assert (2 * np.abs(u) * sensitivity).max() <= 0.33
  assert np.abs(r + 2 * q * x * c).max() <= 1.36
  assert (bounds.GELU_GRAD_ERROR + 0.25 * 2.0 ** -22 + 0.33 * 2.0 ** -24 + 1.36 * 2.0 ** -22
          <= bounds.GPU_GELU_GRAD_ERROR)
  # bf16x3: the three products of the bf16 splits of fp32 values, summed exactly.
  rng = np.random.default_rng()
  a, b = (np.asarray(jnp.asarray(rng.normal(size=100_000) * np.exp2(rng.integers(-30, 30, 100_000)),
                                 jnp.float32), np.float64) for _ in range(2))
  split = lambda v: (hi := bounds.f64(jnp.asarray(v, jnp.float32).astype(jnp.bfloat16)),
                     bounds.f64(jnp.asarray(v - hi, jnp.float32).astype(jnp.bfloat16)))
  (a_hi, a_lo), (b_hi, b_lo) = split(a), split(b)
  three = a_hi * b_hi + a_hi * b_lo + a_lo * b_hi
  assert np.all(np.abs(three - a * b) <= bounds.BF16X3_PRODUCT * np.abs(a * b))
  assert np.all(np.abs(a_hi * b_hi) + np.abs(a_hi * b_lo) + np.abs(a_lo * b_hi)
                <= bounds.BF16X3_PARTS * np.abs(a * b))


def test_interpret_mode_poisons_what_a_kernel_does_not_write():
  """What makes every finiteness check a test for unwritten elements: Pallas interpret mode
  starts each output as NaN (`uninitialized_value`), so an element no program stores stays
  NaN, and `assert_within_bounds` rejects NaN where the oracle is finite."""
  from jax.experimental import pallas as pl

  def first_block_only(x_ref, o_ref):
    @pl.when(pl.program_id(0) == 0)
    def _():
      o_ref[...] = x_ref[...] * 2

  x = jax.random.normal(helpers.fresh_key(), (32, 8))
  out = pl.pallas_call(first_block_only, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                       grid=(2,), in_specs=[pl.BlockSpec((16, 8), lambda i: (i, 0))],
                       out_specs=pl.BlockSpec((16, 8), lambda i: (i, 0)), interpret=True)(x)
  chex.assert_trees_all_equal(out[:16], x[:16] * 2)
  assert np.isnan(np.asarray(out[16:])).all()
  oracle = bounds.f64(x) * 2
  with pytest.raises(AssertionError, match="non-finite output where the oracle is finite"):
    bounds.assert_within_bounds([out], [oracle], [np.abs(oracle)], jnp.float32, names=("x2",))


def test_the_bounds_catch_what_they_should():
  """The check is not vacuous: it names an output off by more than its bound, and the bounds of
  one mode reject another mode's results: fp32 products that took TF32-rounded operands, f16
  operands where HIGHEST promised fp32-class products, and (by the relative Frobenius
  tolerance, where the worst-case bound at K = 300 cannot) bf16 operands where F16 was asked."""
  inputs = helpers.backward_inputs(7, 40, 72)
  run = lambda precision, arrays=inputs: vision_mlp_bwd.mlp_backward(
      *arrays, precision=precision, implementation="xla")
  oracle, limits = bounds.check_backward(run(F32), inputs, F32, "F32")
  shifted = list(run(F32))
  shifted[3] = shifted[3].at[5, 7].add(3 * float(limits[3][5, 7]))
  with pytest.raises(AssertionError, match=r"grad_fc2_weight\[5, 7\]"):
    bounds.assert_within_bounds(shifted, oracle, limits, jnp.float32)
  tf32 = [jnp.asarray(helpers.tf32_operand(x), jnp.float32) if j in (0, 1, 2, 4, 7) else x
          for j, x in enumerate(inputs)]
  with pytest.raises(AssertionError, match="outside the bound"):
    bounds.check_backward(run(F32, tf32), inputs, F32)
  with pytest.raises(AssertionError, match="outside the bound"):
    bounds.check_backward(run(F16), inputs, "highest", relative=False)
  wide = helpers.backward_inputs(300, 40, 72)
  oracle, _ = bounds.backward_oracle_and_bounds(wide, F16)
  with pytest.raises(AssertionError, match="relative Frobenius error above"):
    bounds.assert_relative_frobenius(run(BF16, wide), oracle,
                                     bounds.relative_frobenius_tolerance(F16, jnp.float32))


@pytest.mark.parametrize("dtype,precision", [(jnp.bfloat16, None), (jnp.float16, "highest"),
                                             (jnp.bfloat16, F16)], ids=str)
def test_16bit_inputs_give_16bit_outputs(dtype, precision):
  """bf16/f16 inputs: exact products in fp32, the pre-GELU gradient rounded to the input dtype
  (and to f16 under F16_F16_F32), outputs rounded to the input dtype."""
  helpers.check_backward(helpers.backward_inputs(50, 24, 56, dtype=dtype), precision=precision)


def test_triton_agrees_with_xla_backend():
  """Both within their bounds of the oracle, so within the sum of both bounds of each other."""
  inputs = helpers.backward_inputs(33, 48, 80)
  ours = vision_mlp_bwd.mlp_backward(*inputs, precision=F32, implementation="triton")
  xla = vision_mlp_bwd.mlp_backward(*inputs, precision=F32, implementation="xla")
  oracle, limits = bounds.backward_oracle_and_bounds(inputs, F32)
  for outs, label in ((ours, "triton"), (xla, "xla")):
    bounds.assert_within_bounds(outs, oracle, limits, jnp.float32, label)
  bounds.assert_within_bounds(ours, xla, [2 * b for b in limits], jnp.float32, "triton vs xla")


def test_leading_batch_dimensions():
  inputs = helpers.backward_inputs(None, 32, 48, batch=(3, 5))
  outs = vision_mlp_bwd.mlp_backward(*inputs, implementation="triton")
  chex.assert_shape(outs[0], (3, 5, 32))
  bounds.check_backward(outs, inputs, None, "batch (3, 5)")


def test_zero_tokens_returns_zeros_without_kernels():
  inputs = helpers.backward_inputs(0, 16, 32)
  jaxpr = jax.make_jaxpr(
      lambda *a: vision_mlp_bwd.mlp_backward(*a, implementation="triton"))(*inputs)
  assert "pallas_call" not in str(jaxpr)
  outs = vision_mlp_bwd.mlp_backward(*inputs, implementation="triton")
  chex.assert_shape(outs, [(0, 16), (32, 16), (32,), (16, 32), (16,)])
  chex.assert_type(outs, jnp.float32)
  chex.assert_trees_all_equal(outs[1:], tuple(np.zeros(np.shape(o), np.float32) for o in outs[1:]))


@pytest.mark.parametrize("sum_splits_in_kernel", [False, True])
def test_nan_and_inf_propagate_like_the_reference(sum_splits_in_kernel):
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.problem import Problem
  inputs = list(helpers.backward_inputs(20, 32, 48))
  grad_output = np.array(inputs[0])
  grad_output[3, 5] = np.nan
  fc1_output = np.array(inputs[6])
  fc1_output[7, 2] = np.inf
  inputs[0], inputs[6] = jnp.asarray(grad_output), jnp.asarray(fc1_output)
  problem = Problem(20, 32, 48, jnp.dtype(jnp.float32), DotMode.F32)
  config = dataclasses.replace(triton_backend.interpret_config(problem),
                               sum_splits_in_kernel=sum_splits_in_kernel)
  ours = triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)
  ref = vision_mlp_bwd.reference.mlp_backward(*inputs, precision="highest")
  for name, a, b in zip(helpers.OUT_NAMES, ours, ref):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
    assert np.any(np.isnan(a)), name


def test_results_are_bitwise_deterministic():
  inputs = helpers.backward_inputs(45, 32, 48)
  run = jax.jit(lambda *a: vision_mlp_bwd.mlp_backward(*a, implementation="triton"))
  first, second = run(*inputs), run(*inputs)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("split_k,in_kernel", [(1, False), (2, False), (3, False), (2, True),
                                               (3, True)])
def test_tiled_matmul_writes_every_element_of_a_poisoned_output(transpose_a, split_k, in_kernel):
  m, n, k = 37, 69, 70  # ragged in every dimension: 3 x 3 tiles, the last ones partial
  tile = TileConfig(16, 32, 16, split_k=split_k)
  _check_poisoned_product(m, n, k, tile, transpose_a, in_kernel)


def _check_poisoned_product(m, n, k, tile, transpose_a, in_kernel):
  """`tiled_matmul` (with row sums) into a NaN-filled output equals the float64 product."""
  key = helpers.fresh_key()
  a = jax.random.normal(key, (k, m) if transpose_a else (m, k))
  b = jax.random.normal(jax.random.fold_in(key, 1), (k, n))
  # Split partials summed in the kernel leave the product as the first output.
  poisoned = jnp.full(((1 if in_kernel else tile.split_k) * m, n), jnp.nan, jnp.float32)
  product, sums = kernels.tiled_matmul(a, b, tile=tile, mode=DotMode.F32, out_dtype=jnp.float32,
                                       transpose_a=transpose_a, row_sums=True, out=poisoned,
                                       sum_splits_in_kernel=in_kernel, interpret=True)
  op_a = np.asarray(a, np.float64).T if transpose_a else np.asarray(a, np.float64)
  _assert_product_and_sums(product, sums, op_a, np.asarray(b, np.float64))


def _assert_product_and_sums(product, sums, op_a, op_b):
  """An fp32 product (and op_a's row sums) within gamma_K |A| @ |B| of float64, every element
  finite (the outputs were NaN-filled)."""
  product_bound, _ = bounds.product_error(np.abs(op_a), np.abs(op_b))
  oracle, limits = [op_a @ op_b], [product_bound]
  if sums is not None:
    oracle.append(op_a.sum(1))
    limits.append(bounds.product_error(np.abs(op_a), np.ones((op_a.shape[1], 1)))[0][:, 0])
  outs = [product] + ([sums] if sums is not None else [])
  bounds.assert_within_bounds(outs, oracle, limits, jnp.float32, "tiled product",
                              names=("product", "row sums")[:len(outs)])


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("split_k,in_kernel", [(1, False), (2, False), (2, True)])
def test_tail_rows_write_every_element(transpose_a, split_k, in_kernel):
  m, n, k = 37, 45, 70    # M = 32 + 5: a 16-row tail
  tile = TileConfig(32, 32, 64, split_k=split_k, tail_m=16)
  product = kernels.Product(m, n, k, tile, jnp.dtype(jnp.float32))
  assert product.grid[0] == 1 and product.tail_rows == 16
  _check_poisoned_product(m, n, k, tile, transpose_a, in_kernel)


def test_tails_only_just_past_one_block():
  tile = TileConfig(64, 32, 64, tail_m=32)
  for m, tail in [(64, 0), (65, 32), (96, 32), (97, 0), (200, 0)]:
    product = kernels.Product(m, 40, 48, tile, jnp.dtype(jnp.float32))
    assert product.tail_rows == tail, m
    assert product.grid[0] == (1 if tail else -(-m // 64)), m
  for bad in (dict(tail_m=64), dict(tail_m=24), dict(tail_m=8)):
    with pytest.raises(ValueError, match="tail_m"):
      TileConfig(64, 32, 64, **bad)


@pytest.mark.parametrize("split_k,in_kernel", [(1, False), (3, False), (3, True)])
def test_transposed_operands_write_every_element_of_a_poisoned_output(split_k, in_kernel):
  """Both operands stored transposed, the left one through registers: the weight gradients
  of `Config.k_major_weight_grads`."""
  m, n, k = 37, 85, 70
  key = helpers.fresh_key()
  a = jax.random.normal(key, (k, m))                          # stored [K, M]
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, k))   # stored [N, K]
  product = kernels.Product(m, n, k, TileConfig(16, 32, 16, split_k=split_k),
                            jnp.dtype(jnp.float32), transpose_a=True, transpose_b=True,
                            row_sums=True, lhs_in_registers=True, sum_splits_in_kernel=in_kernel)
  # The counters come from a Zeros job of an earlier launch, as in the backward.
  [counters] = staging.grouped_launch([staging.Zeros(product.tiles, block=16)], [()],
                                      mode=DotMode.F32, interpret=True)
  assert counters.shape == (product.tiles,) and not counters.any()
  operands = (a, b, counters) if in_kernel else (a, b)
  poisoned = jnp.full(((1 if in_kernel else split_k) * m, n), jnp.nan, jnp.float32)
  [(product_out, sums)] = staging.grouped_launch([product], [operands], mode=DotMode.F32,
                                                 out=poisoned, interpret=True)
  chex.assert_shape(product_out, (m, n))
  _assert_product_and_sums(product_out, sums, np.asarray(a, np.float64).T,
                           np.asarray(b, np.float64).T)


def test_tf32_rounding_is_round_to_nearest_ties_away_or_even_and_keeps_specials():
  key = helpers.fresh_key()
  x = jax.random.normal(key, (2000,)) * jnp.exp2(jax.random.randint(key, (2000,), -30, 30))
  ties = jnp.array([1.0 + 2.0 ** -11, -(1.0 + 3 * 2.0 ** -11), 1.0 + 2.0 ** -11 + 2.0 ** -20])
  specials = jnp.array([jnp.inf, -jnp.inf, jnp.nan, 0.0, -0.0, 3.4028235e38])
  rounded = np.asarray(precision.round_to_tf32(jnp.concatenate([x, ties, specials])))
  # Oracle in float64: the nearest multiple of 2^(e-10) for |v| in [2^e, 2^(e+1)), ties away.
  v = np.asarray(x, np.float64)
  ulp = np.exp2(np.floor(np.log2(np.abs(v))) - 10)
  np.testing.assert_array_equal(rounded[:2000], np.sign(v) * np.floor(np.abs(v) / ulp + 0.5) * ulp)
  np.testing.assert_array_equal(rounded[2000:2003], [1.0 + 2.0 ** -10, -(1.0 + 2.0 ** -9),
                                                     1.0 + 2.0 ** -10])
  assert np.isposinf(rounded[-6]) and np.isneginf(rounded[-5]) and np.isnan(rounded[-4])
  assert rounded[-3] == 0.0 and np.signbit(rounded[-2]) and np.isposinf(rounded[-1])
  # Ties to even (the f16 engine's operands): np.round halves to even.
  even = np.asarray(precision.round_to_tf32(jnp.concatenate([x, ties, specials]),
                                            ties_to_even=True))
  np.testing.assert_array_equal(even[:2000], np.sign(v) * np.round(np.abs(v) / ulp) * ulp)
  np.testing.assert_array_equal(even[2000:2003], [1.0, -(1.0 + 2.0 ** -9), 1.0 + 2.0 ** -10])
  assert np.isposinf(even[-6]) and np.isneginf(even[-5]) and np.isnan(even[-4])
  assert even[-3] == 0.0 and np.signbit(even[-2]) and np.isposinf(even[-1])


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_casts_ride_along_in_a_launch_and_write_every_element(dtype):
  key = helpers.fresh_key()
  x = jax.random.normal(key, (7, 37)) * 100           # ragged tiles in both dimensions
  y = jax.random.normal(jax.random.fold_in(key, 1), (5, 3))
  a = jax.random.normal(jax.random.fold_in(key, 2), (20, 24))
  b = jax.random.normal(jax.random.fold_in(key, 3), (24, 36))
  jobs = [staging.Cast(x.shape, jnp.dtype(dtype), block=(4, 16)),
          staging.Cast(y.shape, jnp.dtype(dtype), block=(4, 16)),
          kernels.Product(20, 36, 24, TileConfig(16, 16, 16), jnp.dtype(jnp.float32))]
  poisoned = jnp.full(x.shape, jnp.nan, dtype)
  cast_x, cast_y, product = staging.grouped_launch(jobs, [(x,), (y,), (a, b)], mode=DotMode.F32,
                                                   out=poisoned, interpret=True)
  for cast, source in ((cast_x, x), (cast_y, y)):
    chex.assert_shape(cast, source.shape)
    chex.assert_type(cast, dtype)
    chex.assert_trees_all_equal(cast, source.astype(dtype))
  _assert_product_and_sums(product, None, np.asarray(a, np.float64), np.asarray(b, np.float64))


@pytest.mark.transcendental
def test_gelu_epilogue_multiplies_by_the_gelu_derivative():
  """eye @ ones is exactly 1, so the epilogue's output is its fp32 gelu'(x), within
  GELU_GRAD_ERROR of the float64 derivative (that of `jax.nn.gelu`, which the oracle's
  contract formula is: tests/test_gelu.py)."""
  x = jax.random.normal(helpers.fresh_key(), (20, 36)) * 3
  ones = jnp.eye(20)
  product = kernels.tiled_matmul(ones, jnp.ones((20, 36)), gelu_input=x, tile=TileConfig(16, 16, 16),
                                 mode=DotMode.F32, out_dtype=jnp.float32, interpret=True)
  limit = np.full(x.shape, bounds.GELU_GRAD_ERROR + bounds.GELU_GRAD_FLOAT64_ERROR)
  bounds.assert_within_bounds([product], [bounds.gelu_grad64(bounds.f64(x))], [limit],
                              jnp.float32, "gelu epilogue", names=("gelu'",))


@pytest.mark.parametrize("variant", [
    dict(k_major_weight_grads=True), dict(cast_inputs=True),
    dict(cast_inputs=True, cast_weights=True), dict(cast_inputs=True, fused_casts=True),
    dict(sum_splits_in_kernel=True), dict(sum_splits_in_kernel=True, k_major_weight_grads=True),
    dict(sum_splits_in_kernel=True, cast_inputs=True, fused_casts=True)], ids=str)
def test_config_variants_compute_the_same_gradients(variant):
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.problem import Problem
  mode = DotMode.F16 if "cast_inputs" in variant else DotMode.F32
  inputs = helpers.backward_inputs(29, 40, 56)
  problem = Problem(29, 40, 56, jnp.dtype(jnp.float32), mode)
  config = triton_backend.interpret_config(problem)
  varied = triton_backend.backward(*inputs, problem=problem,
                                   config=dataclasses.replace(config, **variant), interpret=True)
  if variant.get("fused_casts"):  # Pallas rounds to f16 as XLA's convert does: bit for bit
    xla_casts = triton_backend.backward(
        *inputs, problem=problem,
        config=dataclasses.replace(config, **{**variant, "fused_casts": False}), interpret=True)
    for a, b in zip(xla_casts, varied):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  bounds.check_backward(varied, inputs, mode, str(variant))


@pytest.mark.parametrize("variant", [
    dict(), dict(sum_splits_in_kernel=True), dict(k_major_weight_grads=True),
    dict(cast_inputs=True, fused_casts=True)], ids=str)
def test_tail_tiles_compute_the_same_gradients(variant):
  # S = 37 = 32 + 5 and H = 40 = 32 + 8: 16-row tails.
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.problem import Problem
  mode = DotMode.F16 if "cast_inputs" in variant else DotMode.F32
  inputs = helpers.backward_inputs(37, 40, 56)
  problem = Problem(37, 40, 56, jnp.dtype(jnp.float32), mode)
  tile = TileConfig(32, 32, 32, tail_m=16)
  config = Config(tile, tile, dataclasses.replace(tile, split_k=2), **variant)
  ours = triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)
  bounds.check_backward(ours, inputs, mode, str(variant))


def test_mosaic_launch_1_needs_the_fused_casts_and_stays_off_the_cpu():
  from vision_mlp_bwd.backends.mosaic import launch_1_sm90
  from vision_mlp_bwd.problem import Problem
  tile = TileConfig(16, 32, 16)
  fused = dict(cast_inputs=True, fused_casts=True, mosaic_launch_1=True)
  assert Config(tile, tile, tile, **fused).launch_1_on_mosaic
  for other in (dict(cast_inputs=False, fused_casts=False), dict(fused_casts=False),
                dict(cast_weights=True), dict(mosaic_launch_1=False)):
    assert not Config(tile, tile, tile, **{**fused, **other}).launch_1_on_mosaic, other
  problem = Problem(211, 1280, 3584, jnp.dtype(jnp.float32), DotMode.F16)
  assert "interpret mode" in launch_1_sm90.unsupported_reason(problem, interpret=True)
  assert "Hopper" in launch_1_sm90.unsupported_reason(problem, interpret=False)   # the CPU
  odd = Problem(211, 1280, 3000, jnp.dtype(jnp.float32), DotMode.F16)
  assert "I=3000 is not a multiple of 128" in launch_1_sm90.unsupported_reason(odd, interpret=False)
  assert launch_1_sm90.padded_rows(211) == 216 and launch_1_sm90.padded_rows(8) == 8
  # Interpret mode then runs Triton's launch 1: the same gradients as without the flag.
  from vision_mlp_bwd.backends import triton as triton_backend
  inputs = helpers.backward_inputs(29, 40, 56)
  small = Problem(29, 40, 56, jnp.dtype(jnp.float32), DotMode.F16)
  config = dataclasses.replace(triton_backend.interpret_config(small), cast_inputs=True,
                               fused_casts=True)
  plain, flagged = (triton_backend.backward(*inputs, problem=small, interpret=True,
                                            config=dataclasses.replace(config, mosaic_launch_1=f))
                    for f in (False, True))
  for a, b in zip(plain, flagged):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

