"""The Pallas-Triton kernel of the backward: masked, tiled matmuls, grouped per launch.

A `Product` is one `C = op(A) @ op(B)`, where `op(A)` is `A` (`[M, K]`) or
`A.T` (`A` stored `[K, M]`) and `op(B)` is `B` (`[K, N]`) or `B.T` (`B` stored
`[N, K]`, K-contiguous, as fp32 tensor-core products want), stored as `C`
(`[M, N]`), with two optional fusions:

* `fuse_gelu`: the epilogue multiplies the tile by `gelu_tanh_grad` of the
  matching tile of a third input (laid out as the output), so the pre-GELU
  gradient is produced in one pass;
* `row_sums`: the programs of the first column of tiles also sum `op(A)` over
  K, which is a bias gradient when `A` is `grad_output` or the pre-GELU
  gradient, read here anyway.

Products run in `backends/staging.py`'s `grouped_launch`, several
independent jobs in one launch: at small S every product alone fills the GPU
poorly; grouped, their programs overlap, and the staging jobs (`Cast`,
`Zeros`, `Scales`) ride along instead of taking a kernel each.

Every load and store is masked, so any M, N, K runs without reading or writing
out of bounds. Reductions never use float atomics: a split contraction writes
one partial result per split, summed in a fixed order either after the launch
or (`Product.sum_splits_in_kernel`) by the last of the tile's programs to
arrive, which an int32 counter per tile (zeroed by a `Zeros` job) tells.
"""

from __future__ import annotations

import dataclasses
import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from vision_mlp_bwd.backends.shared import out_struct
from vision_mlp_bwd.backends.staging import grouped_launch, load_tile, span, tile_indices
from vision_mlp_bwd.backends.triton.config import TileConfig
from vision_mlp_bwd.precision import (SPECULATED_SCALE, DotMode, f16_scale, finite_abs,
                                      fits_speculated, kernel_dot, scaled_f16_operand)
from vision_mlp_bwd.reference import gelu_tanh_grad

