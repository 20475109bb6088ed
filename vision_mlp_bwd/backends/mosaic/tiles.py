"""Shared-memory tile layouts and row padding that every Mosaic GPU kernel here uses."""

from __future__ import annotations

import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROW_MULTIPLE = 8   # TMA's tiled shared-memory layouts want arrays with rows in multiples of 8
SWIZZLE = 128      # bytes: one swizzled row of a tile, the widest swizzle


def padded_rows(tokens: int) -> int:
  """Rows of a 16-bit `[S, ·]` operand padded with zeros to a multiple of 8 for TMA."""
  return pl.cdiv(tokens, ROW_MULTIPLE) * ROW_MULTIPLE


def tma_tile_rows(rows: int) -> int:
  """Rows of a shared-memory tile layout (`swizzled_tiles`) through which TMA reaches an
  array of `rows` rows: 8, or 1 where the rows are not a whole number of groups of 8."""
  return ROW_MULTIPLE if rows % ROW_MULTIPLE == 0 else 1


def swizzled_tiles(dtype, rows=ROW_MULTIPLE, swizzle=SWIZZLE):
  """A swizzled shared-memory tile layout: `rows` x one `swizzle`-byte row of `dtype`.

  wgmma operands need rows=8; rows=1 lets TMA reach arrays whose row count
  is not a multiple of 8 (the unpadded fp32 `fc1_output`, the output)."""
  return (plgpu.TilingTransform((rows, swizzle // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(swizzle))
