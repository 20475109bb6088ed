"""The Mosaic GEMM engine (backends/mosaic/engine.py): it lowers for CUDA at the backward's
sizes in every configuration benchmarks/engine.py times, and refuses what it cannot run.

Its numbers are measured on the GPU (`python -m benchmarks.engine`, which checks each
result against 2 gamma_K |A| |B| of cuBLAS's before timing it); here, without a GPU, the
kernels are lowered (JAX 0.10 lowers Mosaic GPU kernels for CUDA on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import engine as engine_benchmark
from vision_mlp_bwd.backends.mosaic import engine
from tests import helpers

needs_lowering = pytest.mark.skipif(not helpers.cuda_lowering_without_gpu(),
                                    reason="this JAX lowers for CUDA only on a GPU")


def _lower(m, k, n, transpose_a, config, dtype=jnp.float16):
  a = jax.ShapeDtypeStruct((k, m) if transpose_a else (m, k), dtype)
  b = jax.ShapeDtypeStruct((k, n), dtype)
  fn = functools.partial(engine.matmul, transpose_a=transpose_a, config=config, num_programs=132)
  return jax.jit(fn).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
@pytest.mark.parametrize("label", list(engine_benchmark.CONFIGS))
@pytest.mark.parametrize("product", list(engine_benchmark.PRODUCTS))
def test_every_benchmarked_config_lowers_at_full_size(product, label):
  config = engine_benchmark.CONFIGS[label]
  shape, transpose_a = engine_benchmark.PRODUCTS[product]
  m, k, n = shape(4096, 1280, 3584)
  text = _lower(m, k, n, transpose_a, config)
  assert "mosaic_gpu" in text


@needs_lowering
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_ragged_sizes_lower_where_rows_are_whole_tma_tiles(dtype):
  """M, N and K need not be multiples of a block (TMA zero-fills reads past the ends)."""
  assert "mosaic_gpu" in _lower(216, 1280, 3584, False, engine.GemmConfig(stages=3), dtype)
  assert "mosaic_gpu" in _lower(1280, 216, 3584, True, engine.GemmConfig(stages=3), dtype)


def test_bad_operands_and_configs_are_refused_with_clear_errors():
  a16 = jax.ShapeDtypeStruct((64, 128), jnp.float16)
  with pytest.raises(TypeError, match=r"one 16-bit dtype; got a float32, b float16"):
    engine.matmul(jax.ShapeDtypeStruct((64, 128), jnp.float32), a16)
  with pytest.raises(TypeError, match=r"got a float16, b float32"):
    engine.matmul(a16, jax.ShapeDtypeStruct((128, 64), jnp.float32))
  with pytest.raises(ValueError, match=r"op\(a\) is \[64, 128\] but b has shape \(64, 128\)"):
    engine.matmul(a16, a16)
  with pytest.raises(ValueError, match="split and grid_minor take 'm' or 'n'"):
    engine.GemmConfig(split="k")
  with pytest.raises(ValueError, match=r"needs 262144 bytes of shared memory for \[256, 1280\]"):
    # 6 stages of 128x64 + 64x128 f16 tiles (192 KiB) and 4 fp32 64x64 epilogue pieces (64 KiB)
    engine.matmul(jax.ShapeDtypeStruct((256, 1280), jnp.float16),
                  jax.ShapeDtypeStruct((1280, 3584), jnp.float16),
                  config=engine.GemmConfig(tile_n=64, stages=6))
  gelu = lambda acc, x: acc * x
  with pytest.raises(ValueError, match="epilogue and epilogue_operand together"):
    engine.matmul(a16, jax.ShapeDtypeStruct((128, 64), jnp.float16), epilogue=gelu)
  with pytest.raises(ValueError, match=r"epilogue_operand has shape \(72, 64\) and dtype "
                                       r"float32; expected \[M' <= 64, 64\]"):
    engine.matmul(a16, jax.ShapeDtypeStruct((128, 64), jnp.float16), epilogue=gelu,
                  epilogue_operand=jax.ShapeDtypeStruct((72, 64), jnp.float32))
  b16 = jax.ShapeDtypeStruct((128, 64), jnp.float16)
  with pytest.raises(ValueError, match="a fused epilogue runs whole blocks only"):
    engine.matmul(a16, b16, config=engine.GemmConfig(tile_n=64, tail_splits=2), epilogue=gelu,
                  epilogue_operand=jax.ShapeDtypeStruct((64, 64), jnp.float32))
  with pytest.raises(ValueError, match="line_maxima are an epilogue's"):
    engine.matmul(a16, b16, line_maxima=True)
  with pytest.raises(ValueError, match="row_scale and col_scale together"):
    engine.matmul(a16, b16, row_scale=jax.ShapeDtypeStruct((64,), jnp.float32))
  with pytest.raises(ValueError, match=r"col_scale has shape \(32,\) and dtype float32; "
                                       r"expected float32 \[64\]"):
    engine.matmul(a16, b16, row_scale=jax.ShapeDtypeStruct((64,), jnp.float32),
                  col_scale=jax.ShapeDtypeStruct((32,), jnp.float32))
  with pytest.raises(ValueError, match=r"out_dtype=None stores no product; it takes "
                                       r"speculated_copies.*speculated_copies=0"):
    engine.matmul(a16, b16, out_dtype=None, epilogue=gelu,
                  epilogue_operand=jax.ShapeDtypeStruct((64, 64), jnp.float32))
  with pytest.raises(ValueError, match=r"out_dtype=None .*column_sums='stored'"):
    engine.matmul(a16, b16, out_dtype=None, epilogue=gelu,
                  epilogue_operand=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                  speculated_copies=1, copy_scale=jax.ShapeDtypeStruct((64,), jnp.float32),
                  column_sums="stored")
  copying = engine.GemmConfig(tile_n=64, copy_programs=4)
  x32 = jax.ShapeDtypeStruct((64, 96), jnp.float32)
  with pytest.raises(ValueError, match="0 side copies with GemmConfig.copy_programs=4"):
    engine.matmul(a16, b16, config=copying)
  with pytest.raises(ValueError, match="1 side copies with GemmConfig.copy_programs=0"):
    engine.matmul(a16, b16, side_copies=[(x32, 64)])
  with pytest.raises(ValueError, match=r"side_copies\[0\] is float16 \(64, 128\) to 64 rows; "
                                       r"expected a float32 \[R, C\] array"):
    engine.matmul(a16, b16, config=copying, side_copies=[(a16, 64)])
  with pytest.raises(ValueError, match=r"side_copies\[0\] is float32 \(64, 100\)"):
    engine.matmul(a16, b16, config=copying,
                  side_copies=[(jax.ShapeDtypeStruct((64, 100), jnp.float32), 64)])
  scale = jax.ShapeDtypeStruct((3,), jnp.float32)
  with pytest.raises(ValueError, match=r"side_copies\[0\] has 1 more entries \[\(dtype\('float32'\), "
                                       r"\(3,\)\)\] with bfloat16 operands; a scaled copy takes"):
    engine.matmul(*(jax.ShapeDtypeStruct(v.shape, jnp.bfloat16) for v in (a16, b16)),
                  config=copying, side_copies=[(x32, 64, scale)])
  with pytest.raises(ValueError, match=r"side_copies\[0\] has 1 more entries \[\(dtype\('float16'\), "
                                       r"\(3,\)\)\] with float16 operands"):
    engine.matmul(a16, b16, config=copying,
                  side_copies=[(x32, 64, jax.ShapeDtypeStruct((3,), jnp.float16))])
  with pytest.raises(ValueError, match=r"side_copies\[0\] has 2 more entries"):
    engine.matmul(a16, b16, config=copying, side_copies=[(x32, 64, scale, scale)])
  with pytest.raises(ValueError, match="copy_programs=4 leaves no program of 4"):
    engine.matmul(a16, b16, config=copying, side_copies=[(x32, 64)], num_programs=4)
  with pytest.raises(ValueError, match="copy_programs must be >= 0"):
    engine.GemmConfig(copy_programs=-1)
  with pytest.raises(ValueError, match="copy_warpgroup is a ping-pong program's fourth"):
    engine.GemmConfig(copy_warpgroup=True)
  with pytest.raises(ValueError, match="copy_warpgroup is a ping-pong program's fourth"):
    engine.GemmConfig(ping_pong=True, copy_warpgroup=True, copy_programs=4)
  copier = engine.GemmConfig(ping_pong=True, stages=2, copy_warpgroup=True)
  assert copier.copies_beside and copying.copies_beside
  assert not engine.GemmConfig(ping_pong=True).copies_beside
  with pytest.raises(ValueError, match="0 side copies with .*copy_warpgroup=True"):
    engine.matmul(a16, b16, config=copier)
  with pytest.raises(ValueError, match="ping_pong runs whole blocks through one ring"):
    engine.GemmConfig(ping_pong=True, chained=True)
  with pytest.raises(ValueError, match="ping_pong runs whole blocks through one ring"):
    engine.GemmConfig(ping_pong=True, tail_splits=2)
  with pytest.raises(ValueError, match="ping_pong runs whole blocks .* stages >= 2"):
    engine.GemmConfig(ping_pong=True, stages=1)
  with pytest.raises(ValueError, match="pieces of whole 64-row groups"):
    engine.GemmConfig(ping_pong=True, epilogue_tile=(32, 64))
  with pytest.raises(ValueError, match="pieces of whole 64-row groups"):
    engine.GemmConfig(ping_pong=True, tile_n=96, epilogue_tile=(64, 64))
  ping_pong = engine.GemmConfig(ping_pong=True, stages=2)
  with pytest.raises(ValueError, match=r"ping_pong computes op\(a\) = a \(transpose_a=True\)"):
    engine.matmul(jax.ShapeDtypeStruct((128, 64), jnp.float16), b16, transpose_a=True,
                  config=ping_pong)
  with pytest.raises(ValueError, match=r"ping_pong .*N = 96 a multiple of the epilogue "
                                       r"pieces' 64 columns"):
    engine.matmul(a16, jax.ShapeDtypeStruct((128, 96), jnp.float16), config=ping_pong)
  assert engine.GemmConfig(split="m").block == (256, 128)
  assert engine.GemmConfig(tile_n=64).block == (128, 128)
  assert engine.GemmConfig(ping_pong=True).block == (128, 128)   # one warpgroup's tile


FUSED_CONFIGS = {
    "cooperative, chained": engine.GemmConfig(tile_n=64, stages=4, epilogue_tile=(64, 64),
                                              epilogue_buffers=1, chained=True,
                                              copy_programs=20),
    "ping-pong": engine.GemmConfig(tile_n=128, stages=5, epilogue_tile=(64, 64),
                                   epilogue_buffers=1, ping_pong=True, copy_programs=20),
    "ping-pong, copy warpgroup": engine.GemmConfig(tile_n=128, stages=4,
                                                   epilogue_tile=(64, 64), epilogue_buffers=1,
                                                   ping_pong=True, copy_warpgroup=True)}


@needs_lowering
@pytest.mark.parametrize("config", FUSED_CONFIGS)
@pytest.mark.parametrize("tokens", [293, 4096])
def test_the_fused_product_with_side_copies_lowers_at_full_size(tokens, config):
  """The backward's fused product with copy programs (the tables' at S=293 and 4096):
  its blocks on 132 - copy_programs programs, and hidden_state, gelu_output (padded to
  whole groups of 8 rows) and fc1_weight copied to f16 by the rest, in one launch; or
  with a copy warpgroup, the blocks on all 132 and the copies by each one's fourth
  warpgroup."""
  rows = -(-tokens // 8) * 8
  config = FUSED_CONFIGS[config]
  shapes = dict(a=((rows, 1280), jnp.float16), b=((1280, 3584), jnp.float16),
                x=((tokens, 3584), jnp.float32), h=((tokens, 1280), jnp.float32),
                w1=((3584, 1280), jnp.float32))
  args = [jax.ShapeDtypeStruct(*v) for v in shapes.values()]

  def fn(a, b, x, h, w1):
    return engine.matmul(a, b, config=config, num_programs=132, out_dtype=jnp.float16,
                         epilogue=lambda acc, t: acc * t, epilogue_operand=x,
                         column_sums="unrounded", partial_reductions=True,
                         side_copies=[(h, rows), (x, rows), (w1, 3584)])
  lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
  assert [(o.shape, o.dtype) for o in lowered.out_info[1]] == [
      ((rows, 1280), jnp.float16), ((rows, 3584), jnp.float16), ((3584, 1280), jnp.float16)]
  assert [(o.shape, o.dtype) for o in lowered.out_info[0]] == [
      ((rows, 3584), jnp.float16), ((-(-rows // 128), 3584), jnp.float32)]
  assert lowered.as_text().count("mosaic_gpu") >= 1


@pytest.mark.parametrize("count, stride", [(7, 3), (6, 3), (1, 4), (0, 2), (132, 132)])
def test_a_strided_share_counts_each_item_once_and_none_outside_its_lanes(count, stride):
  here = [int(engine._count_here(count, jnp.int32(lane), stride))
          for lane in range(-stride, 2 * stride)]
  assert here[:stride] == [0] * stride and here[2 * stride:] == [0] * stride
  lanes = here[stride:2 * stride]
  assert sum(lanes) == count and max(lanes) - min(lanes) <= 1
  assert all(n == len(range(lane, count, stride)) for lane, n in enumerate(lanes))


SCHEDULE_CASES = [  # (M, N, K, config, programs)
    (1280, 3584, 4096, engine.GemmConfig(tile_n=64, stages=6, tail_splits=16), 132),
    (1280, 3584, 4096, engine.GemmConfig(stages=3, tail_splits=16), 132),
    (3584, 1280, 1024, engine.GemmConfig(stages=3, tail_splits=16), 132),
    (4096, 3584, 1280, engine.GemmConfig(stages=3, tail_splits=4), 132),
    (4104, 3584, 1280, engine.GemmConfig(stages=3, split="m", tail_splits=16), 132),
    (64, 3584, 1280, engine.GemmConfig(stages=3, tail_splits=8), 132),
    (1000, 1000, 999, engine.GemmConfig(stages=2, tail_splits=7), 13),
    (1280, 3584, 4096, engine.GemmConfig(stages=3), 132),
]


@pytest.mark.parametrize("m, n, k, config, programs", SCHEDULE_CASES)
def test_schedule_covers_every_block_and_contraction_step_once(m, n, k, config, programs):
  """Whole blocks are the first in row-major order and fill whole waves; each tail block's
  parts cover its K-steps once (the last may run past K), at least `stages` steps each."""
  plan = engine.schedule(m, n, k, config, programs)
  grid_m, grid_n = plan.grid_mn
  block_m, block_n = config.block
  assert (grid_m - 1) * block_m < m <= grid_m * block_m
  assert (grid_n - 1) * block_n < n <= grid_n * block_n
  assert plan.k_steps == -(-k // config.tile_k) and plan.programs <= programs
  if plan.splits == 1:
    assert plan.whole == grid_m * grid_n
    return
  assert plan.whole % plan.programs == 0 and plan.tail * plan.splits <= plan.programs
  assert 2 <= plan.splits <= config.tail_splits and plan.steps_per_split >= config.stages
  assert (plan.splits - 1) * plan.steps_per_split < plan.k_steps <= (
      plan.splits * plan.steps_per_split)


@pytest.mark.parametrize("m, n, block, out_dtype", [
    (1280, 3584, (128, 256), jnp.float32), (1000, 1000, (128, 128), jnp.float32),
    (300, 520, (64, 128), jnp.bfloat16)])
def test_tail_parts_are_summed_in_order_into_the_last_blocks_only(m, n, block, out_dtype):
  """`write_tails` (a `TailSum` launch in Pallas interpret mode): each tail block becomes
  the left-to-right sum of its parts (bitwise that order), cut at the array's ends, in
  the output's dtype; every other element is untouched (poisoned NaN stays NaN), and
  products given whole pass through."""
  grid_m, grid_n = -(-m // block[0]), -(-n // block[1])
  for tail in (1, grid_n - 1, grid_n + 1, 2 * grid_n):
    if not 0 < tail < grid_m * grid_n:
      continue
    splits = 3
    plan = engine.Schedule((grid_m, grid_n), 132, 12, grid_m * grid_n - tail, splits, 4)
    parts = jax.random.normal(helpers.fresh_key(), (tail * splits, *block), jnp.float32)
    poison = jnp.full((m, n), jnp.nan, out_dtype)
    whole = jnp.ones((8, 8), jnp.float32)
    out, passed = jax.jit(lambda o, p, w: engine.write_tails(engine.SplitProduct(
        o, p.reshape(-1, block[1]), engine._tail_job(o, plan, block)), w, interpret=True))(
            poison, parts, whole)
    sums = np.asarray(parts).reshape(tail, splits, *block)
    sums = (sums[:, 0] + sums[:, 1]) + sums[:, 2]
    expected = np.full((grid_m * block[0], grid_n * block[1]), np.nan, np.float32)
    for t in range(tail):
      bm, bn = divmod(plan.whole + t, grid_n)
      expected[bm * block[0]:(bm + 1) * block[0], bn * block[1]:(bn + 1) * block[1]] = sums[t]
    assert out.shape == (m, n) and out.dtype == out_dtype
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  expected[:m, :n].astype(out_dtype).astype(np.float32),
                                  err_msg=f"{m} {n} {tail}")
    np.testing.assert_array_equal(passed, whole)


@needs_lowering
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_split_tails_lower_for_16_bit_outputs_and_ragged_sizes(out_dtype):
  """A 16-bit output keeps fp32 partials in their own, half-width epilogue buffers; the
  tail launch (`engine_tails`) writes the product in place."""
  config = engine.GemmConfig(stages=3, tail_splits=16)
  for m, k, n, transpose_a in ((1280, 4096, 3584, True), (1088, 4000, 1024, True),
                               (216, 1280, 3584, False)):
    plan = engine.schedule(m, n, k, config, 132)
    assert plan.splits > 1, plan
    a = jax.ShapeDtypeStruct((k, m) if transpose_a else (m, k), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((k, n), jnp.bfloat16)
    fn = functools.partial(engine.matmul, transpose_a=transpose_a, config=config,
                           out_dtype=out_dtype, num_programs=132)
    text = jax.jit(fn).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text and "engine_tails" in text
    assert "dynamic_update_slice" not in text and "output_operand_alias" in text


def test_engine_shapes_cases_are_well_formed():
  """benchmarks/engine_shapes.py's cases build their configs and schedules on the CPU."""
  from benchmarks import engine_shapes
  for m, k, n, transpose_a, fields, out_dtype in engine_shapes.CASES:
    config = engine.GemmConfig(**fields)
    plan = engine.schedule(m, n, k, config, 132)
    assert plan.programs == 132 and plan.whole + plan.tail == plan.grid_mn[0] * plan.grid_mn[1]
    assert jnp.dtype(out_dtype).itemsize * config.epilogue_tile[1] >= engine.SWIZZLE
    assert engine.shared_memory_bytes(config, plan.k_steps, jnp.float16, out_dtype,
                                      plan.splits > 1) <= engine.SHARED_MEMORY_BYTES - 1024


