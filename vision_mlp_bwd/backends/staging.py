"""One Pallas-Triton launch of independent jobs, and the jobs that stage a backward's operands.

`grouped_launch` runs several jobs in one launch: the 1-D grid is the
concatenation of their programs, each program runs the body of the job it
belongs to. A job is a `Cast` (one pass over an input: its 16-bit copies,
plain or scaled by powers of two per column or row, with zero rows
appended, its column sums and line maxima on the way, or the same over an
elementwise epilogue of it), `SpeculatedScale` (the scale such a copy
speculates, as a vector), `TailSum` (a split product's last blocks summed
in place), `SumRows` (partial sums added in order), `Zeros` (arrival
counters),
`Scales` (the Triton backend's TF32 staging: the largest magnitudes along
one axis, and in the same program the f16 copy scaled by them,
`precision.f16_scale`), or one of the Triton backend's products
(`backends/triton/kernels.py`). Both backends stage their operands with
these jobs: the Mosaic backend's four products read what its staging
launches write, and its split products end in a `TailSum`.

Every load and store is masked, so any shape runs without reading or writing
out of bounds. Sums never use float atomics: each row of tiles writes its own
partial sums, added in a fixed order afterwards.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
import warnings

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from vision_mlp_bwd.backends.shared import match_varying_axes, out_struct, sum_in_order
from vision_mlp_bwd.precision import (SPECULATION_SAMPLE, DotMode, checked_scales, f16_scale,
                                      f16_unscale, finite_abs, kernel_dot, scaled_f16_operand,
                                      speculated_scale, split_bf16)

TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated and will be removed"


@functools.cache
def filter_triton_deprecation():
  """JAX 0.11 warns at every Triton lowering; that one warning is expected here."""
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


@dataclasses.dataclass(frozen=True)
class Cast:
  """One pass over a 2-D input `x [R, C]` in `block` tiles: its 16-bit copies and the
  reductions the products need.

  - Copies (with `out_dtype`): `x.astype(out_dtype)`, or with `scales`, one
    f16 copy per entry, `x` times a power-of-two scale per column
    (`"columns"`) or per row (`"rows"`): the TF32 operands of `precision.py`'s
    scaling. Each scale is `precision.f16_scale` of the line's largest finite
    |x|, which the job takes as partial maxima (an input `[P, C]` or `[P, R]`:
    the maxima a `Cast` or the engine's epilogue leaves, one row per part) and
    reduces itself; it also returns the reciprocal scales (`[C]`, or `[rows]`
    with zeros past R), which the engine multiplies its accumulators by. With
    `rows` a copy has that many rows: zeros past x's (the padded operands of
    the Mosaic engine), or x's first rows.
  - `scales_from`: where those scales come from. `"maxima"`, as above.
    `"speculated"`: one scale for every line, `precision.speculated_scale` of
    a sample (the first rows and columns of the last input, x itself or the
    array whose magnitudes x follows), no maxima in and no reciprocals out;
    ask `maxima` for the lines, which a `"checked"` job then takes.
    `"checked"`: the speculated copies come in too, after the maxima, and are
    the outputs (aliased), and last the speculated scale (a `SpeculatedScale`
    vector, read once per program); each line keeps the
    speculated scale where its maximum `fits_speculated` and takes the
    measured one elsewhere (`precision.checked_scales`), and only the tiles
    holding such a line are read and written again. So a launch that reads
    every input once, and a cheap one after it, stand for two full passes
    wherever the lines fit.
  - `terms` (with a bf16 `out_dtype`): the one copy holds x's bf16x3 pieces
    (`precision.split_bf16`: "hi" = bf16(x), "lo" = bf16(x - hi)) in this order,
    side by side along `terms_along`: `"columns"` `[rows, T C]` (`[rows, T, C]`,
    term t in columns t C to (t + 1) C), `"rows"` `[T rows, C]` (`[T, rows, C]`).
    A product over such copies, its contraction over (term, line) on both sides,
    is the three products of HIGHEST's bf16x3 in one.
  - `epilogue`: the pass is over `epilogue(x, operand)` (fp32) instead of x, with
    `operand [R', C]` (R' <= R, rows past R' read as zeros) a later input: the
    GELU derivative applied to a product XLA computed, as the engine's epilogue
    applies it to its own (`reference.gelu_backward`).
  - `product` (checked jobs): x is not an input but `a @ b`, two inputs `a [R_a <= R,
    K]` (rows past R_a read as zeros) and `b [K, C]` in its place, at the launch's
    precision (`precision.kernel_dot`, `product_k`-wide steps), computed only for the
    tiles the job rewrites: a checked copy of a product that was never stored (the
    pre-GELU gradient under TF32, whose fp32 values only such tiles would read).
  - `sums`: the fp32 sums of x's columns (a bias gradient).
  - `maxima`: the largest finite |x| of each column (`"columns"`) or each row
    (`"rows"`), as asked (NaN and Inf count as 0, `precision.finite_abs`): what
    the scales come from.

  A program covers `block[1]` columns and, when it reduces or scales, a band
  of `block[0]`-row tiles (at most `parts` bands: few partial sums to add,
  column scales found once per band), one tile otherwise (and in a checked
  job with row scales). Its partial sums
  are added in band order (unless `finished=False`: then the sums
  `[bands, C]` and maxima `[bands, C]`, `[column blocks, R]` are returned as
  partial rows, for a later launch to reduce). Returns the copies, the reciprocal
  scales, then the sums and the maxima in `maxima`'s order, as asked: one array alone,
  or a tuple.
  """

  shape: tuple[int, int]
  out_dtype: jnp.dtype | None
  rows: int = 0
  sums: bool = False
  maxima: tuple[str, ...] = ()
  scales: tuple[str, ...] = ()
  finished: bool = True
  block: tuple[int, int] = (32, 256)
  parts: int = 64
  epilogue: object = None
  scales_from: str = "maxima"
  terms: tuple[str, ...] = ()
  terms_along: str = "columns"
  product: bool = False
  product_k: int = 32

  @property
  def sources(self) -> int:
    """Inputs that x comes from: x itself, or (`product`) the two operands of a @ b."""
    return 2 if self.product else 1

  @property
  def speculated(self) -> bool:
    """Whether the scales are speculated: from a sample, or (checked) as given (the last
    input either way)."""
    return self.scales_from in ("speculated", "checked")

  @property
  def maxima_inputs(self) -> int:
    """Partial maxima in, and reciprocal scales out: one each per scaled copy, none when
    the scales are speculated."""
    return 0 if self.scales_from == "speculated" else len(self.scales)

  @property
  def aliases(self) -> dict[int, int]:
    if self.scales_from != "checked":
      return {}
    return {self.sources + self.maxima_inputs + i: i for i in range(self.copies)}

  @property
  def num_inputs(self) -> int:
    return (self.sources + self.maxima_inputs + len(self.aliases) + (self.epilogue is not None)
            + self.speculated)

  @property
  def copies(self) -> int:
    return 0 if self.out_dtype is None else max(len(self.scales), 1)

  @property
  def out_rows(self) -> int:
    return (self.rows or self.shape[0]) if self.copies else self.shape[0]

  @property
  def copy_shape(self) -> tuple[int, int]:
    """A copy's shape: `[out_rows, C]`, or its `terms` side by side."""
    terms = len(self.terms) or 1
    if self.terms_along == "rows":
      return (terms * self.out_rows, self.shape[1])
    return (self.out_rows, terms * self.shape[1])

  @property
  def steps(self) -> int:
    """Row tiles per program."""
    tiles = pl.cdiv(self.out_rows, self.block[0])
    if self.scales_from == "checked" and "rows" in self.scales:
      return 1   # a tile's row maxima are a load: one per program, not a chain of them
    return pl.cdiv(tiles, self.parts) if self.sums or self.maxima or self.scales else 1

  @property
  def grid(self) -> tuple[int, int]:
    """(bands of rows, blocks of columns)."""
    return (pl.cdiv(self.out_rows, self.block[0] * self.steps),
            pl.cdiv(self.shape[1], self.block[1]))

  @property
  def num_outputs(self) -> int:
    return self.copies + self.maxima_inputs + self.sums + len(self.maxima)

  @property
  def programs(self) -> int:
    return self.grid[0] * self.grid[1]

  def check(self, operands):
    r, c = self.shape
    assert len(operands) == self.num_inputs, (self, operands)
    if self.product:
      a, b = operands[:2]
      assert self.scales_from == "checked" and a.ndim == b.ndim == 2 and a.shape[0] <= r and (
          b.shape == (a.shape[1], c)), (self, a.shape, b.shape)
    else:
      assert operands[0].shape == (r, c), (self, operands[0].shape)
    assert set(self.scales) <= {"columns", "rows"}, self
    maxima_operands = operands[self.sources:self.sources + self.maxima_inputs]
    for kind, maxima in zip(self.scales, maxima_operands):
      assert maxima.ndim == 2 and maxima.shape[1] == (c if kind == "columns" else r), (
          self, maxima.shape)
    assert not self.scales or self.out_dtype == jnp.float16, self
    assert not self.terms or (self.out_dtype == jnp.bfloat16 and not self.scales and set(
        self.terms) <= {"hi", "lo"} and self.terms_along in ("columns", "rows")), self
    assert self.scales_from in ("maxima", "speculated", "checked"), self
    if self.scales_from == "checked":
      assert self.scales and not (self.sums or self.maxima), self
      assert self.epilogue is None or self.product, self
      first = self.sources + self.maxima_inputs
      for copy in operands[first:first + self.copies]:
        assert copy.shape == (self.out_rows, c) and copy.dtype == jnp.float16, (self, copy)
    if self.speculated:
      assert self.scales and (self.epilogue is None or self.product) and operands[-1].ndim == (
          1 if self.scales_from == "checked" else 2), (self, operands[-1].shape)
    if self.epilogue is not None:
      operand = operands[-1 - self.speculated]
      assert (not self.scales or self.product) and operand.ndim == 2 and (
          operand.shape[0] <= r and operand.shape[1] == c), (self, operand.shape)
    assert len(set(self.maxima)) == len(self.maxima) and set(self.maxima) <= {
        "columns", "rows"}, self
    assert self.num_outputs, self

  def out_shapes(self, like):
    (bands, col_blocks), (r, c) = self.grid, self.shape
    shapes = [out_struct(self.copy_shape, self.out_dtype, like) for _ in range(self.copies)]
    shapes += [out_struct((c if kind == "columns" else self.out_rows,), jnp.float32, like)
               for kind in self.scales[:self.maxima_inputs]]
    if self.sums:
      shapes.append(out_struct((bands, c), jnp.float32, like))
    shapes += [out_struct((bands, c) if kind == "columns" else (col_blocks, r), jnp.float32,
                          like) for kind in self.maxima]
    return shapes

  def _x_tile(self, in_refs, rows, in_x, cols, col_mask, mode: DotMode):
    """x's tile (zeros past R), or `epilogue(x, operand)`'s; with `product`, a @ b's."""
    if self.product:
      a_ref, b_ref = in_refs[:2]
      steps, in_a = pl.cdiv(a_ref.shape[1], self.product_k), rows < a_ref.shape[0]

      def step(s, acc):
        k, k_mask = span(s, self.product_k, a_ref.shape[1])
        return acc + kernel_dot(load_tile(a_ref, rows, in_a, k, k_mask),
                                load_tile(b_ref, k, k_mask, cols, col_mask), mode,
                                round_both=True)
      x = lax.fori_loop(0, steps, step, jnp.zeros((rows.shape[0], cols.shape[0]), jnp.float32))
    else:
      x = load_tile(in_refs[0], rows, in_x, cols, col_mask)
    if self.epilogue is None:
      return x
    operand_ref = in_refs[-1 - self.speculated]
    return self.epilogue(x, load_tile(operand_ref, rows, rows < operand_ref.shape[0], cols,
                                      col_mask))

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    del interpret
    (r, c), (block_rows, block_cols) = self.shape, self.block
    band, col_block = program // self.grid[1], program % self.grid[1]
    cols, col_mask = span(col_block, block_cols, c)
    copy_refs, out_refs = out_refs[:self.copies], list(out_refs[self.copies:])
    unscale_refs = out_refs[:self.maxima_inputs]
    out_refs = out_refs[self.maxima_inputs:]
    sums_ref = out_refs.pop(0) if self.sums else None
    max_refs = dict(zip(self.maxima, out_refs))
    checked = self.scales_from == "checked"
    speculated = (in_refs[-1][0] if checked   # a `SpeculatedScale` of the sample
                  else _sample_scale(in_refs[-1]) if self.speculated else None)

    def scales(i, lines, mask, axis, store_unscale):
      """Copy i's scales of these lines (expanded along `axis`) and (checked) whether every
      line kept the speculated one; the reciprocals go to `store_unscale`."""
      if self.scales_from == "speculated":
        return speculated, None
      largest = _line_maxima(in_refs[self.sources + i], lines, mask)
      if checked:
        scale, unscale, fits = checked_scales(largest, speculated)
        kept = jnp.sum(jnp.where(mask & ~fits, 1, 0)) == 0
      else:
        scale, unscale, kept = f16_scale(largest), f16_unscale(largest), None
      store_unscale(jnp.where(mask, unscale, 0.0))
      return jnp.expand_dims(scale, axis), kept

    col_scales = {}
    for i, kind in enumerate(self.scales):
      if kind == "columns":
        col_scales[i] = scales(i, cols, col_mask, 0, lambda unscale, i=i: pl.when(band == 0)(
            lambda: plgpu.store(unscale_refs[i].at[cols], unscale, mask=col_mask)))

    def step(s, carry):
      total, largest = carry
      rows, row_mask = span(band * self.steps + s, block_rows, self.out_rows)
      in_x = rows < min(r, self.out_rows)
      line_scales = [col_scales[i] if i in col_scales else scales(
          i, rows, in_x, 1, lambda unscale, i=i: pl.when(col_block == 0)(
              lambda: plgpu.store(unscale_refs[i].at[rows], unscale, mask=row_mask)))
          for i in range(len(self.scales))]
      if checked:   # only a tile with a line off the speculated scale is read and written
        @pl.when(functools.reduce(operator.or_, [~kept for _, kept in line_scales]))
        def _():
          x = self._x_tile(in_refs, rows, in_x, cols, col_mask, mode)
          index, mask = tile_indices(rows, row_mask, cols, col_mask)
          for copy_ref, (scale, kept) in zip(copy_refs, line_scales):
            pl.when(~kept)(lambda copy_ref=copy_ref, scale=scale: plgpu.store(
                copy_ref.at[index], scaled_f16_operand(x, scale), mask=mask))
        return carry
      x = self._x_tile(in_refs, rows, in_x, cols, col_mask, mode)   # zeros past R
      index, mask = tile_indices(rows, row_mask, cols, col_mask)
      if self.terms:
        pieces = dict(zip(("hi", "lo"), split_bf16(x.astype(jnp.float32))))
        for t, term in enumerate(self.terms):
          row_offset, col_offset = ((t * self.out_rows, 0) if self.terms_along == "rows"
                                    else (0, t * c))
          term_index, _ = tile_indices(rows + row_offset, row_mask, cols + col_offset, col_mask)
          plgpu.store(copy_refs[0].at[term_index], pieces[term], mask=mask)
      else:
        for i, copy_ref in enumerate(copy_refs):
          value = (scaled_f16_operand(x, line_scales[i][0]) if self.scales
                   else x.astype(copy_ref.dtype))
          plgpu.store(copy_ref.at[index], value, mask=mask)
      if self.sums:
        total = total + jnp.sum(x.astype(jnp.float32), axis=0)
      if self.maxima:
        magnitude = finite_abs(x)
      if "columns" in max_refs:
        largest = jnp.maximum(largest, jnp.max(magnitude, axis=0))
      if "rows" in max_refs:
        plgpu.store(max_refs["rows"].at[col_block, rows], jnp.max(magnitude, axis=1),
                    mask=in_x)
      return total, largest

    zeros = jnp.zeros((block_cols,), jnp.float32)
    if self.steps == 1:
      total, largest = step(0, (zeros, zeros))
    else:
      total, largest = lax.fori_loop(0, self.steps, step, (zeros, zeros))
    if self.sums:
      plgpu.store(sums_ref.at[band, cols], total, mask=col_mask)
    if "columns" in max_refs:
      plgpu.store(max_refs["columns"].at[band, cols], largest, mask=col_mask)

  def finish(self, outs):
    outs = list(outs)
    count = self.copies + self.maxima_inputs
    results, partial = outs[:count], outs[count:]
    if self.finished and self.sums:
      results.append(sum_in_order(partial.pop(0)))
    if self.finished and self.maxima:
      results += [jnp.max(m, axis=0) for m in partial]   # exact in any order
    else:
      results += partial
    return results[0] if len(results) == 1 else tuple(results)


