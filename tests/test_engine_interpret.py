"""The Hopper GEMM engine run on the CPU, in Pallas's GPU interpret mode.

The interpreter runs the kernel's programs, warpgroups, TMA copies, barriers
and wgmma on the CPU, so the engine's schedule (whole blocks, the last wave
split along K and summed in order), its warp-specialized pipeline and its
fused epilogue are checked in CI against a float64 oracle. Two things it does
not model are left to the GPU tests (tests/test_gpu.py): TMA's zero fill of
reads past an array's end (it raises instead, so every shape here is whole
blocks) and transposed shared-memory operands (the weight gradients'
`transpose_a`).

Bounds: an fp32 accumulation of K exact 16-bit products lies within
γ_K (|A| |B|) of the exact sum, γ_K = K u / (1 - K u), u = 2^-24. The fused
epilogue multiplies by the fp32 GELU derivative (within 5e-7 of the float64
value on [-12, 12], tests/test_gelu.py) with one fp32 rounding, then stores
in bf16 (unit roundoff 2^-8).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from vision_mlp_bwd import precision, reference
from vision_mlp_bwd.backends.mosaic import engine

interpret_params = pytest.importorskip("jax._src.pallas.mosaic_gpu.interpret.params",
                                       reason="this JAX has no Pallas GPU interpret mode")

U32, U_BF16, GELU_GRAD_ERROR = 2.0 ** -24, 2.0 ** -8, 5e-7
C = engine.GemmConfig
CASES = {   # M, K, N, config, programs, out dtype, epilogue operand dtype
    "whole blocks, fewer programs than blocks": (256, 128, 256, C(tile_n=64, stages=2), 3,
                                                  jnp.float32, None),
    "one wgmma group in flight, 16-bit out": (256, 256, 128, C(
        tile_n=64, stages=3, mma_in_flight=1, epilogue_tile=(64, 64)), 2, jnp.bfloat16, None),
    "chained pipelines, K-parts after whole blocks": (256, 256, 256, C(
        tile_n=64, stages=2, tail_splits=4, chained=True), 3, jnp.float32, None),
    "chained pipelines, several blocks per program": (512, 128, 256, C(
        tile_n=64, stages=2, chained=True), 3, jnp.bfloat16, None),
    "GELU epilogue, fp32 operand": (128, 128, 256, C(tile_n=64, stages=2,
                                                     epilogue_tile=(64, 64)), 2, jnp.bfloat16,
                                    jnp.float32),
    "GELU epilogue, bf16 operand": (128, 128, 256, C(tile_n=64, stages=2,
                                                     epilogue_tile=(64, 64)), 2, jnp.bfloat16,
                                    jnp.bfloat16),
    # ping-pong: 3 blocks per program (2 on warpgroup 0, 1 on warpgroup 1), a ring that wraps
    # within a block and across blocks
    "ping-pong, two output pieces in flight": (384, 192, 256, C(ping_pong=True, stages=2), 2,
                                               jnp.float32, None),
    "ping-pong, GELU epilogue, fp32 operand": (384, 192, 256, C(
        ping_pong=True, stages=2, epilogue_buffers=1), 2, jnp.bfloat16, jnp.float32),
}


def gelu_grad64(x):
  """The contract's tanh-GELU derivative in float64."""
  u = np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)
  t = np.tanh(u)
  return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * x * x)


def _exact_and_bound(a, b, gelu_operand, out_dtype, scale=1.0):
  """The float64 value of the engine's output and the bound of its error (module docstring):
  `(a @ b) * scale`, times gelu'(gelu_operand) when given, stored as `out_dtype`."""
  a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
  k = a64.shape[1]
  exact = (a64 @ b64) * scale
  bound = k * U32 / (1 - k * U32) * (np.abs(a64) @ np.abs(b64)) * scale
  if gelu_operand is not None:
    g = gelu_grad64(np.asarray(gelu_operand, np.float64))
    exact, bound = exact * g, bound * np.abs(g) + np.abs(exact) * (GELU_GRAD_ERROR + 2 * U32)
  if out_dtype != jnp.float32:
    bound = bound * (1 + U_BF16) + U_BF16 * np.abs(exact)
  return exact, bound


@pytest.mark.parametrize("case", [
    pytest.param(c, marks=pytest.mark.transcendental) if CASES[c][-1] is not None else c
    for c in CASES])   # the GELU epilogue's exp: under every CPU vector ISA in CI