@dataclasses.dataclass(frozen=True)
class Product:
  """One tiled product of a launch; shapes are static, arrays come separately."""

  m: int
  n: int
  k: int
  tile: TileConfig
  out_dtype: jnp.dtype
  transpose_a: bool = False
  transpose_b: bool = False
  fuse_gelu: bool = False
  row_sums: bool = False
  lhs_in_registers: bool = False   # see precision.kernel_dot
  # With split_k > 1: the last program to finish an output tile sums its
  # partials (in split order, so bit for bit the same whichever is last) and
  # stores the product, instead of a reduction after the launch. The programs
  # count arrivals per tile in an int32 input of zeros (`Zeros`).
  sum_splits_in_kernel: bool = False
  # TF32 products on f16 tensor cores: more inputs, the largest finite |op(A)|
  # per row and |op(B)| per column, as partial maxima `[parts, M]` and
  # `[parts, N]` (`Scales`, `f16_outputs`) whose max over parts gives the
  # power-of-two scales (`precision.f16_scale`). fp32 tiles are scaled and
  # converted in the kernel (f16 ones are taken as done so already), and the
  # epilogue divides the scales out.
  scaled_f16: bool = False
  # With scaled_f16, no maxima input for B (a weight): its scale is
  # `precision.SPECULATED_SCALE`, and the program, which sees all of its
  # columns' contraction, redoes the tile with exact scales if a column's
  # largest magnitude turns out to lie outside `precision.fits_speculated`.
  speculate_b: bool = False
  # With speculate_b and fuse_gelu (the pre-GELU gradient): one more input, A's
  # maxima along K `[parts, K]` (their max is max |A|), and four more outputs:
  # C's row maxima per column block `[n blocks, M]` (the scales of a product
  # contracting C's columns), C's column sums per row block `[m blocks, N]` (a
  # bias gradient), C scaled per column and cast to f16 `[M, N]`, and the
  # bound those scales come from `[1, N]` (2 K max|A| max|B[:, n]| >= |C|,
  # known without C's other rows).
  f16_outputs: bool = False

  @property
  def grid(self):
    """(m blocks, n blocks, splits); m varies fastest so neighbours share B's tiles."""
    t = self.tile
    m_blocks = 1 if self.tail_rows else pl.cdiv(self.m, t.block_m)
    return m_blocks, pl.cdiv(self.n, t.block_n), t.split_k

  @property
  def tail_rows(self) -> int:
    """Rows of the second part of the one row block (`TileConfig.tail_m`), or 0."""
    t = self.tile
    return t.tail_m if t.block_m < self.m <= t.block_m + t.tail_m else 0

  def row_parts(self, pid_m):
    """The rows of row block `pid_m` as (indices, mask) parts, each with its own accumulator."""
    parts = [span(pid_m, self.tile.block_m, self.m)]
    if self.tail_rows:
      parts.append(span(self.tile.block_m // self.tail_rows, self.tail_rows, self.m))
    return parts

  @property
  def k_steps(self) -> int:
    """block_k steps per split."""
    t = self.tile
    return pl.cdiv(pl.cdiv(self.k, t.block_k), t.split_k)

  @property
  def programs(self) -> int:
    gm, gn, gk = self.grid
    return gm * gn * gk

  @property
  def tiles(self) -> int:
    """Output tiles: the grid's (m, n) tiles."""
    gm, gn, _ = self.grid
    return gm * gn

  @property
  def counts_arrivals(self) -> bool:
    return self.sum_splits_in_kernel and self.tile.split_k > 1

  @property
  def num_inputs(self) -> int:
    scales = self.scaled_f16 * (1 + (not self.speculate_b) + self.f16_outputs)
    return 2 + scales + self.fuse_gelu + self.counts_arrivals   # ..., arrival counters

  @property
  def num_outputs(self) -> int:
    return 1 + self.row_sums + 4 * self.f16_outputs + 2 * self.counts_arrivals  # ..., counters

  @property
  def aliases(self) -> dict[int, int]:
    """Inputs that are also outputs (by index within the job): the arrival counters."""
    return {self.num_inputs - 1: self.num_outputs - 1} if self.counts_arrivals else {}

  def check(self, operands):
    a, b = operands[0], operands[1]
    assert a.shape == ((self.k, self.m) if self.transpose_a else (self.m, self.k)), (self, a.shape)
    assert b.shape == ((self.n, self.k) if self.transpose_b else (self.k, self.n)), (self, b.shape)
    assert len(operands) == self.num_inputs, self
    assert not (self.fuse_gelu and self.tile.split_k > 1), self
    assert not self.f16_outputs or (self.fuse_gelu and self.speculate_b and self.scaled_f16), self
    assert not self.speculate_b or self.scaled_f16, self
    if self.scaled_f16:
      assert operands[2].shape[1:] == (self.m,), (self, operands[2].shape)
      if not self.speculate_b:
        assert operands[3].shape[1:] == (self.n,), (self, operands[3].shape)
    if self.counts_arrivals:
      assert operands[-1].shape == (self.tiles,) and operands[-1].dtype == jnp.int32, operands[-1]

  def run(self, program, in_refs, out_refs, mode: DotMode, interpret: bool):
    _product_program(self, program, in_refs, out_refs, mode, interpret)

  def finish(self, outs):
    """The launch's outputs of this product -> the product (and row sums)."""
    product, split = outs[0], self.tile.split_k
    if split > 1 and not self.counts_arrivals:
      product = product.reshape(split, self.m, self.n).sum(axis=0).astype(self.out_dtype)
    sums = (outs[1].reshape(split, self.m).sum(axis=0),) if self.row_sums else ()
    extra = tuple(outs[1 + self.row_sums:5 + self.row_sums]) if self.f16_outputs else ()
    return (product, *sums, *extra) if sums or extra else product

  def out_shapes(self, like):
    split, arrivals = self.tile.split_k, self.counts_arrivals
    rows, cols = self.m, self.n
    if split == 1 or arrivals:
      shapes = [out_struct((rows, cols), self.out_dtype, like)]
    else:
      shapes = [out_struct((split * rows, cols), jnp.float32, like)]
    if self.row_sums:
      shapes.append(out_struct((split * self.m,), jnp.float32, like))
    if self.f16_outputs:
      gm, gn, _ = self.grid
      shapes += [out_struct((gn, self.m), jnp.float32, like),
                 out_struct((gm, self.n), jnp.float32, like),
                 out_struct((self.m, self.n), jnp.float16, like),
                 out_struct((1, self.n), jnp.float32, like)]
    if arrivals:
      shapes += [out_struct((split * rows, cols), jnp.float32, like),
                 out_struct((self.tiles,), jnp.int32, like)]
    return shapes


def _max_of_parts(ref, index, mask):
  """max over the first axis of partial maxima `ref [parts, L]`, at `index` along L."""
  parts = ref.shape[0]
  part = jnp.arange(pl.next_power_of_2(parts))
  tile = plgpu.load(ref.at[part[:, None], index[None, :]],
                    mask=(part < parts)[:, None] & mask[None, :], other=0.0)
  return jnp.max(tile, axis=0)


def _product_program(p: Product, program, in_refs, out_refs, mode: DotMode, interpret: bool):
  """The work of program number `program` of product `p`: its output tile."""
  gm, gn, _ = p.grid
  pid_m, pid_n, pid_k = program % gm, (program // gm) % gn, program // (gm * gn)
  _output_tile(p, pid_m, pid_n, pid_k, in_refs, out_refs, mode, interpret)


def _output_tile(p: Product, pid_m, pid_n, pid_k, in_refs, out_refs, mode: DotMode,
                 interpret: bool):
  """One output tile (one split of its contraction), stored; masked at every edge.

  The tile's rows come in one or two parts (`Product.tail_rows`), each with its
  own accumulator; every contraction step loads B's tile once for both.
  """
  a_ref, b_ref, *x_ref = in_refs
  out_ref, *row_sum_ref = out_refs[:1 + p.row_sums]
  t = p.tile
  parts = p.row_parts(pid_m)        # [(rows, row_mask)]
  cols, col_mask = span(pid_n, t.block_n, p.n)
  steps = p.k_steps
  b_k_axis = 1 if p.transpose_b else 0
  scales_a = [None] * len(parts)
  scale_b = None
  if p.scaled_f16:
    max_a_ref, *x_ref = x_ref
    scales_a = [f16_scale(_max_of_parts(max_a_ref, rows, mask)) for rows, mask in parts]
    if p.speculate_b:
      scale_b = jnp.full((t.block_n,), SPECULATED_SCALE, jnp.float32)
    else:
      max_b_ref, *x_ref = x_ref
      scale_b = f16_scale(_max_of_parts(max_b_ref, cols, col_mask))
    if p.f16_outputs:
      a_k_max_ref, *x_ref = x_ref

  def load(ks, k_mask):
    """The A tiles (one per part of the rows) and the B tile of contraction slice `ks`."""
    if p.transpose_a:
      a = [load_tile(a_ref, ks, k_mask, rows, mask) for rows, mask in parts]   # [bk, rows]
    else:
      a = [load_tile(a_ref, rows, mask, ks, k_mask) for rows, mask in parts]   # [rows, bk]
    if p.transpose_b:
      return a, load_tile(b_ref, cols, col_mask, ks, k_mask)                   # [bn, bk]
    return a, load_tile(b_ref, ks, k_mask, cols, col_mask)                     # [bk, bn]

  def multiply(tiles, accs, sums, scale_b):
    """The accumulators (and row sums) plus one contraction step's products."""
    a_tiles, b = tiles
    if p.scaled_f16:
      b = scaled_f16_operand(b, scale_b[:, None] if p.transpose_b else scale_b[None, :])
    new_accs, new_sums = [], []
    for acc, total, a, scale_a in zip(accs, sums, a_tiles, scales_a):
      tile_a = a
      if p.scaled_f16:
        a = scaled_f16_operand(a, scale_a[None, :] if p.transpose_a else scale_a[:, None])
      new_accs.append(acc + kernel_dot(a, b, mode, contract_a=0 if p.transpose_a else 1,
                                       contract_b=b_k_axis, lhs_in_registers=p.lhs_in_registers))
      # After the dot: summing first made Triton miscompile the 16-bit weight
      # gradients on the H200 (wrong and run-to-run different; NOTES.md, 20).
      if p.row_sums:
        total = total + jnp.sum(tile_a.astype(jnp.float32), axis=0 if p.transpose_a else 1)
      new_sums.append(total)
    return new_accs, new_sums

  def contraction(scale_b):
    """The accumulators, row sums and (speculate_b) the largest |B| per column."""
    zeros = functools.partial(jnp.zeros, dtype=jnp.float32)
    b_shape = (t.block_n, t.block_k) if p.transpose_b else (t.block_k, t.block_n)

    def step(s, carry):
      accs, sums, b_max = carry
      tiles = load(*span(pid_k * steps + s, t.block_k, p.k))
      accs, sums = multiply(tiles, accs, sums, scale_b)
      if p.speculate_b:   # elementwise here, reduced over K once after the loop
        b_max = jnp.maximum(b_max, finite_abs(tiles[1]))
      return accs, sums, b_max

    init = ([zeros((rows.shape[0], t.block_n)) for rows, _ in parts],
            [zeros((rows.shape[0],)) for rows, _ in parts],
            zeros(b_shape if p.speculate_b else (1,)))
    accs, sums, b_max = lax.fori_loop(0, steps, step, init)
    if p.speculate_b:
      b_max = jnp.max(b_max, axis=b_k_axis)
    return accs, sums, b_max

  accs, sums, b_max = contraction(scale_b)
  if p.speculate_b:   # rare: redo the tile with the scales its columns need
    fits = jnp.min(fits_speculated(b_max).astype(jnp.int32)) == 1   # Triton has no reduce_and
    exact_scale_b = f16_scale(b_max)
    accs = lax.cond(fits, lambda: accs, lambda: contraction(exact_scale_b)[0])
    scale_b = jnp.where(fits, scale_b, exact_scale_b)
  if p.scaled_f16:   # exact: powers of two, applied one at a time
    accs = [(acc * (1.0 / scale_a)[:, None]) * (1.0 / scale_b)[None, :]
            for acc, scale_a in zip(accs, scales_a)]

  # (tile, its rows, row mask, columns, column mask)
  pieces = [(acc, rows, row_mask, cols, col_mask) for acc, (rows, row_mask) in zip(accs, parts)]
  if p.fuse_gelu:
    pieces = [(acc * gelu_tanh_grad(load_tile(x_ref[0], *piece).astype(jnp.float32)), *piece)
              for acc, *piece in pieces]
  if p.f16_outputs:
    _store_f16_outputs(p, pid_m, pid_n, pieces, b_max, out_refs[1 + p.row_sums:5 + p.row_sums],
                       a_k_max_ref)
  if p.counts_arrivals:
    partial_ref, counter_ref = out_refs[-2:]
    _sum_splits_when_last(p, pid_m + p.grid[0] * pid_n, pid_k, pieces, out_ref, partial_ref,
                          counter_ref, interpret)
  else:
    for acc, rows, *masks_and_cols in pieces:   # this split's rows of a split output
      index, mask = tile_indices(pid_k * p.m + rows, *masks_and_cols)
      plgpu.store(out_ref.at[index], acc.astype(out_ref.dtype), mask=mask)
  if p.row_sums:
    @pl.when(pid_n == 0)
    def _():
      for total, (rows, row_mask) in zip(sums, parts):
        plgpu.store(row_sum_ref[0].at[pid_k * p.m + rows], total, mask=row_mask)


def _store_f16_outputs(p: Product, pid_m, pid_n, pieces, b_max, refs, a_k_max_ref):
  """`Product.f16_outputs`: row maxima, column sums, the bound-scaled f16 copy and the bound."""
  row_max_ref, col_sum_ref, copy_ref, bound_ref = refs
  ks, k_mask = span(0, pl.next_power_of_2(p.k), p.k)
  bound = 2.0 * p.k * jnp.max(_max_of_parts(a_k_max_ref, ks, k_mask)) * b_max
  copy_scale = f16_scale(bound)[None, :]
  col_sums = 0.0
  for acc, rows, row_mask, cols, col_mask in pieces:
    index, mask = tile_indices(rows, row_mask, cols, col_mask)
    plgpu.store(row_max_ref.at[pid_n, rows],
                jnp.max(jnp.where(mask, finite_abs(acc), 0.0), axis=1), mask=row_mask)
    col_sums = col_sums + jnp.sum(jnp.where(mask, acc, 0.0), axis=0)
    plgpu.store(copy_ref.at[index], scaled_f16_operand(acc, copy_scale), mask=mask)
  plgpu.store(col_sum_ref.at[pid_m, cols], col_sums, mask=col_mask)

  @pl.when(pid_m == 0)
  def _():
    plgpu.store(bound_ref.at[0, cols], bound, mask=col_mask)


def _sum_splits_when_last(p: Product, tile_index, pid_k, pieces, out_ref, partial_ref,
                          counter_ref, interpret):
  """Stores this split's partial tile; the tile's last program to arrive sums all of them.

  The barrier orders every thread's partial stores before the counter's
  acquire-release increment (GPU scope), as CUTLASS's semaphores do; the sum
  runs in split order, so its bits do not depend on which program came last.
  """
  split_rows = p.m

  def at(split, rows, row_mask, cols, col_mask):   # a piece's tile in split `split`'s partial
    return tile_indices(split * split_rows + rows, row_mask, cols, col_mask)

  for acc, *piece in pieces:
    index, mask = at(pid_k, *piece)
    plgpu.store(partial_ref.at[index], acc, mask=mask)
  if not interpret:  # programs run one after another there
    plgpu.debug_barrier()
  arrived = plgpu.atomic_add(counter_ref, (tile_index,), jnp.int32(1))

  @pl.when(arrived == p.tile.split_k - 1)
  def _():
    for _, *piece in pieces:
      index, mask = at(0, *piece)
      total = plgpu.load(partial_ref.at[index], mask=mask, other=0.0)
      for split in range(1, p.tile.split_k):
        total += plgpu.load(partial_ref.at[at(split, *piece)[0]], mask=mask, other=0.0)
      plgpu.store(out_ref.at[tile_indices(*piece)[0]], total.astype(out_ref.dtype), mask=mask)


def tiled_matmul(a, b, *, tile: TileConfig, mode: DotMode, out_dtype, transpose_a=False,
                 gelu_input=None, row_sums=False, sum_splits_in_kernel=False, out=None,
                 interpret=False, name="tiled_matmul"):
  """One product in its own launch; see `Product` and `grouped_launch`."""
  k, m = a.shape if transpose_a else a.shape[::-1]
  product = Product(m, b.shape[1], k, tile, jnp.dtype(out_dtype), transpose_a=transpose_a,
                    fuse_gelu=gelu_input is not None, row_sums=row_sums,
                    sum_splits_in_kernel=sum_splits_in_kernel)
  operands = (a, b) if gelu_input is None else (a, b, gelu_input)
  if product.counts_arrivals:
    operands += (jnp.zeros((product.tiles,), jnp.int32),)
  [result] = grouped_launch([product], [operands], mode=mode, interpret=interpret, out=out,
                            name=name)
  return result
