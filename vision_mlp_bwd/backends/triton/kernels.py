"""The Pallas-Triton kernel of the backward: masked, tiled matmuls, grouped per launch.

A `Product` is one `C = op(A) @ op(B)`, where `op(A)` is `A` (`[M, K]`) or
`A.T` (`A` stored `[K, M]`) and `op(B)` is `B` (`[K, N]`) or `B.T` (`B` stored
`[N, K]`, K-contiguous, as fp32 tensor-core products want), stored as `C`
(`[M, N]`) or as `C.T` (`store_transposed`, `[N, M]`), with two optional
fusions:

* `fuse_gelu`: the epilogue multiplies the tile by `gelu_tanh_grad` of the
  matching tile of a third input (laid out as the output), so the pre-GELU
  gradient is produced in one pass;
* `row_sums`: the programs of the first column of tiles also sum `op(A)` over
  K, which is a bias gradient when `A` is `grad_output` or the pre-GELU
  gradient, read here anyway.

`grouped_launch` runs several independent jobs in one launch: the 1-D grid
is the concatenation of their programs, each program runs the body of the
job it belongs to. At small S every product alone fills the GPU poorly;
grouped, their programs overlap. Besides products, a job can be a `Cast` of
an input to a 16-bit operand dtype, so such casts ride along in a launch
instead of taking a kernel each.

Every load and store is masked, so any M, N, K runs without reading or writing
out of bounds. Reductions never use atomics: a split contraction writes one
partial result per split, summed afterwards in a fixed order.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from vision_mlp_bwd.backends.triton.config import TileConfig
from vision_mlp_bwd.precision import DotMode, kernel_dot
from vision_mlp_bwd.reference import gelu_tanh_grad

TRITON_DEPRECATION = r"The Pallas Triton backend is deprecated and will be removed"


@functools.cache
def _filter_triton_deprecation():
  """JAX 0.11 warns at every Triton lowering; that one warning is expected here."""
  warnings.filterwarnings("ignore", message=TRITON_DEPRECATION, category=DeprecationWarning)


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
  store_transposed: bool = False
  fuse_gelu: bool = False
  row_sums: bool = False
  lhs_in_registers: bool = False   # see precision.kernel_dot

  @property
  def grid(self):
    """(m blocks, n-block groups, splits); m varies fastest so neighbours share B's tiles."""
    t = self.tile
    n_blocks = pl.cdiv(self.n, t.block_n)
    return pl.cdiv(self.m, t.block_m), pl.cdiv(n_blocks, t.tiles_per_program), t.split_k

  @property
  def stored_shape(self) -> tuple[int, int]:
    return (self.n, self.m) if self.store_transposed else (self.m, self.n)

  @property
  def programs(self) -> int:
    gm, gn, gk = self.grid
    return gm * gn * gk

  @property
  def num_inputs(self) -> int:
    return 3 if self.fuse_gelu else 2

  @property
  def num_outputs(self) -> int:
    return 1 + self.row_sums

  def check(self, operands):
    a, b = operands[0], operands[1]
    assert a.shape == ((self.k, self.m) if self.transpose_a else (self.m, self.k)), (self, a.shape)
    assert b.shape == ((self.n, self.k) if self.transpose_b else (self.k, self.n)), (self, b.shape)
    assert len(operands) == self.num_inputs, self
    assert not (self.fuse_gelu and self.tile.split_k > 1), self

  def run(self, program, in_refs, out_refs, mode: DotMode):
    _product_program(self, program, in_refs, out_refs, mode)

  def finish(self, outs):
    """The launch's outputs of this product -> the product (and row sums)."""
    product, split = outs[0], self.tile.split_k
    if split > 1:
      product = product.reshape(split, *self.stored_shape).sum(axis=0).astype(self.out_dtype)
    if self.row_sums:
      return product, outs[1].reshape(split, self.m).sum(axis=0)
    return product

  def out_shapes(self, like):
    split = self.tile.split_k
    dtype = jnp.float32 if split > 1 else self.out_dtype
    rows, cols = self.stored_shape
    shapes = [_out_struct((split * rows, cols), dtype, like)]
    if self.row_sums:
      shapes.append(_out_struct((split * self.m,), jnp.float32, like))
    return shapes


