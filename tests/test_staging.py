"""The staging jobs (backends/staging.py), run in Pallas interpret mode on the CPU.

Interpret mode fills every output with NaN before the kernel runs and reads NaN
out of bounds, so a missing store or mask shows as a non-finite value; the
first job's copy also goes into a NaN-filled buffer of the test's own.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vision_mlp_bwd import precision, reference
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.shared import sum_in_order
from vision_mlp_bwd.precision import DotMode
from tests import bounds, helpers


def _assert_column_sums(sums, x):
  """fp32 sums of R terms in any order, against float64: within gamma_R sum |x| (Higham,
  eq. 4.4), and NaN or Inf exactly where the float64 sum has them."""
  v = np.asarray(x, np.float64)
  chex.assert_shape(sums, (x.shape[1],))
  assert sums.dtype == jnp.float32
  ours, ref = np.asarray(sums, np.float64), v.sum(axis=0)
  ok = np.isfinite(ref)
  bound = bounds.gamma(x.shape[0]) * np.abs(v).sum(axis=0)
  assert np.all(np.abs(ours[ok] - ref[ok]) <= bound[ok])
  np.testing.assert_array_equal(ours[~ok], ref[~ok])


@pytest.mark.parametrize("dtype, out_dtype", [(jnp.float32, jnp.float16),
                                              (jnp.float32, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.bfloat16)])
def test_cast_pads_rows_with_zeros_and_sums_the_columns(dtype, out_dtype):
  key = helpers.fresh_key()
  x = (jax.random.normal(key, (45, 70)) * 100).astype(dtype)   # ragged tiles both ways
  x = x.at[3, 5].set(jnp.inf).at[40, 9].set(jnp.nan)
  job = staging.Cast(x.shape, jnp.dtype(out_dtype), rows=48, sums=True, block=(8, 32))
  poisoned = jnp.full((48, 70), jnp.nan, out_dtype)
  [(copy, sums)] = staging.grouped_launch([job], [(x,)], mode=DotMode.F16, out=poisoned,
                                          interpret=True)
  chex.assert_shape(copy, (48, 70))
  chex.assert_type(copy, out_dtype)
  chex.assert_trees_all_equal(copy[:45], x.astype(out_dtype))
  chex.assert_trees_all_equal(copy[45:], jnp.zeros((3, 70), out_dtype))
  _assert_column_sums(sums, x)


@pytest.mark.transcendental
def test_cast_with_an_epilogue_applies_the_gelu_derivative_and_sums_the_values():
  """The pass after XLA's pre-GELU product: gelu'(operand) times x in fp32 (operand rows
  past its own read as zeros), stored in f16 with fewer rows than x, and the fp32 column
  sums of the stored rows' values. Against float64: each value is off by x's magnitude
  times the derivative's error (bounds.GELU_GRAD_ERROR) plus two fp32 roundings, then by
  the f16 rounding (u = 2^-11, or half the smallest subnormal, 2^-25); the sums add
  gamma_R of the values' magnitudes (Higham, eq. 4.4)."""
  keys = jax.random.split(helpers.fresh_key())
  x = jax.random.normal(keys[0], (45, 70)) * 30   # ragged tiles both ways
  operand = jax.random.normal(keys[1], (43, 70)) * 3
  job = staging.Cast(x.shape, jnp.dtype(jnp.float16), rows=44, sums=True, block=(8, 32),
                     epilogue=reference.gelu_backward)
  poisoned = jnp.full((44, 70), jnp.nan, jnp.float16)
  [(copy, sums)] = staging.grouped_launch([job], [(x, operand)], mode=DotMode.F16,
                                          out=poisoned, interpret=True)
  chex.assert_shape(copy, (44, 70))
  chex.assert_type(copy, jnp.float16)
  x64 = np.asarray(x, np.float64)[:44]
  derivative = bounds.gelu_grad64(np.pad(np.asarray(operand, np.float64), ((0, 1), (0, 0))))
  exact = x64 * derivative
  value_bound = np.abs(x64) * bounds.GELU_GRAD_ERROR + 2 * bounds.U32 * np.abs(exact)
  copy_bound = (value_bound + bounds.U_F16 * (np.abs(exact) + value_bound)
                + 2.0 ** -25)
  assert np.all(np.abs(np.asarray(copy, np.float64) - exact) <= copy_bound)
  sums_bound = value_bound.sum(0) + bounds.gamma(44) * (np.abs(exact) + value_bound).sum(0)
  assert sums.shape == (70,) and sums.dtype == jnp.float32
  assert np.all(np.abs(np.asarray(sums, np.float64) - exact.sum(0)) <= sums_bound)