@pytest.mark.parametrize("transpose_a", [False, True])
def test_the_benchmarks_bound_holds_for_the_exact_product(transpose_a):
  """benchmarks.engine.reference_and_bound: the float64 product of the same f16 operands lies
  within the bound of the fp32 reference (both are accumulations of the same exact products)."""
  m, k, n = 48, 200, 40
  ka, kb = jax.random.split(helpers.fresh_key())
  a = jax.random.normal(ka, (k, m) if transpose_a else (m, k), jnp.float16)
  b = jax.random.normal(kb, (k, n), jnp.float16)
  ref, bound = engine_benchmark.reference_and_bound(a, b, transpose_a)
  a64 = np.asarray(a, np.float64)
  exact = (a64.T if transpose_a else a64) @ np.asarray(b, np.float64)
  assert ref.shape == (m, n) and bool(jnp.all(bound > 0))
  assert np.all(np.abs(np.asarray(ref, np.float64) - exact) <= np.asarray(bound))


@needs_lowering
@pytest.mark.parametrize("m, k, n, config, epilogue_dtype, scaled, reduced", [
    (256, 1280, 3584, engine.GemmConfig(tile_n=64, stages=6), None, False, False),
    (256, 1280, 3584, engine.GemmConfig(tile_n=64, stages=6, mma_in_flight=1,
                                        epilogue_tile=(64, 32)), jnp.float32, False, False),
    (256, 1280, 3584, engine.GemmConfig(tile_n=64, stages=6, mma_in_flight=1,
                                        epilogue_tile=(64, 32)), jnp.float32, True, False),
    (256, 1280, 3584, engine.GemmConfig(tile_n=64, stages=6, mma_in_flight=1,
                                        epilogue_tile=(64, 32)), jnp.float32, True, True),
    (256, 1280, 3584, engine.GemmConfig(stages=6, epilogue_buffers=1, ping_pong=True),
     jnp.float32, False, True),
    (256, 1280, 3584, engine.GemmConfig(stages=5, epilogue_buffers=1, ping_pong=True),
     jnp.float32, True, True),
    (256, 1280, 3584, engine.GemmConfig(stages=6, epilogue_buffers=1, ping_pong=True,
                                        copy_warpgroup=True), jnp.float32, False, True),
    (256, 1280, 3584, engine.GemmConfig(stages=5, epilogue_buffers=1, ping_pong=True,
                                        copy_warpgroup=True), jnp.float32, True, True)])