@dataclasses.dataclass(frozen=True)
class Cast:
  """`x.astype(out_dtype)` for an input of `shape`, `block` elements per program."""

  shape: tuple[int, ...]
  out_dtype: jnp.dtype
  block: int = 4096

  num_inputs = 1
  num_outputs = 1

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def programs(self) -> int:
    return pl.cdiv(self.size, self.block)

  def check(self, operands):
    assert len(operands) == 1 and operands[0].shape == (self.size,), (self, operands)

  def out_shapes(self, like):
    return [_out_struct((self.size,), self.out_dtype, like)]

  def run(self, program, in_refs, out_refs, mode: DotMode):
    del mode
    indices, mask = _span(program, self.block, self.size)
    x = plgpu.load(in_refs[0].at[indices], mask=mask, other=0.0)
    plgpu.store(out_refs[0].at[indices], x.astype(out_refs[0].dtype), mask=mask)

  def finish(self, outs):
    return outs[0].reshape(self.shape)


def _out_struct(shape, dtype, like):
  """An output varying over the same `shard_map` axes as `like` (Pallas checks that)."""
  mat = getattr(jax.typeof(like), "mat", None)
  if mat is not None:
    try:
      return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    except TypeError:  # a JAX without manual-axis types on ShapeDtypeStruct
      pass
  return jax.ShapeDtypeStruct(shape, dtype)


def _span(block_index, block_size, extent):
  """Indices of one tile along an axis and the mask of those inside `extent`."""
  indices = block_index * block_size + jnp.arange(block_size)
  return indices, indices < extent


def _load(ref, rows, row_mask, cols, col_mask):
  """A zero-padded `[len(rows), len(cols)]` tile of a 2-D ref."""
  return plgpu.load(ref.at[rows[:, None], cols[None, :]],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)


def _product_program(p: Product, program, in_refs, out_refs, mode: DotMode):
  """The work of program number `program` of product `p`: its output tiles in turn."""
  gm, gn, _ = p.grid
  pid_m, group, pid_k = program % gm, (program // gm) % gn, program // (gm * gn)
  first_n = group * p.tile.tiles_per_program
  if p.tile.tiles_per_program == 1:
    _output_tile(p, pid_m, first_n, pid_k, in_refs, out_refs, mode)
  else:
    @pl.loop(0, p.tile.tiles_per_program)
    def _(j):
      _output_tile(p, pid_m, first_n + j, pid_k, in_refs, out_refs, mode)


def _output_tile(p: Product, pid_m, pid_n, pid_k, in_refs, out_refs, mode: DotMode):
  """One output tile (one split of its contraction), stored; masked at every edge."""
  a_ref, b_ref, *x_ref = in_refs
  out_ref, *row_sum_ref = out_refs
  t = p.tile
  rows, row_mask = _span(pid_m, t.block_m, p.m)
  cols, col_mask = _span(pid_n, t.block_n, p.n)
  steps = pl.cdiv(pl.cdiv(p.k, t.block_k), t.split_k)

  def step(s, carry):
    acc, sums = carry
    ks, k_mask = _span(pid_k * steps + s, t.block_k, p.k)
    if p.transpose_a:
      a = _load(a_ref, ks, k_mask, rows, row_mask)      # [bk, bm]
    else:
      a = _load(a_ref, rows, row_mask, ks, k_mask)      # [bm, bk]
    if p.transpose_b:
      b = _load(b_ref, cols, col_mask, ks, k_mask)      # [bn, bk]
    else:
      b = _load(b_ref, ks, k_mask, cols, col_mask)      # [bk, bn]
    acc += kernel_dot(a, b, mode, contract_a=0 if p.transpose_a else 1,
                      contract_b=1 if p.transpose_b else 0,
                      lhs_in_registers=p.lhs_in_registers)
    if p.row_sums:
      sums += jnp.sum(a.astype(jnp.float32), axis=0 if p.transpose_a else 1)
    return acc, sums

  init = (jnp.zeros((t.block_m, t.block_n), jnp.float32), jnp.zeros((t.block_m,), jnp.float32))
  acc, sums = lax.fori_loop(0, steps, step, init)

  if p.store_transposed:  # the tile as stored: [bn, bm] of C.T
    acc, rows, row_mask, cols, col_mask = acc.T, cols, col_mask, rows, row_mask
  if p.fuse_gelu:
    x = _load(x_ref[0], rows, row_mask, cols, col_mask)
    acc = acc * gelu_tanh_grad(x.astype(jnp.float32))
  out_rows = pid_k * p.stored_shape[0] + rows
  plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
              mask=row_mask[:, None] & col_mask[None, :])
  if p.row_sums:
    m_rows, m_mask = (cols, col_mask) if p.store_transposed else (rows, row_mask)
    @pl.when(pid_n == 0)
    def _():
      plgpu.store(row_sum_ref[0].at[pid_k * p.m + m_rows], sums, mask=m_mask)