def _sample_scale(sample_ref):
  """`precision.sample_speculated_scale` of a 2-D ref (every program finds the same)."""
  sample_rows, sample_cols = SPECULATION_SAMPLE
  rows, row_mask = span(0, sample_rows, sample_ref.shape[0])
  cols, col_mask = span(0, sample_cols, sample_ref.shape[1])
  return speculated_scale(jnp.max(finite_abs(load_tile(sample_ref, rows, row_mask, cols,
                                                       col_mask))))


def _line_maxima(maxima_ref, lines, mask):
  """The maxima of these lines (0 outside `mask`), from partial maxima `[P, lines]`."""
  parts = maxima_ref.shape[0]
  part = jnp.arange(pl.next_power_of_2(parts))
  index, tile_mask = tile_indices(part, part < parts, lines, mask)
  return jnp.max(plgpu.load(maxima_ref.at[index], mask=tile_mask, other=0.0), axis=0)


@dataclasses.dataclass(frozen=True)
class SumRows:
  """The fp32 sums of partial rows `[P, C]` (a reduction's parts), added first to last, as
  `shared.sum_in_order` adds them: bitwise the same.

  The rows are loaded `group` at a time before they are added, so a program waits for
  one round trip to memory per group rather than per row (a one-row-at-a-time loop over
  64 rows took ~6 us on the H200, 8 rows at a time ~5 us: benchmarks/NOTES.md, 47g and
  58). A group of 32 rows of a 128-column block is 32 registers per thread."""

  shape: tuple[int, int]
  block: int = 128
  group: int = 32

  num_inputs = 1
  num_outputs = 1
  aliases = {}

  @property
  def programs(self) -> int:
    return pl.cdiv(self.shape[1], self.block)

  def check(self, operands):
    assert operands[0].shape == tuple(self.shape), (self, operands[0].shape)

  def out_shapes(self, like):
    return [out_struct((self.shape[1],), jnp.float32, like)]

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    del mode, interpret
    cols, mask = span(program, self.block, self.shape[1])
    row = lambda p: plgpu.load(in_refs[0].at[p, cols], mask=mask, other=0.0).astype(jnp.float32)

    def add_rows(total, first, count):
      for value in [row(first + i) for i in range(count)]:   # every load, then the sums
        total = value if total is None else total + value
      return total

    first = min(self.shape[0], self.group)   # the first group starts the sum with row 0
    total = add_rows(None, 0, first)
    groups, rest = divmod(self.shape[0] - first, self.group)
    if groups:
      total = lax.fori_loop(0, groups, lambda g, t: add_rows(t, first + g * self.group,
                                                             self.group), total)
    total = add_rows(total, first + groups * self.group, rest)
    plgpu.store(out_refs[0].at[cols], total, mask=mask)

  def finish(self, outs):
    return outs[0]


