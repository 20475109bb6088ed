"""The one Pallas-Triton kernel of the backward: a masked, tiled matmul.

`tiled_matmul` computes `C = op(A) @ B` where `op(A)` is `A` (`[M, K]`) or
`A.T` (`A` stored `[K, M]`), with two optional fusions:

* `gelu_input`: the epilogue multiplies the tile by `gelu_tanh_grad` of the
  matching tile of `gelu_input` (`[M, N]`), so the pre-GELU gradient is
  produced in one pass;
* `row_sums`: the programs of the first column of tiles also sum `op(A)` over
  K, which is a bias gradient when `A` is `grad_output` or the pre-GELU
  gradient, read here anyway.

Every load and store is masked, so any M, N, K runs without reading or writing
out of bounds. Reductions never use atomics: a split contraction writes one
partial result per split, summed afterwards in a fixed order.
"""

from __future__ import annotations

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


def _span(block_index, block_size, extent):
  """Indices of one tile along an axis and the mask of those inside `extent`."""
  indices = block_index * block_size + jnp.arange(block_size)
  return indices, indices < extent


def _load(ref, rows, row_mask, cols, col_mask):
  """A zero-padded `[len(rows), len(cols)]` tile of a 2-D ref."""
  return plgpu.load(ref.at[rows[:, None], cols[None, :]],
                    mask=row_mask[:, None] & col_mask[None, :], other=0.0)


def _matmul_kernel(*refs, m, n, k, tile: TileConfig, mode: DotMode, transpose_a: bool,
                   fuse_gelu: bool, row_sums: bool, donated_out: bool):
  a_ref, b_ref, *refs = refs
  x_ref = refs.pop(0) if fuse_gelu else None
  if donated_out:
    refs.pop(0)  # the aliased output buffer; written through out_ref
  out_ref, *refs = refs
  row_sum_ref = refs.pop(0) if row_sums else None

  pid_m, pid_n, pid_k = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  rows, row_mask = _span(pid_m, tile.block_m, m)
  cols, col_mask = _span(pid_n, tile.block_n, n)
  steps = pl.cdiv(pl.cdiv(k, tile.block_k), tile.split_k)

  def step(s, carry):
    acc, sums = carry
    ks, k_mask = _span(pid_k * steps + s, tile.block_k, k)
    if transpose_a:
      a = _load(a_ref, ks, k_mask, rows, row_mask)      # [bk, bm]
    else:
      a = _load(a_ref, rows, row_mask, ks, k_mask)      # [bm, bk]
    b = _load(b_ref, ks, k_mask, cols, col_mask)        # [bk, bn]
    acc += kernel_dot(a, b, mode, contract_a=0 if transpose_a else 1)
    if row_sums:
      sums += jnp.sum(a.astype(jnp.float32), axis=0 if transpose_a else 1)
    return acc, sums

  init = (jnp.zeros((tile.block_m, tile.block_n), jnp.float32),
          jnp.zeros((tile.block_m,), jnp.float32))
  acc, sums = lax.fori_loop(0, steps, step, init)

  if fuse_gelu:
    x = _load(x_ref, rows, row_mask, cols, col_mask)
    acc = acc * gelu_tanh_grad(x.astype(jnp.float32))
  out_rows = pid_k * m + rows
  plgpu.store(out_ref.at[out_rows[:, None], cols[None, :]], acc.astype(out_ref.dtype),
              mask=row_mask[:, None] & col_mask[None, :])
  if row_sums:
    @pl.when(pid_n == 0)
    def _():
      plgpu.store(row_sum_ref.at[out_rows], sums, mask=row_mask)


def tiled_matmul(a, b, *, tile: TileConfig, mode: DotMode, out_dtype, transpose_a=False,
                 gelu_input=None, row_sums=False, out=None, interpret=False,
                 name="tiled_matmul"):
  """`op(a) @ b` (fp32 accumulation), optionally fused as the module docstring says.

  Returns the product in `out_dtype`, and with `row_sums` also the fp32 sums of
  `op(a)` over the contraction, shape `[M]`. `out`, if given, is the buffer the
  kernel writes the product into (`[split_k * M, N]`, aliased); tests pass a
  NaN-filled one to prove that every element is written.
  """
  k, m = a.shape if transpose_a else a.shape[::-1]
  k_b, n = b.shape
  assert k == k_b, (a.shape, b.shape, transpose_a)
  if gelu_input is not None:
    assert gelu_input.shape == (m, n) and tile.split_k == 1, (gelu_input.shape, tile)
  split = tile.split_k
  out_shapes = [jax.ShapeDtypeStruct((split * m, n), jnp.float32 if split > 1 else out_dtype)]
  if row_sums:
    out_shapes.append(jax.ShapeDtypeStruct((split * m,), jnp.float32))
  kernel = functools.partial(
      _matmul_kernel, m=m, n=n, k=k, tile=tile, mode=mode, transpose_a=transpose_a,
      fuse_gelu=gelu_input is not None, row_sums=row_sums, donated_out=out is not None)
  inputs = [a, b] + ([gelu_input] if gelu_input is not None else [])
  if out is not None:
    assert out.shape == out_shapes[0].shape and out.dtype == out_shapes[0].dtype, out
  _filter_triton_deprecation()
  outs = pl.pallas_call(
      kernel,
      out_shape=out_shapes,
      grid=(pl.cdiv(m, tile.block_m), pl.cdiv(n, tile.block_n), split),
      compiler_params=plgpu.CompilerParams(num_warps=tile.num_warps, num_stages=tile.num_stages),
      input_output_aliases={len(inputs): 0} if out is not None else {},
      interpret=interpret,
      name=name,
  )(*inputs, *([out] if out is not None else []))
  product = outs[0]
  if split > 1:
    product = product.reshape(split, m, n).sum(axis=0).astype(out_dtype)
  if not row_sums:
    return product
  return product, outs[1].reshape(split, m).sum(axis=0)