def test_engine_in_interpret_mode_within_its_bound(case):
  m, k, n, config, programs, out_dtype, operand_dtype = CASES[case]
  keys = jax.random.split(jax.random.key(hash(case) % 2 ** 31), 3)
  dtype = jnp.float16 if operand_dtype is None else jnp.bfloat16   # bf16: no F16C needed
  a = jax.random.normal(keys[0], (m, k), dtype)
  b = jax.random.normal(keys[1], (k, n), dtype)
  extra = {}
  if operand_dtype is not None:
    x = jax.random.normal(keys[2], (m, n), operand_dtype) * 3
    extra = dict(epilogue=reference.gelu_backward, epilogue_operand=x)
  # Unwritten output elements read as NaN in the interpreter, and fail the bound.
  out = engine.matmul(a, b, config=config, num_programs=programs, out_dtype=out_dtype,
                      interpret=interpret_params.InterpretGPUParams(), **extra)
  assert out.shape == (m, n) and out.dtype == out_dtype
  exact, bound = _exact_and_bound(a, b, extra.get("epilogue_operand"), out_dtype)
  error = np.abs(np.asarray(out, np.float64) - exact)
  assert np.all(error <= bound), (case, float(np.nanmax(error / bound)))


EPILOGUE_REDUCTIONS = {   # M, K, N, programs, config, column_sums, operand dtype, out dtype
    "unrounded": (256, 128, 256, 3, C(tile_n=64, stages=2, epilogue_tile=(64, 64)),
                  "unrounded", jnp.bfloat16, jnp.bfloat16),
    "stored": (256, 128, 256, 3, C(tile_n=64, stages=2, epilogue_tile=(64, 64)), "stored",
               jnp.bfloat16, jnp.bfloat16),
    "ping-pong, unrounded": (384, 128, 256, 2, C(ping_pong=True, stages=3, epilogue_buffers=1),
                             "unrounded", jnp.float32, jnp.bfloat16),
    "ping-pong, stored": (384, 128, 256, 4, C(ping_pong=True, stages=3), "stored",
                          jnp.bfloat16, jnp.bfloat16),
}


@pytest.mark.transcendental
@pytest.mark.parametrize("case", EPILOGUE_REDUCTIONS)
def test_epilogue_column_sums_in_interpret_mode_within_their_bound(case):
  """The fused epilogue's column sums, the two compute warpgroups taking turns: over 2 x 2
  blocks on 3 programs (so one program runs two blocks); ping-pong over 3 x 2 blocks on 2
  programs (each warpgroup's blocks in turn) and on 4 (1 or 2 blocks a program: warpgroup
  1 idle in some). "unrounded" sums the fp32
  values: each within its float64 bound, plus fp32 summation of M terms; "stored" sums
  the bf16 values stored, within fp32 summation of M terms of the stored output itself.
  With "unrounded", also the line maxima: the largest |fp32 value| of each column and row
  is within the largest element bound of that line of the float64 maximum (a maximum
  moves by at most its elements' largest error)."""
  m, k, n, programs, config, column_sums, operand_dtype, out_dtype = EPILOGUE_REDUCTIONS[case]
  keys = jax.random.split(jax.random.key(7 + len(case)), 3)
  a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  b = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
  x = jax.random.normal(keys[2], (m, n), operand_dtype) * 3
  maxima = column_sums == "unrounded"
  out, sums, *line_max = engine.matmul(
      a, b, config=config, num_programs=programs,
      out_dtype=out_dtype, epilogue=reference.gelu_backward, epilogue_operand=x,
      column_sums=column_sums, line_maxima=maxima,
      interpret=interpret_params.InterpretGPUParams())
  assert sums.shape == (n,) and sums.dtype == jnp.float32 and out.dtype == out_dtype
  exact, bound = _exact_and_bound(a, b, x, out_dtype)
  error = np.abs(np.asarray(out, np.float64) - exact)   # every element written (NaN fails)
  assert np.all(error <= bound), float(np.nanmax(error / bound))
  gamma_m = m * U32 / (1 - m * U32)
  if column_sums == "stored":
    stored = np.asarray(out, np.float64)
    exact, bound = stored.sum(0), gamma_m * np.abs(stored).sum(0)
  else:
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    g = gelu_grad64(np.asarray(x, np.float64))
    values = (a64 @ b64) * g
    element_bound = (k * U32 / (1 - k * U32) * (np.abs(a64) @ np.abs(b64)) * np.abs(g)
                     + np.abs(values) * (GELU_GRAD_ERROR + 2 * U32))
    exact = values.sum(0)
    bound = element_bound.sum(0) + gamma_m * (np.abs(values) + element_bound).sum(0)
    for axis, found in enumerate(line_max):   # columns' maxima, then rows'
      assert found.shape == (values.shape[1 - axis],) and found.dtype == jnp.float32
      line_error = np.abs(np.asarray(found, np.float64) - np.abs(values).max(axis))
      assert np.all(line_error <= element_bound.max(axis)), axis
  error = np.abs(np.asarray(sums, np.float64) - exact)
  assert np.all(error <= bound), float(np.nanmax(error / bound))