@pytest.mark.parametrize("along", ["columns", "rows"])
def test_cast_writes_bf16x3_pieces_side_by_side(along):
  """`Cast(terms=...)`: the pieces of `precision.split_bf16`, bitwise, in the order asked,
  as `[R, T, C]` or `[T, R, C]` (every element written: the first job's copy goes into a
  NaN-filled buffer), zero rows past x, the columns summed; NaN and Inf stay in the hi
  piece (lo = Inf - Inf is NaN, as the Triton kernels' split has it). A second job,
  with fewer rows than its input, keeps x's first rows."""
  key = helpers.fresh_key()
  x = jax.random.normal(key, (45, 70)) * 100   # ragged tiles both ways
  x = x.at[3, 5].set(jnp.inf).at[40, 9].set(jnp.nan)
  order = ("lo", "hi", "hi")
  job = staging.Cast(x.shape, jnp.dtype(jnp.bfloat16), rows=48, sums=True, block=(8, 32),
                     terms=order, terms_along=along)
  cut = dataclasses.replace(job, rows=40, sums=False, terms=("hi", "lo"))
  poisoned = jnp.full(job.copy_shape, jnp.nan, jnp.bfloat16)
  [(copy, sums), cut_copy] = staging.grouped_launch([job, cut], [(x,), (x,)],
                                                    mode=DotMode.HIGHEST, out=poisoned,
                                                    interpret=True)
  hi, lo = precision.split_bf16(jnp.pad(x, ((0, 3), (0, 0))))
  stack = lambda parts, axis: jnp.concatenate(parts, axis=axis)
  axis = 1 if along == "columns" else 0
  pieces = {"hi": hi, "lo": lo}
  chex.assert_shape(copy, (48, 3 * 70) if along == "columns" else (3 * 48, 70))
  chex.assert_trees_all_equal(copy, stack([pieces[t] for t in order], axis))
  chex.assert_trees_all_equal(cut_copy, stack([hi[:40], lo[:40]], axis))
  assert jnp.isinf(hi[3, 5]) and jnp.isnan(lo[3, 5]) and jnp.isnan(hi[40, 9])
  np.testing.assert_array_equal(np.asarray(hi[45:], np.float32), 0.0)
  _assert_column_sums(sums, x)


def test_cast_without_a_copy_returns_the_column_sums_alone():
  x = jax.random.normal(helpers.fresh_key(), (300, 40)).astype(jnp.bfloat16)
  zeros = staging.Zeros(5, block=4)
  sums, counters = staging.grouped_launch(
      [staging.Cast(x.shape, None, sums=True, block=(16, 32)), zeros], [(x,), ()],
      mode=DotMode.BF16, interpret=True)
  _assert_column_sums(sums, x)
  assert counters.shape == (5,) and not counters.any()


def test_cast_refuses_a_job_with_nothing_to_do():
  x = jnp.ones((4, 4))
  with pytest.raises(AssertionError):
    staging.grouped_launch([staging.Cast(x.shape, None)], [(x,)], mode=DotMode.F16,
                           interpret=True)