def _grouped_kernel(*refs, jobs, mode, aliased):
  n_in = sum(job.num_inputs for job in jobs)
  in_refs, out_refs = refs[:n_in], refs[n_in + aliased:]
  pid = pl.program_id(0)
  first = 0
  for job in jobs:
    ins, in_refs = in_refs[:job.num_inputs], in_refs[job.num_inputs:]
    outs, out_refs = out_refs[:job.num_outputs], out_refs[job.num_outputs:]
    if len(jobs) == 1:
      job.run(pid, ins, outs, mode)
    else:
      @pl.when((pid >= first) & (pid < first + job.programs))
      def _(job=job, ins=ins, outs=outs, first=first):
        job.run(pid - first, ins, outs, mode)
    first += job.programs


def grouped_launch(jobs, operands, *, mode: DotMode, interpret=False, out=None,
                   name="grouped_launch"):
  """Runs `jobs` (`Product`s and `Cast`s, with `operands[i]` for each) in one launch.

  Returns, per job: for a product, the product `[M, N]` in its `out_dtype`
  (split contractions summed in fp32 first), or `(product, row_sums [M])`
  where it asks for row sums; for a cast, the cast array. `out`, if given, is
  the buffer the first job writes its first output into (aliased); tests pass
  a NaN-filled one to prove that every element is written. Warps and
  pipeline depth are the first product's.
  """
  operands = [(ops[0].reshape(-1),) if isinstance(job, Cast) else tuple(ops)
              for job, ops in zip(jobs, operands, strict=True)]
  for job, ops in zip(jobs, operands):
    job.check(ops)
  from vision_mlp_bwd.sharding import match_varying_axes  # sharding imports this module
  inputs = [x for ops in operands for x in ops] + ([out] if out is not None else [])
  inputs = list(match_varying_axes(*inputs))
  if out is not None:
    *inputs, out = inputs
  out_shapes = [s for job in jobs for s in job.out_shapes(like=inputs[0])]
  if out is not None:
    assert out.shape == out_shapes[0].shape and out.dtype == out_shapes[0].dtype, out
  _filter_triton_deprecation()
  tiles = [job.tile for job in jobs if isinstance(job, Product)]
  warps, stages = (tiles[0].num_warps, tiles[0].num_stages) if tiles else (4, 1)
  outs = pl.pallas_call(
      functools.partial(_grouped_kernel, jobs=tuple(jobs), mode=mode, aliased=out is not None),
      out_shape=out_shapes,
      grid=(sum(job.programs for job in jobs),),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      input_output_aliases={len(inputs): 0} if out is not None else {},
      interpret=interpret,
      name=name,
  )(*inputs, *([out] if out is not None else []))
  results = []
  for job in jobs:
    results.append(job.finish(outs[:job.num_outputs]))
    outs = outs[job.num_outputs:]
  return results


def tiled_matmul(a, b, *, tile: TileConfig, mode: DotMode, out_dtype, transpose_a=False,
                 gelu_input=None, row_sums=False, out=None, interpret=False,
                 name="tiled_matmul"):
  """One product in its own launch; see `Product` and `grouped_launch`."""
  k, m = a.shape if transpose_a else a.shape[::-1]
  product = Product(m, b.shape[1], k, tile, jnp.dtype(out_dtype), transpose_a=transpose_a,
                    fuse_gelu=gelu_input is not None, row_sums=row_sums)
  operands = (a, b) if gelu_input is None else (a, b, gelu_input)
  [result] = grouped_launch([product], [operands], mode=mode, interpret=interpret, out=out,
                            name=name)
  return result