@dataclasses.dataclass(frozen=True)
class TailSum:
  """A split product's last blocks, written in place (the engine's last wave split along K).

  Inputs: the product `out [M, N]` (aliased: every element outside its tail is left as
  the product wrote it) and its fp32 K-parts `[tail * splits * block[0], block[1]]`,
  the `splits` parts of tail block t one after another. Tail block t is the output's
  block `first + t` in row-major order over `grid_n` block columns; it becomes the sum
  of its parts added first to last, cut at the array's ends. A program sums one `piece`
  of one block.
  """

  shape: tuple[int, int]
  out_dtype: jnp.dtype
  block: tuple[int, int]
  grid_n: int
  first: int
  tail: int
  splits: int

  num_inputs = 2
  num_outputs = 1
  aliases = {0: 0}

  @property
  def piece(self) -> tuple[int, int]:
    return (math.gcd(8, self.block[0]), math.gcd(128, self.block[1]))

  @property
  def programs(self) -> int:
    (bm, bn), (tm, tn) = self.block, self.piece
    return self.tail * (bm // tm) * (bn // tn)

  def check(self, operands):
    out, parts = operands
    assert out.shape == tuple(self.shape) and out.dtype == self.out_dtype, (self, out)
    assert parts.shape == (self.tail * self.splits * self.block[0], self.block[1]), (
        self, parts.shape)
    assert parts.dtype == jnp.float32, parts.dtype

  def out_shapes(self, like):
    return [out_struct(tuple(self.shape), self.out_dtype, like)]

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    del mode, interpret
    (m, n), (bm, bn), (tm, tn) = self.shape, self.block, self.piece
    parts, (out,) = in_refs[1], out_refs
    per_row = bn // tn
    per_block = (bm // tm) * per_row
    t, piece = program // per_block, program % per_block
    block_row, block_col = (self.first + t) // self.grid_n, (self.first + t) % self.grid_n
    in_rows = (piece // per_row) * tm + jnp.arange(tm)
    in_cols = (piece % per_row) * tn + jnp.arange(tn)
    total = _sum_parts(parts, t, self.splits, bm, in_rows, in_cols)
    rows, cols = block_row * bm + in_rows, block_col * bn + in_cols
    index, mask = tile_indices(rows, rows < m, cols, cols < n)
    plgpu.store(out.at[index], total.astype(out.dtype), mask=mask)

  def finish(self, outs):
    return outs[0]


def _sum_parts(parts, block, splits, block_rows, in_rows, in_cols):
  """The `[in_rows, in_cols]` tile of a split block's K-parts (`TailSum`'s layout: the
  `splits` parts of tail block `block` one after another), added first to last."""
  total = None
  for s in range(splits):
    x = plgpu.load(parts.at[((block * splits + s) * block_rows + in_rows)[:, None],
                            in_cols[None, :]])
    total = x if total is None else total + x
  return total


class _Vector:
  """A job writing one `[size]` vector of one value (`value(in_refs)`), `block` elements a
  program."""

  num_outputs = 1
  aliases = {}

  @property
  def programs(self) -> int:
    return pl.cdiv(self.size, self.block)

  def out_shapes(self, like):
    return [out_struct((self.size,), self.dtype, like)]

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    del mode, interpret
    indices, mask = span(program, self.block, self.size)
    plgpu.store(out_refs[0].at[indices],
                jnp.full((self.block,), self.value(in_refs), self.dtype), mask=mask)

  def finish(self, outs):
    return outs[0]


@dataclasses.dataclass(frozen=True)
class Zeros(_Vector):
  """An int32 `[size]` array of zeros: the arrival counters of a later launch's product."""

  size: int
  block: int = 1024

  num_inputs = 0
  dtype = jnp.int32

  def check(self, operands):
    assert not operands, operands

  def value(self, in_refs):
    return 0


@dataclasses.dataclass(frozen=True)
class SpeculatedScale(_Vector):
  """An fp32 `[size]` vector of one value: the scale a speculated `Cast` of an input takes,
  `precision.speculated_scale` of the sample of `x [R, C]` (its one input): for a checked
  `Cast`, which then loads one value rather than reduce the sample again in each of its
  one-tile programs, and for the engine's speculated copies."""

  shape: tuple[int, int]
  size: int
  block: int = 1024

  num_inputs = 1
  dtype = jnp.float32

  def check(self, operands):
    assert len(operands) == 1 and operands[0].shape == tuple(self.shape), (self, operands)

  def value(self, in_refs):
    return _sample_scale(in_refs[0])


@dataclasses.dataclass(frozen=True)
class Scales:
  """The largest finite |x| of a 2-D input `[R, C]` per column (`axis=0`) or row (`axis=1`).

  These are the partial maxima a `scaled_f16` product takes: `[parts, L]`
  (L = C or R), one row per part of the reduced axis that a program covers.
  With `cast` (one part), also `x` scaled by the resulting powers of two and
  cast to f16; with `sums`, also the fp32 sums along `axis`, `[parts, L]`.
  """

  shape: tuple[int, int]
  axis: int
  cast: bool = False
  sums: bool = False
  parts: int = 1
  block: int = 32     # kept lines (columns for axis 0) per program
  step: int = 64      # reduced lines per loop step

  num_inputs = 1
  aliases = {}

  @property
  def num_outputs(self) -> int:
    return 1 + self.cast + self.sums

  @property
  def lines(self) -> int:
    return self.shape[1 - self.axis]

  @property
  def programs(self) -> int:
    return pl.cdiv(self.lines, self.block) * self.parts

  def check(self, operands):
    assert len(operands) == 1 and operands[0].shape == tuple(self.shape), (self, operands)
    assert not (self.cast and self.parts > 1), self

  def out_shapes(self, like):
    shapes = [out_struct((self.parts, self.lines), jnp.float32, like)]
    if self.cast:
      shapes.append(out_struct(tuple(self.shape), jnp.float16, like))
    if self.sums:
      shapes.append(out_struct((self.parts, self.lines), jnp.float32, like))
    return shapes

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    del mode, interpret
    blocks = pl.cdiv(self.lines, self.block)
    part = program // blocks
    lines, line_mask = span(program % blocks, self.block, self.lines)
    steps = pl.cdiv(pl.cdiv(self.shape[self.axis], self.step), self.parts)

    def at(s):   # the [step, block] tile of reduced x kept lines, as stored
      reduced, mask = span(part * steps + s, self.step, self.shape[self.axis])
      if self.axis == 0:
        return tile_indices(reduced, mask, lines, line_mask)
      return tile_indices(lines, line_mask, reduced, mask)

    def load(s):
      index, mask = at(s)
      return plgpu.load(in_refs[0].at[index], mask=mask, other=0.0).astype(jnp.float32)

    def reduce(s, carry, x=None):
      largest, total = carry
      x = load(s) if x is None else x
      return (jnp.maximum(largest, jnp.max(finite_abs(x), axis=self.axis)),
              total + jnp.sum(x, axis=self.axis))

    zeros = jnp.zeros((self.block,), jnp.float32)
    one_step = pl.cdiv(self.shape[self.axis], self.step) == 1   # then the tile is kept
    tile = load(0) if one_step else None
    if one_step:
      largest, total = reduce(0, (zeros, zeros), tile)
    else:
      largest, total = lax.fori_loop(0, steps, reduce, (zeros, zeros))
    plgpu.store(out_refs[0].at[part, lines], largest, mask=line_mask)
    if self.sums:
      plgpu.store(out_refs[-1].at[part, lines], total, mask=line_mask)
    if self.cast:
      scale = f16_scale(largest)
      scale = scale[None, :] if self.axis == 0 else scale[:, None]

      @pl.loop(0, steps)
      def _(s):
        index, mask = at(s)
        x = tile if one_step else load(s)
        plgpu.store(out_refs[1].at[index], scaled_f16_operand(x, scale), mask=mask)

  def finish(self, outs):
    return tuple(outs)


def span(block_index, block_size, extent):
  """Indices of one tile along an axis and the mask of those inside `extent`."""
  indices = block_index * block_size + jnp.arange(block_size)
  return indices, indices < extent


def tile_indices(rows, row_mask, cols, col_mask):
  """Index and mask of the `[len(rows), len(cols)]` tile of a 2-D ref."""
  return (rows[:, None], cols[None, :]), row_mask[:, None] & col_mask[None, :]


def load_tile(ref, rows, row_mask, cols, col_mask):
  """A zero-padded `[len(rows), len(cols)]` tile of a 2-D ref."""
  index, mask = tile_indices(rows, row_mask, cols, col_mask)
  return plgpu.load(ref.at[index], mask=mask, other=0.0)



def _grouped_kernel(*refs, jobs, mode, aliased, interpret):
  n_in = sum(job.num_inputs for job in jobs)
  in_refs, out_refs = refs[:n_in], refs[n_in + aliased:]
  pid = pl.program_id(0)
  first = 0
  for job in jobs:
    ins, in_refs = in_refs[:job.num_inputs], in_refs[job.num_inputs:]
    outs, out_refs = out_refs[:job.num_outputs], out_refs[job.num_outputs:]
    if len(jobs) == 1:
      job.run(pid, ins, outs, mode, interpret)
    else:
      @pl.when((pid >= first) & (pid < first + job.programs))
      def _(job=job, ins=ins, outs=outs, first=first):
        job.run(pid - first, ins, outs, mode, interpret)
    first += job.programs


def grouped_launch(jobs, operands, *, mode: DotMode, interpret=False, out=None,
                   name="grouped_launch", num_warps=4, num_stages=1):
  """Runs `jobs` (products, `Cast`s, `Zeros`, `Scales`, `operands[i]` for each) in one launch.

  Returns, per job: for a product, the product `[M, N]` in its `out_dtype`
  (split contractions summed in fp32 first), or `(product, row_sums [M])`
  where it asks for row sums; for a cast or zeros, the array. `out`, if given, is
  the buffer the first job writes its first output into (aliased); tests pass
  a NaN-filled one to prove that every element is written. Warps and
  pipeline depth are the first product's (`num_warps`, `num_stages` without one).
  """
  operands = [tuple(ops) for ops in operands]
  if len(operands) != len(jobs):
    raise ValueError(f"grouped_launch: {len(jobs)} jobs but {len(operands)} operand tuples.")
  for job, ops in zip(jobs, operands):
    job.check(ops)
  inputs = [x for ops in operands for x in ops] + ([out] if out is not None else [])
  inputs = list(match_varying_axes(*inputs))
  if out is not None:
    *inputs, out = inputs
  like = inputs[0] if inputs else None
  out_shapes = [s for job in jobs for s in job.out_shapes(like=like)]
  if out is not None:
    assert out.shape == out_shapes[0].shape and out.dtype == out_shapes[0].dtype, out
  filter_triton_deprecation()
  tiles = [job.tile for job in jobs if hasattr(job, "tile")]   # the products' TileConfigs
  warps, stages = (tiles[0].num_warps, tiles[0].num_stages) if tiles else (num_warps, num_stages)
  outs = pl.pallas_call(
      functools.partial(_grouped_kernel, jobs=tuple(jobs), mode=mode, aliased=out is not None,
                        interpret=interpret),
      out_shape=out_shapes,
      grid=(sum(job.programs for job in jobs),),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      input_output_aliases=_aliases(jobs, extra_input=len(inputs) if out is not None else None),
      interpret=interpret,
      name=name,
  )(*inputs, *([out] if out is not None else []))
  results = []
  for job in jobs:
    results.append(job.finish(outs[:job.num_outputs]))
    outs = outs[job.num_outputs:]
  return results


def launch(pairs, *, mode: DotMode, interpret=False, name="grouped_launch", **params):
  """`grouped_launch` of `(job, operands)` pairs, as the backends write their launches."""
  return grouped_launch([job for job, _ in pairs], [ops for _, ops in pairs], mode=mode,
                        interpret=interpret, name=name, **params)


def _aliases(jobs, extra_input=None):
  """pallas_call's input -> output aliases: each job's own, and `extra_input` -> output 0."""
  aliases, first_in, first_out = {}, 0, 0
  for job in jobs:
    aliases.update({first_in + i: first_out + o for i, o in job.aliases.items()})
    first_in, first_out = first_in + job.num_inputs, first_out + job.num_outputs
  if extra_input is not None:
    aliases[extra_input] = 0
  return aliases