@pytest.mark.parametrize("shape", [(45, 70), (700, 40)])   # one tile per band; bands of tiles
def test_cast_line_maxima_and_scaled_f16_copies(shape):
  """The TF32 staging: the maxima of finite |x| per column and row, exact (reduced by the
  job, or left as partial rows), and f16 copies of x times a power of two per column and
  per row, each exactly `precision.scaled_f16_operand`'s rounding by the scales of those
  maxima, with the reciprocal scales (zero past x's rows)."""
  key = helpers.fresh_key()
  x = jax.random.normal(key, shape) * jnp.exp2(jax.random.randint(
      jax.random.fold_in(key, 1), shape, -20, 20).astype(jnp.float32))
  x = x.at[3, 5].set(jnp.inf).at[40, 9].set(jnp.nan)
  job = staging.Cast(x.shape, None, sums=True, maxima=("columns", "rows"), block=(8, 32))
  columns_only = staging.Cast(x.shape, None, maxima=("columns",), block=(8, 32))
  [(sums, column_max, row_max), (sum_parts, *partial_maxima), only_column_max] = (
      staging.grouped_launch([job, dataclasses.replace(job, finished=False), columns_only],
                             [(x,), (x,), (x,)], mode=DotMode.TF32, interpret=True))
  v = np.asarray(x, np.float64)
  finite = np.where(np.isfinite(v), np.abs(v), 0.0)
  np.testing.assert_array_equal(np.asarray(column_max), finite.max(axis=0))
  np.testing.assert_array_equal(np.asarray(row_max), finite.max(axis=1))
  np.testing.assert_array_equal(np.asarray(only_column_max), finite.max(axis=0))
  _assert_column_sums(sums, x)
  chex.assert_shape(sum_parts, (job.grid[0], shape[1]))
  np.testing.assert_array_equal(jnp.max(partial_maxima[0], axis=0), column_max)
  np.testing.assert_array_equal(jnp.max(partial_maxima[1], axis=0), row_max)
  column_scale, row_scale = (precision.f16_scale(m) for m in (column_max, row_max))
  rows = shape[0] + 3
  job = staging.Cast(x.shape, jnp.dtype(jnp.float16), rows=rows, scales=("columns", "rows"),
                     block=(8, 32))
  poisoned = jnp.full((rows, shape[1]), jnp.nan, jnp.float16)
  [(by_column, by_row, column_unscale, row_unscale), fc_sums] = staging.grouped_launch(
      [job, staging.SumRows(sum_parts.shape, block=16)], [(x, *partial_maxima), (sum_parts,)],
      mode=DotMode.TF32, out=poisoned, interpret=True)
  for copy, want in ((by_column, precision.scaled_f16_operand(x, column_scale[None, :])),
                     (by_row, precision.scaled_f16_operand(x, row_scale[:, None]))):
    chex.assert_shape(copy, (rows, shape[1]))
    chex.assert_trees_all_equal(copy[:shape[0]], want)
    chex.assert_trees_all_equal(copy[shape[0]:], jnp.zeros((3, shape[1]), jnp.float16))
  chex.assert_trees_all_equal(column_unscale, 1 / column_scale)
  chex.assert_trees_all_equal(row_unscale, jnp.pad(1 / row_scale, (0, 3)))
  chex.assert_trees_all_equal(fc_sums, sum_in_order(sum_parts))   # SumRows: bitwise that order


