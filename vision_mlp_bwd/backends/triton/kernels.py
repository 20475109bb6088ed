"""The Pallas-Triton kernel of the backward: masked, tiled matmuls, grouped per launch.

A `Product` is one `C = op(A) @ op(B)`, where `op(A)` is `A` (`[M, K]`) or
`A.T` (`A` stored `[K, M]`) and `op(B)` is `B` (`[K, N]`) or `B.T` (`B` stored
`[N, K]`, K-contiguous, as fp32 tensor-core products want), with two optional
fusions:

* `fuse_gelu`: the epilogue multiplies the tile by `gelu_tanh_grad` of the
  matching tile of a third input `[M, N]`, so the pre-GELU gradient is
  produced in one pass;
* `row_sums`: the programs of the first column of tiles also sum `op(A)` over
  K, which is a bias gradient when `A` is `grad_output` or the pre-GELU
  gradient, read here anyway.

`grouped_matmul` runs several independent products in one launch: the 1-D
grid is the concatenation of their programs, each program runs the body of
the product it belongs to. At small S every product alone fills the GPU
poorly; grouped, their programs overlap.

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
  fuse_gelu: bool = False
  row_sums: bool = False

  @property
  def grid(self):
    """(m blocks, n-block groups, splits); m varies fastest so neighbours share B's tiles."""
    t = self.tile
    n_blocks = pl.cdiv(self.n, t.block_n)
    return pl.cdiv(self.m, t.block_m), pl.cdiv(n_blocks, t.tiles_per_program), t.split_k

  @property
  def programs(self) -> int:
    gm, gn, gk = self.grid
    return gm * gn * gk

  @property
  def num_inputs(self) -> int:
    return 3 if self.fuse_gelu else 2

  def out_shapes(self, like):
    split = self.tile.split_k
    dtype = jnp.float32 if split > 1 else self.out_dtype
    shapes = [_out_struct((split * self.m, self.n), dtype, like)]
    if self.row_sums:
      shapes.append(_out_struct((split * self.m,), jnp.float32, like))
    return shapes


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
                      contract_b=1 if p.transpose_b else 0)
    if p.row_sums:
      sums += jnp.sum(a.astype(jnp.float32), axis=0 if p.transpose_a else 1)
    return acc, sums

  init = (jnp.zeros((t.block_m, t.block_n), jnp.float32), jnp.zeros((t.block_m,), jnp.float32))
  acc, sums = lax.fori_loop(0, steps, step, init)

  if p.fuse_gelu:
    x = _load(x_ref[0], rows, row_mask, cols, col_mask)
    acc = acc * gelu_tanh_grad(x.astype(jnp.float32))
  out_rows = pid_k * p.m + rows
  plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
              mask=row_mask[:, None] & col_mask[None, :])
  if p.row_sums:
    @pl.when(pid_n == 0)
    def _():
      plgpu.store(row_sum_ref[0].at[out_rows], sums, mask=row_mask)


def _grouped_kernel(*refs, products, mode, aliased):
  n_in = sum(p.num_inputs for p in products)
  in_refs, out_refs = refs[:n_in], refs[n_in + aliased:]
  pid = pl.program_id(0)
  first = 0
  for p in products:
    ins, in_refs = in_refs[:p.num_inputs], in_refs[p.num_inputs:]
    n_out = 1 + p.row_sums
    outs, out_refs = out_refs[:n_out], out_refs[n_out:]
    if len(products) == 1:
      _product_program(p, pid, ins, outs, mode)
    else:
      @pl.when((pid >= first) & (pid < first + p.programs))
      def _(p=p, ins=ins, outs=outs, first=first):
        _product_program(p, pid - first, ins, outs, mode)
    first += p.programs


def grouped_matmul(products, operands, *, mode: DotMode, interpret=False, out=None,
                   name="grouped_matmul"):
  """Runs `products` (with `operands[i]` = (a, b[, x]) for each) in one launch.

  Returns, per product, the product `[M, N]` in its `out_dtype` (split
  contractions summed in fp32 first), or `(product, row_sums [M])` where it
  asks for row sums. `out`, if given, is the buffer the first product is
  written into (`[split_k * M, N]`, aliased); tests pass a NaN-filled one to
  prove that every element is written. Warps and pipeline depth are the first
  product's.
  """
  for p, ops in zip(products, operands, strict=True):
    a, b = ops[0], ops[1]
    assert a.shape == ((p.k, p.m) if p.transpose_a else (p.m, p.k)), (p, a.shape)
    assert b.shape == ((p.n, p.k) if p.transpose_b else (p.k, p.n)), (p, b.shape)
    assert len(ops) == p.num_inputs, p
    assert not (p.fuse_gelu and p.tile.split_k > 1), p
  from vision_mlp_bwd.sharding import match_varying_axes  # sharding imports this module
  inputs = [x for ops in operands for x in ops] + ([out] if out is not None else [])
  inputs = list(match_varying_axes(*inputs))
  if out is not None:
    *inputs, out = inputs
  out_shapes = [s for p in products for s in p.out_shapes(like=inputs[0])]
  if out is not None:
    assert out.shape == out_shapes[0].shape and out.dtype == out_shapes[0].dtype, out
  _filter_triton_deprecation()
  lead = products[0].tile
  outs = pl.pallas_call(
      functools.partial(_grouped_kernel, products=tuple(products), mode=mode,
                        aliased=out is not None),
      out_shape=out_shapes,
      grid=(sum(p.programs for p in products),),
      compiler_params=plgpu.CompilerParams(num_warps=lead.num_warps, num_stages=lead.num_stages),
      input_output_aliases={len(inputs): 0} if out is not None else {},
      interpret=interpret,
      name=name,
  )(*inputs, *([out] if out is not None else []))
  results = []
  for p in products:
    product, outs = outs[0], outs[1:]
    split = p.tile.split_k
    if split > 1:
      product = product.reshape(split, p.m, p.n).sum(axis=0).astype(p.out_dtype)
    if p.row_sums:
      results.append((product, outs[0].reshape(split, p.m).sum(axis=0)))
      outs = outs[1:]
    else:
      results.append(product)
  return results


def tiled_matmul(a, b, *, tile: TileConfig, mode: DotMode, out_dtype, transpose_a=False,
                 gelu_input=None, row_sums=False, out=None, interpret=False,
                 name="tiled_matmul"):
  """One product in its own launch; see `Product` and `grouped_matmul`."""
  k, m = a.shape if transpose_a else a.shape[::-1]
  product = Product(m, b.shape[1], k, tile, jnp.dtype(out_dtype), transpose_a=transpose_a,
                    fuse_gelu=gelu_input is not None, row_sums=row_sums)
  operands = (a, b) if gelu_input is None else (a, b, gelu_input)
  [result] = grouped_matmul([product], [operands], mode=mode, interpret=interpret, out=out,
                            name=name)
  return result