SCALED = {   # M, K, N, config, programs
    "last wave split along K": (256, 384, 256, C(tile_n=64, stages=2, tail_splits=4), 3),
    "ping-pong": (384, 128, 256, C(ping_pong=True, stages=3, epilogue_buffers=1), 2),
}


@pytest.mark.parametrize("case", SCALED)
def test_row_and_column_scales_in_interpret_mode_within_their_bound(case):
  """`row_scale` and `col_scale` multiply the accumulator, of whole blocks and of the split
  tail's K-parts (the engine's unchained last-wave split, unscaled in the chained case
  above), and of ping-pong blocks (3 x 2 on 2 programs, each warpgroup's in turn):
  powers of two from 2^-10 to 2^10, so the bound of the unscaled product scales exactly
  with them. (With the GELU epilogue they are checked on the GPU, tests/test_gpu.py,
  DEFAULT; an interpret-mode run of it costs CI half a minute.)"""
  m, k, n, config, programs = SCALED[case]
  out_dtype, operand_dtype = jnp.float32, None
  plan = engine.schedule(m, n, k, config, programs)
  assert config.ping_pong or plan.splits > 1 and plan.tail > 0 and plan.whole > 0
  keys = jax.random.split(jax.random.key(11 + len(case)), 5)
  a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  b = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
  row = jnp.exp2(jax.random.randint(keys[2], (m,), -10, 10).astype(jnp.float32))
  col = jnp.exp2(jax.random.randint(keys[3], (n,), -10, 10).astype(jnp.float32))
  extra = {}
  if operand_dtype is not None:
    x = jax.random.normal(keys[4], (m, n), operand_dtype) * 3
    extra = dict(epilogue=reference.gelu_backward, epilogue_operand=x)
  out = engine.matmul(a, b, config=config, num_programs=programs, out_dtype=out_dtype,
                      row_scale=row, col_scale=col,
                      interpret=interpret_params.InterpretGPUParams(), **extra)
  scale = np.asarray(row, np.float64)[:, None] * np.asarray(col, np.float64)[None, :]
  exact, bound = _exact_and_bound(a, b, extra.get("epilogue_operand"), out_dtype, scale)
  error = np.abs(np.asarray(out, np.float64) - exact)
  assert np.all(error <= bound), (case, float(np.nanmax(error / bound)))



SPECULATED = {   # M, config, programs
    "64x32 pieces": (256, C(tile_n=64, stages=2, epilogue_tile=(64, 32), epilogue_buffers=1),
                     3),
    "ping-pong": (384, C(ping_pong=True, stages=3, epilogue_buffers=1), 2),
}