@pytest.mark.parametrize("shape", [(45, 70), (700, 40)])   # one tile per band; bands of tiles
@pytest.mark.parametrize("lines", [("columns", "rows"), ("columns",)])
@pytest.mark.parametrize("magnitude", [1.0, 2.0 ** -24])   # N(0, 1); a loss gradient's
def test_speculated_scales_checked_in_a_second_launch(shape, lines, magnitude):
  """A speculated copy (every line scaled by `precision.sample_speculated_scale` of x: 2^10
  for N(0, 1), one that follows smaller inputs; its maxima and column sums on the same
  read) and the checked job after it: each line keeps the speculated scale where its
  maximum fits and takes the measured one elsewhere, bitwise
  `precision.scaled_f16_operand`'s rounding by `precision.checked_scales`, with the
  reciprocals (zero past x's rows). The checked job rewrites exactly the tiles holding a
  line off the speculated scale: given NaN copies, every other tile stays NaN."""
  key = helpers.fresh_key()
  x = jax.random.normal(key, shape)   # maxima in the window, but: lines above it (row 20,
  x = x.at[20, 3].set(2.0 ** 12).at[:, 30].multiply(2.0 ** -16).at[33].multiply(2.0 ** -30)
  x = x.at[:, 17].set(0.0) * magnitude   # column 3), below it (column 30, row 33); a zero
  x = x.at[3, 5].set(jnp.inf).at[40, 9].set(jnp.nan)   # column fits
  speculated_scale = precision.sample_speculated_scale(x)
  assert (speculated_scale == precision.SPECULATED_SCALE) == (magnitude == 1.0)
  rows = shape[0] + 3
  job = staging.Cast(x.shape, jnp.dtype(jnp.float16), rows=rows, scales=lines, block=(8, 32))
  speculated = dataclasses.replace(job, scales_from="speculated", maxima=lines, sums=True,
                                   finished=False)
  [out] = staging.grouped_launch([speculated], [(x, x)], mode=DotMode.TF32, interpret=True)
  copies, sum_parts, maxima = out[:len(lines)], out[len(lines)], out[len(lines) + 1:]
  _assert_column_sums(sum_in_order(sum_parts), x)
  for copy in copies:
    chex.assert_trees_all_equal(copy[:shape[0]], precision.scaled_f16_operand(
        x, speculated_scale))
    chex.assert_trees_all_equal(copy[shape[0]:], jnp.zeros((3, shape[1]), jnp.float16))
  v = np.asarray(x, np.float64)
  finite = np.where(np.isfinite(v), np.abs(v), 0.0)
  line_maxima = {"columns": finite.max(axis=0), "rows": finite.max(axis=1)}
  checked = dataclasses.replace(job, scales_from="checked")
  poisoned = [jnp.full((rows, shape[1]), jnp.nan, jnp.float16)] * len(lines)
  for given in (copies, poisoned):
    given_scale = jnp.full((16,), speculated_scale)   # as a `SpeculatedScale` leaves it
    [ours] = staging.grouped_launch([checked], [(x, *maxima, *given, given_scale)],
                                    mode=DotMode.TF32, interpret=True)
    for copy, unscale, kind in zip(ours[:len(lines)], ours[len(lines):], lines):
      axis = 0 if kind == "columns" else 1
      scale, reciprocal, fits = precision.checked_scales(
          jnp.asarray(line_maxima[kind], jnp.float32), speculated_scale)
      assert not np.all(fits) and np.any(fits), "lines on and off the speculated scale"
      chex.assert_trees_all_equal(unscale, jnp.pad(reciprocal, (0, rows - reciprocal.size))
                                  if axis == 1 else reciprocal)
      value = precision.scaled_f16_operand(x, jnp.expand_dims(scale, axis))
      chex.assert_shape(copy, (rows, shape[1]))
      if given is copies:
        chex.assert_trees_all_equal(copy[:shape[0]], value)
        chex.assert_trees_all_equal(copy[shape[0]:], jnp.zeros((3, shape[1]), jnp.float16))
        continue
      # Tiles along this copy's lines: 32 columns, or 8 rows, off the speculated scale.
      block = job.block[1] if axis == 0 else job.block[0]
      off = np.repeat(np.add.reduceat(~np.asarray(fits), np.arange(0, fits.size, block)) > 0,
                      block)[:fits.size]
      written = ~np.isnan(np.asarray(copy[:shape[0]], np.float32))
      is_number = ~np.isnan(np.asarray(value, np.float32))
      np.testing.assert_array_equal(written, np.expand_dims(off, axis) & is_number)
      np.testing.assert_array_equal(np.asarray(copy[:shape[0]])[written],
                                    np.asarray(value)[written])


def _times(x, operand):
  """An epilogue exact in fp32 on the operands below (powers of two)."""
  return x * operand


