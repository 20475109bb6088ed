"""The Triton kernels, run in Pallas interpret mode on the CPU, against float64.

Interpret mode fills every output with NaN before the kernel runs and reads
NaN out of bounds, so a missing store or a missing mask shows up as a
non-finite value. Tolerances per mode: fp32-class modes compute in true fp32
on the CPU (interpret mode has no TF32), so 1e-5; bf16x3 1e-5 (its contract);
f16 operands 2e-3 (11-bit significand, ~5e-4 observed); bf16 operands 1e-2.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import vision_mlp_bwd
from vision_mlp_bwd.backends.triton import kernels
from vision_mlp_bwd.backends.triton.config import Config, TileConfig
from vision_mlp_bwd import precision
from vision_mlp_bwd.precision import DotMode
from tests import helpers

F16 = jax.lax.DotAlgorithmPreset.F16_F16_F32
BF16 = jax.lax.DotAlgorithmPreset.BF16_BF16_F32
TOLERANCE = {None: 1e-5, "highest": 1e-5, F16: 2e-3, BF16: 1e-2}


@pytest.mark.parametrize("tokens", [1, 7, 64, 131, 300])
@pytest.mark.parametrize("precision", [None, "highest", F16, BF16], ids=str)
def test_backward_matches_float64(tokens, precision):
  hidden, intermediate = 40, 72  # not multiples of the 16/32 tiles
  inputs = helpers.backward_inputs(tokens, hidden, intermediate)
  helpers.check_triton_backward(inputs, TOLERANCE[precision], f"S={tokens}", precision=precision)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_16bit_inputs_give_16bit_outputs(dtype):
  # Inputs are exact in fp32; the only extra error is rounding the outputs to 16 bits.
  helpers.check_triton_backward(helpers.backward_inputs(50, 24, 56, dtype=dtype), 1e-2)


def test_triton_agrees_with_xla_backend():
  inputs = helpers.backward_inputs(33, 48, 80)
  f32 = jax.lax.DotAlgorithmPreset.F32_F32_F32
  ours = vision_mlp_bwd.mlp_backward(*inputs, precision=f32, implementation="triton")
  xla = vision_mlp_bwd.mlp_backward(*inputs, precision=f32, implementation="xla")
  for a, b in zip(ours, xla):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_leading_batch_dimensions():
  inputs = helpers.backward_inputs(None, 32, 48, batch=(3, 5))
  outs = vision_mlp_bwd.mlp_backward(*inputs, implementation="triton")
  assert outs[0].shape == (3, 5, 32)
  helpers.assert_close_to_oracle(outs, helpers.backward_float64(*inputs), 1e-5)


def test_zero_tokens_returns_zeros_without_kernels():
  inputs = helpers.backward_inputs(0, 16, 32)
  jaxpr = jax.make_jaxpr(
      lambda *a: vision_mlp_bwd.mlp_backward(*a, implementation="triton"))(*inputs)
  assert "pallas_call" not in str(jaxpr)
  outs = vision_mlp_bwd.mlp_backward(*inputs, implementation="triton")
  assert outs[0].shape == (0, 16)
  for out in outs[1:]:
    assert not np.any(np.asarray(out))


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
@pytest.mark.parametrize("split_k,tiles_per_program,in_kernel", [
    (1, 1, False), (3, 1, False), (1, 3, False), (2, 2, False), (3, 1, True), (2, 2, True),
    (2, 3, True)])
def test_tiled_matmul_writes_every_element_of_a_poisoned_output(transpose_a, split_k,
                                                                  tiles_per_program, in_kernel):
  m, n, k = 37, 32 * tiles_per_program + 5, 70  # tiles_per_program + 1 n blocks: a ragged group
  tile = TileConfig(16, 32, 16, split_k=split_k, tiles_per_program=tiles_per_program)
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
  np.testing.assert_allclose(product, op_a @ np.asarray(b, np.float64), rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(sums, op_a.sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("split_k,in_kernel", [(1, False), (2, False), (2, True)])
def test_tail_rows_and_a_narrow_last_step_write_every_element(transpose_a, split_k, in_kernel):
  m, n, k = 37, 45, 70    # M = 32 + 5: a 16-row tail; K = 64 + 6: unsplit, a 16-deep last step
  tile = TileConfig(32, 32, 64, split_k=split_k, tail_m=16, tail_k=16)
  product = kernels.Product(m, n, k, tile, jnp.dtype(jnp.float32))
  assert product.grid[0] == 1 and product.tail_rows == 16
  assert product.k_steps == ((1, 16) if split_k == 1 else (1, 0))
  _check_poisoned_product(m, n, k, tile, transpose_a, in_kernel)


def test_tails_only_just_past_one_block_or_step():
  tile = TileConfig(64, 32, 64, tail_m=32, tail_k=16)
  for m, tail in [(64, 0), (65, 32), (96, 32), (97, 0), (200, 0)]:
    product = kernels.Product(m, 40, 48, tile, jnp.dtype(jnp.float32))
    assert product.tail_rows == tail, m
    assert product.grid[0] == (1 if tail else -(-m // 64)), m
  for k, steps in [(64, (1, 0)), (65, (1, 16)), (80, (1, 16)), (81, (2, 0)), (7, (0, 16))]:
    assert kernels.Product(40, 40, k, tile, jnp.dtype(jnp.float32)).k_steps == steps, k
  for bad in (dict(tail_m=64), dict(tail_m=24), dict(tail_k=8)):
    with pytest.raises(ValueError, match="tail_"):
      TileConfig(64, 32, 64, **bad)


@pytest.mark.parametrize("split_k,in_kernel", [(1, False), (3, False), (3, True)])
def test_transposed_store_writes_every_element_of_a_poisoned_output(split_k, in_kernel):
  m, n, k = 37, 85, 70
  key = helpers.fresh_key()
  a = jax.random.normal(key, (k, m))                          # stored [K, M]
  b = jax.random.normal(jax.random.fold_in(key, 1), (n, k))   # stored [N, K]
  product = kernels.Product(m, n, k, TileConfig(16, 32, 16, split_k=split_k),
                            jnp.dtype(jnp.float32), transpose_a=True, transpose_b=True,
                            store_transposed=True, row_sums=True, sum_splits_in_kernel=in_kernel)
  # The counters come from a Zeros job of an earlier launch, as in the backward.
  [counters] = kernels.grouped_launch([kernels.Zeros(product.tiles, block=16)], [()],
                                      mode=DotMode.F32, interpret=True)
  assert counters.shape == (product.tiles,) and not counters.any()
  operands = (a, b, counters) if in_kernel else (a, b)
  poisoned = jnp.full(((1 if in_kernel else split_k) * n, m), jnp.nan, jnp.float32)
  [(stored, sums)] = kernels.grouped_launch([product], [operands], mode=DotMode.F32,
                                            out=poisoned, interpret=True)
  op_a = np.asarray(a, np.float64).T
  assert stored.shape == (n, m)
  np.testing.assert_allclose(stored, (op_a @ np.asarray(b, np.float64).T).T, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(sums, op_a.sum(1), rtol=1e-5, atol=1e-4)


def test_tf32_rounding_is_round_to_nearest_ties_away_and_keeps_specials():
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


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_casts_ride_along_in_a_launch_and_write_every_element(dtype):
  key = helpers.fresh_key()
  x = jax.random.normal(key, (7, 37)) * 100           # 259 elements: a ragged last block
  y = jax.random.normal(jax.random.fold_in(key, 1), (5, 3))
  a = jax.random.normal(jax.random.fold_in(key, 2), (20, 24))
  b = jax.random.normal(jax.random.fold_in(key, 3), (24, 36))
  jobs = [kernels.Cast(x.shape, jnp.dtype(dtype), block=64), kernels.Cast(y.shape, jnp.dtype(dtype), block=64),
          kernels.Product(20, 36, 24, TileConfig(16, 16, 16), jnp.dtype(jnp.float32))]
  poisoned = jnp.full((x.size,), jnp.nan, dtype)
  cast_x, cast_y, product = kernels.grouped_launch(jobs, [(x,), (y,), (a, b)], mode=DotMode.F32,
                                                   out=poisoned, interpret=True)
  for cast, source in ((cast_x, x), (cast_y, y)):
    assert cast.shape == source.shape and cast.dtype == dtype
    np.testing.assert_array_equal(np.asarray(cast), np.asarray(source.astype(dtype)))
  np.testing.assert_allclose(product, np.asarray(a, np.float64) @ np.asarray(b, np.float64),
                             rtol=1e-5, atol=1e-4)


def test_gelu_epilogue_matches_autodiff_of_gelu():
  x = jax.random.normal(helpers.fresh_key(), (20, 36)) * 3
  ones = jnp.eye(20)
  product = kernels.tiled_matmul(ones, jnp.ones((20, 36)), gelu_input=x, tile=TileConfig(16, 16, 16),
                                 mode=DotMode.F32, out_dtype=jnp.float32, interpret=True)
  expected = jax.vmap(jax.vmap(jax.grad(lambda v: jax.nn.gelu(v, approximate=True))))(x)
  np.testing.assert_allclose(product, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", [
    dict(group_launches=False), dict(k_major_weight_grads=True, k_major_weights=True),
    dict(cast_inputs=True, cast_weights=True, k_major_weights=True),
    dict(cast_inputs=True, fused_casts=True),
    dict(cast_inputs=True, fused_casts=True, group_launches=False),
    dict(weights_on_left=True), dict(weights_on_left=True, k_major_weights=True),
    dict(weights_on_left=True, k_major_weight_grads=True, group_launches=False),
    dict(cast_inputs=True, fused_casts=True, weights_on_left=True),
    dict(xla_weight_products=True, k_major_weight_grads=True),
    dict(cast_inputs=True, fused_casts=True, xla_weight_products=True),
    dict(sum_splits_in_kernel=True), dict(sum_splits_in_kernel=True, group_launches=False),
    dict(sum_splits_in_kernel=True, weights_on_left=True),
    dict(sum_splits_in_kernel=True, cast_inputs=True, fused_casts=True),
    dict(fc1_weight_grad=TileConfig(32, 16, 32))], ids=str)
def test_config_variants_compute_the_same_gradients(variant):
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.problem import Problem
  mode = DotMode.F16 if "cast_inputs" in variant else DotMode.F32
  inputs = helpers.backward_inputs(29, 40, 56)
  problem = Problem(29, 40, 56, jnp.dtype(jnp.float32), mode)
  config = triton_backend.interpret_config(problem)
  base = triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)
  varied = triton_backend.backward(*inputs, problem=problem,
                                   config=dataclasses.replace(config, **variant), interpret=True)
  if variant == dict(group_launches=False):
    for a, b in zip(base, varied):  # the same tiles in the same order: bit for bit
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  if variant.get("fused_casts"):  # Pallas rounds to f16 as XLA's convert does: bit for bit
    xla_casts = triton_backend.backward(
        *inputs, problem=problem,
        config=dataclasses.replace(config, **{**variant, "fused_casts": False}), interpret=True)
    for a, b in zip(xla_casts, varied):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert all(out.dtype == jnp.float32 for out in varied), [out.dtype for out in varied]
  tolerance = 2e-3 if mode == DotMode.F16 else 1e-5
  helpers.assert_close_to_oracle(varied, helpers.backward_float64(*inputs), tolerance)


@pytest.mark.parametrize("variant", [
    dict(), dict(sum_splits_in_kernel=True), dict(weights_on_left=True),
    dict(cast_inputs=True, fused_casts=True)], ids=str)
def test_tail_tiles_compute_the_same_gradients(variant):
  # S = 37 = 32 + 5 and H = 40 = 32 + 8: 16-row tails; K = S: a 16-deep last step.
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.problem import Problem
  mode = DotMode.F16 if "cast_inputs" in variant else DotMode.F32
  inputs = helpers.backward_inputs(37, 40, 56)
  problem = Problem(37, 40, 56, jnp.dtype(jnp.float32), mode)
  tile = TileConfig(32, 32, 32, tail_m=16, tail_k=16)
  config = Config(tile, tile, dataclasses.replace(tile, split_k=2), **variant)
  ours = triton_backend.backward(*inputs, problem=problem, config=config, interpret=True)
  tolerance = 2e-3 if mode == DotMode.F16 else 1e-5
  helpers.assert_close_to_oracle(ours, helpers.backward_float64(*inputs), tolerance)


def test_cast_pads_rows_with_zeros():
  x = jax.random.normal(helpers.fresh_key(), (13, 24)) * 100
  [out] = kernels.grouped_launch([kernels.Cast(x.shape, jnp.float16, block=64, rows=16)],
                                 [(x,)], mode=DotMode.F16, interpret=True)
  assert out.shape == (16, 24) and out.dtype == jnp.float16
  np.testing.assert_array_equal(np.asarray(out[:13]), np.asarray(x.astype(jnp.float16)))
  np.testing.assert_array_equal(np.asarray(out[13:]), 0)


def test_mosaic_launch_1_needs_the_fused_casts_and_stays_off_the_cpu():
  from vision_mlp_bwd.backends import mosaic_gpu
  from vision_mlp_bwd.problem import Problem
  tile = TileConfig(16, 32, 16)
  fused = dict(cast_inputs=True, fused_casts=True, mosaic_launch_1=True)
  assert Config(tile, tile, tile, **fused).launch_1_on_mosaic
  for other in (dict(cast_inputs=False, fused_casts=False), dict(fused_casts=False),
                dict(cast_weights=True), dict(group_launches=False), dict(weights_on_left=True),
                dict(mosaic_launch_1=False)):
    assert not Config(tile, tile, tile, **{**fused, **other}).launch_1_on_mosaic, other
  problem = Problem(211, 1280, 3584, jnp.dtype(jnp.float32), DotMode.F16)
  assert "interpret mode" in mosaic_gpu.unsupported_reason(problem, interpret=True)
  assert "Hopper" in mosaic_gpu.unsupported_reason(problem, interpret=False)   # the CPU
  odd = Problem(211, 1280, 3000, jnp.dtype(jnp.float32), DotMode.F16)
  assert "I=3000 is not a multiple of 128" in mosaic_gpu.unsupported_reason(odd, interpret=False)
  assert mosaic_gpu.padded_rows(211) == 216 and mosaic_gpu.padded_rows(8) == 8
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