@pytest.mark.transcendental
@pytest.mark.parametrize("case", SPECULATED)
def test_speculated_copies_in_interpret_mode_are_the_scaled_stored_values(case):
  """`speculated_copies`: each f16 copy is bitwise `scaled_f16_operand` of the fp32 values
  the fused epilogue stores, times `copy_scale` per column (every element written:
  unwritten ones read NaN), from pieces of 32 f16 columns (the TF32 pre-GELU config's, a
  64-byte swizzle) over 2 x 2 blocks on 3 programs, and from a ping-pong product's 64x64
  pieces over 3 x 2 blocks on 2 programs; with `out_dtype=None` the same copies, and
  nothing else, through one or two pieces per warpgroup."""
  m, config, programs = SPECULATED[case]
  k, n = 128, 256
  keys = jax.random.split(jax.random.key(23), 3)
  a = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
  b = jax.random.normal(keys[1], (k, n), jnp.bfloat16) * 2.0 ** -6
  x = jax.random.normal(keys[2], (m, n), jnp.float32) * 3
  copy_scale = jnp.exp2(-2.0 + jnp.arange(n) // 16)   # 2^-2 to 2^13, one per 16 columns
  out, *copies = engine.matmul(a, b, config=config, num_programs=programs,
                               out_dtype=jnp.float32,
                               epilogue=reference.gelu_backward, epilogue_operand=x,
                               speculated_copies=2, copy_scale=copy_scale,
                               interpret=interpret_params.InterpretGPUParams())
  exact, bound = _exact_and_bound(a, b, x, jnp.float32)
  assert np.all(np.abs(np.asarray(out, np.float64) - exact) <= bound)
  want = precision.scaled_f16_operand(out, copy_scale)
  assert len(copies) == 2
  for copy in copies:
    assert copy.dtype == jnp.float16 and copy.shape == (m, n)
    np.testing.assert_array_equal(np.asarray(copy), np.asarray(want))
  for buffers in (1, 2):
    copies_alone = engine.matmul(
        a, b, config=dataclasses.replace(config, epilogue_buffers=buffers),
        num_programs=programs,
        out_dtype=None, epilogue=reference.gelu_backward, epilogue_operand=x,
        speculated_copies=2, copy_scale=copy_scale,
        interpret=interpret_params.InterpretGPUParams())
    assert len(copies_alone) == 2
    for copy in copies_alone:
      np.testing.assert_array_equal(np.asarray(copy), np.asarray(want))


@pytest.mark.parametrize("m, n, programs, scaled", [(384, 256, 2, False),
                                                    (128, 128, 2, True)])
def test_a_ping_pong_copy_warpgroup_copies_bitwise_beside_the_fused_product(m, n, programs,
                                                                            scaled):
  """`GemmConfig.copy_warpgroup`: the ping-pong program's fourth warpgroup makes the side
  copies while its compute warpgroups run the fused product with column sums: each fp32
  source rounded to the operands' dtype bitwise, every element written (unwritten ones
  read NaN), for sources of more tiles than programs, of one tile, and of fewer tiles
  than programs; the product and its sums as without copies, bitwise (their bounds are
  the ping-pong cases' above, so this one is not rerun per CPU ISA). 3 x 2 blocks on 2
  programs (3 each, alternating warpgroups); one block on 2, where one computes no block
  and still copies, there with the first and last sources scaled (f16 operands; DEFAULT's
  copies): f16(x * scale[0]) bitwise, and the partial rows' largest finite |x| per column
  that of the source (a NaN and an Inf in it).
  (Copy tiles past a source's end are the GPU tests': the interpreter models no TMA
  zero fill.)"""
  k = 128
  dtype = jnp.float16 if scaled else jnp.bfloat16
  config = C(ping_pong=True, stages=3, epilogue_buffers=1, copy_warpgroup=True)
  rows, cols = engine.COPIER_TILE
  shapes = [(7 * rows, 2 * cols), (rows, cols), (2 * rows, 3 * cols)]
  keys = jax.random.split(jax.random.key(41 + programs), 3 + len(shapes))
  a = jax.random.normal(keys[0], (m, k), dtype)
  b = jax.random.normal(keys[1], (k, n), dtype)
  x = jax.random.normal(keys[2], (m, n), jnp.float32) * 3
  sources = [jax.random.normal(key, shape, jnp.float32) * 2.0 ** 9
             for key, shape in zip(keys[3:], shapes)]
  scales = [None] * len(sources)
  if scaled:
    sources[0] = sources[0].at[5, 3].set(jnp.nan).at[rows + 1, cols + 7].set(-jnp.inf)
    scales[0], scales[2] = (jnp.array([2.0 ** e, 3.0], jnp.float32) for e in (-3, 2))
  run = lambda config, **kw: engine.matmul(
      a, b, config=config, num_programs=programs, out_dtype=dtype,
      epilogue=reference.gelu_backward, epilogue_operand=x, column_sums="unrounded",
      interpret=interpret_params.InterpretGPUParams(), **kw)
  (out, sums), copies = run(config, side_copies=[
      (s, s.shape[0], *(() if scale is None else (scale,))) for s, scale in zip(sources, scales)])
  want_out, want_sums = run(dataclasses.replace(config, copy_warpgroup=False))
  np.testing.assert_array_equal(np.asarray(out), np.asarray(want_out))
  np.testing.assert_array_equal(np.asarray(sums), np.asarray(want_sums))
  assert not np.isnan(np.asarray(out, np.float32)).any()   # every element written
  assert len(copies) == len(sources)
  for source, scale, copy in zip(sources, scales, copies):
    if scale is None:
      assert copy.dtype == dtype and copy.shape == source.shape
      np.testing.assert_array_equal(np.asarray(copy), np.asarray(source.astype(dtype)))
      continue
    copy, partial_max = copy
    np.testing.assert_array_equal(np.asarray(copy),
                                  np.asarray(precision.scaled_f16_operand(source, scale[0])))
    assert partial_max.shape == (engine.copy_parts(programs, source), source.shape[1])
    np.testing.assert_array_equal(np.asarray(partial_max).max(axis=0),
                                  np.asarray(precision.finite_abs(source)).max(axis=0))


def test_copy_programs_in_interpret_mode_copy_every_element_bitwise():
  """`_copy_tiles`, the side copies' programs, alone in a launch of 2 copy programs (6
  warpgroups): each fp32 source rounded to the 16-bit dtype, bitwise, every element
  written (unwritten ones read NaN), for sources of several tiles per warpgroup, of one
  tile, and of fewer tiles than warpgroups. (The engine's launch with both blocks and
  copy programs does not run in the interpreter: its scoped allocations are matched
  across threads by their order, and it waits forever there; the GPU tests run it.)"""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, cols = engine.COPY_TILE
  shapes = [(12 * rows, 2 * cols), (rows, cols), (2 * rows, 3 * cols)]
  keys = jax.random.split(jax.random.key(31), len(shapes))
  sources = [jax.random.normal(key, shape, jnp.float32) * 2.0 ** 9
             for key, shape in zip(keys, shapes)]

  def kernel(*refs):
    engine._copy_tiles(refs[:len(shapes)], refs[len(shapes):], first_program=0, workers=2)
  copies = plgpu.kernel(
      kernel, out_type=tuple(jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes),
      grid=(2,), grid_names=("program",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret_params.InterpretGPUParams())(*sources)
  for source, copy in zip(sources, copies):
    np.testing.assert_array_equal(np.asarray(copy), np.asarray(source.astype(jnp.bfloat16)))


def test_scaled_copy_programs_in_interpret_mode_copy_bitwise_and_find_column_maxima():
  """`_copy_tiles` with scales (DEFAULT's side copies): each fp32 source copied as
  `scaled_f16_operand(x, scale[0])`, bitwise, and its partial column maxima `[P, C]`,
  whose largest row is the largest finite |x| of each column, exactly (a maximum is
  exact); NaN and Inf copied as the cast makes them and left out of the maxima; every
  element of the copies and the partial rows written (unwritten ones read NaN). Shapes
  of several row tiles per lane, one tile (lanes with no tiles write zero rows), and
  three column strips."""
  from jax.experimental.pallas import mosaic_gpu as plgpu
  rows, cols = engine.COPY_TILE
  workers = 2
  shapes = [(12 * rows, 2 * cols), (rows, cols), (2 * rows, 3 * cols)]
  keys = jax.random.split(jax.random.key(37), len(shapes))
  sources = [jax.random.normal(key, shape, jnp.float32) * 2.0 ** 9
             for key, shape in zip(keys, shapes)]
  sources[0] = sources[0].at[5, 3].set(jnp.nan).at[rows + 1, cols + 7].set(-jnp.inf)
  sources[2] = sources[2].at[rows, 2 * cols].set(jnp.inf)
  scales = [jnp.array([2.0 ** e, 3.0, -1.0], jnp.float32) for e in (5, -3, 0)]
  parts = [engine.copy_parts(3 * workers, x) for x in sources]

  def kernel(*refs):
    n = len(shapes)
    sources_, scales_, copies_, maxima_ = (refs[i * n:(i + 1) * n] for i in range(4))
    engine._copy_tiles(sources_, copies_, first_program=0, workers=workers,
                       scales=scales_, maxima=maxima_)
  outs = plgpu.kernel(
      kernel, out_type=tuple(jax.ShapeDtypeStruct(s, jnp.float16) for s in shapes)
      + tuple(jax.ShapeDtypeStruct((p, s[1]), jnp.float32) for p, s in zip(parts, shapes)),
      grid=(workers,), grid_names=("program",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret_params.InterpretGPUParams())(*sources, *scales)
  copies, maxima = outs[:len(shapes)], outs[len(shapes):]
  for source, scale, copy, partial_max in zip(sources, scales, copies, maxima):
    want = precision.scaled_f16_operand(source, scale[0])
    np.testing.assert_array_equal(np.asarray(copy), np.asarray(want))
    partial_max = np.asarray(partial_max)
    assert not np.isnan(partial_max).any()
    np.testing.assert_array_equal(partial_max.max(axis=0),
                                  np.asarray(precision.finite_abs(source)).max(axis=0))