@pytest.mark.parametrize("kind", ["columns", "rows"])
def test_checked_copies_of_a_product_computed_again_where_rewritten(kind):
  """`Cast(product=True)`: a checked job over `epilogue(a @ b, operand)`, a product never
  stored, computes a tile of it only where a line is off the speculated scale. On small
  integers (rows of a 2^20 larger, columns of b 2^-24 smaller: lines above and below the
  window) every order of the sums is exact, so the rewritten tiles are bitwise
  `scaled_f16_operand` of the checked scale; given NaN copies, every other tile stays NaN.
  S = 45 rows of a in a 48-row copy (rows past a's read as zeros), K = 40 in steps of
  16 (a partial last step)."""
  k = jax.random.split(helpers.fresh_key(), 3)
  rows, a_rows, depth, cols = 48, 45, 40, 70
  a = jax.random.randint(k[0], (a_rows, depth), -4, 5).astype(jnp.float32)
  b = jax.random.randint(k[1], (depth, cols), -4, 5).astype(jnp.float32)
  a, b = a.at[7].multiply(2.0 ** 20), b.at[:, 33].multiply(2.0 ** -24)
  operand = jnp.exp2(jax.random.randint(k[2], (a_rows, cols), -1, 2).astype(jnp.float32))
  x = np.zeros((rows, cols), np.float64)
  x[:a_rows] = (np.asarray(a, np.float64) @ np.asarray(b, np.float64)) * np.asarray(operand)
  axis = 0 if kind == "columns" else 1
  line_maxima = np.abs(x).max(axis=axis).astype(np.float32)
  speculated_scale = precision.SPECULATED_SCALE
  scale, reciprocal, fits = precision.checked_scales(jnp.asarray(line_maxima),
                                                     speculated_scale)
  assert not np.all(fits) and np.any(fits), "lines on and off the speculated scale"
  job = staging.Cast((rows, cols), jnp.dtype(jnp.float16), scales=(kind,), block=(8, 32),
                     scales_from="checked", product=True, product_k=16, epilogue=_times)
  poisoned = jnp.full((rows, cols), jnp.nan, jnp.float16)
  [(copy, unscale)] = staging.grouped_launch(
      [job], [(a, b, jnp.asarray(line_maxima)[None], poisoned, operand,
               jnp.full((16,), speculated_scale))], mode=DotMode.TF32, interpret=True)
  chex.assert_trees_all_equal(unscale, reciprocal)
  value = np.asarray(precision.scaled_f16_operand(jnp.asarray(x, jnp.float32),
                                                  jnp.expand_dims(scale, axis)))
  block = job.block[1] if axis == 0 else job.block[0]
  off = np.repeat(np.add.reduceat(~np.asarray(fits), np.arange(0, fits.size, block)) > 0,
                  block)[:fits.size]
  written = ~np.isnan(np.asarray(copy, np.float32))
  np.testing.assert_array_equal(written, np.broadcast_to(np.expand_dims(off, axis), x.shape))
  np.testing.assert_array_equal(np.asarray(copy)[written], value[written])


@pytest.mark.parametrize("shape, magnitude", [((45, 70), 1.0), ((5, 300), 2.0 ** -24),
                                               ((300, 5), 2.0 ** 9), ((40, 200), 0.0)])
def test_speculated_scale_follows_the_sample(shape, magnitude):
  """`SpeculatedScale`'s vector is `precision.sample_speculated_scale` of x in every element:
  `SPECULATED_SCALE` where the sample (first 8 rows, 128 columns; fewer in a smaller x)
  fits it, else the power of two that brings the sample's largest finite |x| to
  [2^12, 2^13). A larger value past the sample (row 20, column 200) changes nothing."""
  x = jax.random.normal(helpers.fresh_key(), shape) * magnitude
  x = x.at[1, 2].set(jnp.nan).at[-1, -1].set(2.0 ** 20)
  job = staging.SpeculatedScale(shape, size=1500)
  (vector,) = staging.grouped_launch([job], [(x,)], mode=None, interpret=True)
  want = precision.sample_speculated_scale(x)
  chex.assert_trees_all_equal(vector, jnp.full((1500,), want))
  sample_max = float(np.nanmax(np.abs(np.asarray(x[:8, :128]))))
  if magnitude in (1.0, 0.0):
    assert want == precision.SPECULATED_SCALE
  else:
    assert 2.0 ** 12 <= sample_max * float(want) < 2.0 ** 13, (sample_max, want)


@pytest.mark.parametrize("parts", [1, 2, 8, 9, 17, 32, 33, 64, 65, 100])
def test_sum_rows_adds_first_to_last(parts):
  """`SumRows` (rows loaded a group at a time) is bitwise `sum_in_order`, at row counts
  below, at and past whole groups; values over 2^-30..2^30, so another order of the
  additions would round differently, and NaN and Inf propagate as in the sum."""
  key = jax.random.key(parts)
  shape = (parts, 300)   # a ragged last block of columns
  x = jax.random.normal(key, shape) * jnp.exp2(jax.random.randint(
      jax.random.fold_in(key, 1), shape, -30, 30).astype(jnp.float32))
  x = x.at[parts // 2, 7].set(jnp.inf).at[parts - 1, 11].set(jnp.nan)
  (sums,) = staging.grouped_launch([staging.SumRows(shape)], [(x,)], mode=None,
                                   interpret=True)
  chex.assert_trees_all_equal(sums, sum_in_order(x))