def test_shared_memory_estimate_matches_mosaics_own_count(monkeypatch, m, k, n, config,
                                                          epilogue_dtype, scaled, reduced):
  """Where Mosaic's lowering counts shared memory itself (JAX 0.10.2 refuses a kernel over
  the limit), the engine's estimate is at most BARRIER_SLACK_BYTES below its count."""
  import re
  monkeypatch.setattr(engine, "SHARED_MEMORY_BYTES", 10 ** 7)   # let Mosaic judge
  a, b = (jax.ShapeDtypeStruct(s, jnp.float16) for s in ((m, k), (k, n)))
  x = jax.ShapeDtypeStruct((m, n), epilogue_dtype or jnp.float32)

  def fn(a, b, x):
    extra = {} if epilogue_dtype is None else dict(epilogue=lambda acc, t: acc * t,
                                                   epilogue_operand=x)
    if scaled:
      extra.update(row_scale=x[:, 0], col_scale=x[0])
    if reduced:   # column sums and line maxima
      extra.update(column_sums="unrounded", line_maxima=True)
    if config.copy_warpgroup:   # (scaled with the product: DEFAULT's copies)
      extra.update(side_copies=[(x, m, *((x[0],) if scaled else ()))])
    return engine.matmul(a, b, config=config, num_programs=132, **extra)

  try:
    jax.jit(fn).trace(a, b, x).lower(lowering_platforms=("cuda",))
  except ValueError as refused:
    counted = int(re.search(r"exceeds available shared memory: smem_bytes=(\d+)",
                            str(refused))[1])
  else:
    pytest.skip("this JAX's Mosaic lowering does not count shared memory")
  estimate = engine.shared_memory_bytes(config, -(-k // config.tile_k), jnp.float16,
                                        jnp.float32, False, epilogue_dtype, column_sums=reduced,
                                        scales=scaled, line_maxima=reduced,
                                        scaled_side_copies=scaled)
  assert 0 <= counted - estimate <= engine.BARRIER_SLACK_BYTES, (counted, estimate)


@pytest.mark.parametrize("stages", [1, 2, 3, 4, 6, 8])
def test_a_chained_schedule_covers_k_once_in_whole_rings(stages):
  """Chained pipelines need steps in whole rings: every block's steps and every K-part's
  are multiples of the ring, the ring is at least half the configured stages (or all
  the steps there are), and the parts cover K's steps exactly once, none empty."""
  config = engine.GemmConfig(tile_n=64, stages=stages, chained=True, tail_splits=16)
  for k_steps in range(1, 81):
    plan = engine.schedule(1280, 3584, 64 * k_steps, config, 132)
    deepest = min(stages, k_steps)
    assert max(1, min(2, deepest), deepest // 2) <= plan.ring <= deepest
    assert plan.whole_steps % plan.ring == 0 and 0 <= plan.whole_steps - k_steps < plan.ring
    if plan.splits > 1:
      assert plan.steps_per_split % plan.ring == 0
      parts = plan.splits * plan.steps_per_split
      assert parts - plan.steps_per_split < k_steps <= parts


def test_chained_takes_no_wgmma_group_in_flight():
  with pytest.raises(ValueError, match="chained takes mma_in_flight=0"):
    engine.GemmConfig(chained=True, mma_in_flight=1)
