"""The Hopper GEMM engine: one persistent, warp-specialized Pallas Mosaic-GPU matmul.

`matmul(a, b)` computes `C = op(A) @ B` with 16-bit operands and fp32
accumulation, where `op(A)` is `A` (`[M, K]`) or, with `transpose_a`, `A.T`
(`A` stored `[K, M]`, as the weight gradients' `grad_output` and pre-GELU
gradient are), and `B` is `[K, N]`. Every product of the backward has this
form in the layouts its operands arrive in; a 16-bit tile transposes for free
in wgmma, so nothing is copied.

How it runs (the design of jax's `hopper_matmul_mgpu` example):
- one program per SM (a persistent grid) walks the output's blocks in a
  planar snake order, so blocks that run together share operand tiles in L2;
- in each program a memory warpgroup streams `A` and `B` tiles by TMA into a
  ring of `stages` shared-memory buffers, and two compute warpgroups each
  accumulate one `tile_m x tile_n` half of the block with wgmma (registers
  are moved from the memory warpgroup to them);
- the epilogue writes each half through shared memory by TMA, in
  `epilogue_tile` pieces, double-buffered, so the next block's loads start
  while the stores drain.

Reads past the arrays' ends are zeros and writes there are dropped (TMA), so
M, N and K need not be multiples of a tile; 16-bit arrays need a row count
that is a multiple of 8 (TMA's tiled layouts).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

SWIZZLE = 128   # bytes: the widest shared-memory swizzle; every tile's minor dim spans >= 128 B


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiles and scheduling of one product."""

  tile_m: int = 128         # rows of one compute warpgroup's accumulator
  tile_n: int = 128         # columns of it
  tile_k: int = 64          # contraction step
  stages: int = 4           # shared-memory ring depth of the TMA pipeline
  split: str = "n"          # the block is two warpgroup tiles side by side along "m" or "n"
  grid_minor: str = "n"     # planar snake: the dimension that varies fastest ...
  grid_tile_width: int = 8  # ... within bands this many blocks wide
  epilogue_tile: tuple[int, int] = (64, 64)
  # wgmma groups left in flight when a step's body returns (0 or 1): with 1, a
  # stage's buffers are released one step later, and the next step's MMAs are
  # issued before the last ones finish.
  mma_in_flight: int = 0

  @property
  def block(self) -> tuple[int, int]:
    """(rows, columns) of the output block one program computes at a time."""
    return (self.tile_m * (2 if self.split == "m" else 1),
            self.tile_n * (2 if self.split == "n" else 1))

  def __post_init__(self):
    if self.split not in ("m", "n") or self.grid_minor not in ("m", "n"):
      raise ValueError(f"GemmConfig.split and grid_minor take 'm' or 'n': {self}")


def _tiles(dtype):
  """Swizzled shared-memory tiling for a tile whose minor dimension spans >= 128 bytes."""
  return (plgpu.TilingTransform((8, SWIZZLE // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(SWIZZLE))


def _num_sms() -> int:
  device = jax.devices()[0]
  return int(getattr(device, "core_count", 0) or 132)


def matmul(a, b, *, transpose_a: bool = False, out_dtype=jnp.float32,
           config: GemmConfig = GemmConfig(), num_programs: int | None = None):
  """`op(a) @ b` in fp32 accumulation, stored as `out_dtype`; see the module docstring."""
  if a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize != 2:
    raise TypeError(f"matmul takes two operands of one 16-bit dtype; got a {a.dtype}, "
                    f"b {b.dtype}.")
  (m, k) = a.shape[::-1] if transpose_a else a.shape
  if b.shape[0] != k:
    raise ValueError(f"matmul: op(a) is [{m}, {k}] but b has shape {b.shape}; expected [{k}, N].")
  n = b.shape[1]
  if transpose_a and config.split == "m":
    raise ValueError("GemmConfig.split='m' slices a transposed A along its minor dimension; "
                     "use split='n'.")
  block_m, block_n = config.block
  grid = (pl.cdiv(m, block_m), pl.cdiv(n, block_n))
  programs = min(num_programs or _num_sms(), grid[0] * grid[1])
  kernel = functools.partial(_kernel, config=config, transpose_a=transpose_a, grid_mn=grid,
                             k_steps=pl.cdiv(k, config.tile_k))
  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(programs,), grid_names=("program",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )(a, b)


def _kernel(a_gmem, b_gmem, out_gmem, *, config: GemmConfig, transpose_a: bool, grid_mn,
            k_steps):
  dtype, out_dtype = a_gmem.dtype, out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  block_m, block_n = config.block
  epi_m, epi_n = config.epilogue_tile
  pieces = (tile_m // epi_m) * (tile_n // epi_n)
  slots = min(2, pieces)

  delay = config.mma_in_flight
  a_spec = (plgpu.BlockSpec((tile_k, block_m), lambda kk: (kk, 0), transforms=_tiles(dtype),
                            delay_release=delay)
            if transpose_a else
            plgpu.BlockSpec((block_m, tile_k), lambda kk: (0, kk), transforms=_tiles(dtype),
                            delay_release=delay))
  b_spec = plgpu.BlockSpec((tile_k, block_n), lambda kk: (kk, 0), transforms=_tiles(dtype),
                           delay_release=delay)

  def pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(k_steps,), memory_registers=40, in_specs=[a_spec, b_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=config.stages,
        compute_context=compute_context)

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
      out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), out_dtype, transforms=_tiles(out_dtype)),
      collective_axes="wg")
  def _scope(allocations, out_smem):
    wg = lax.axis_index("wg")

    @plgpu.nd_loop((grid_mn[0] * grid_mn[1],), collective_axes="program")
    def _blocks(loop):
      (index,) = loop.index
      bm, bn = plgpu.planar_snake(index, grid_mn, 0 if config.grid_minor == "m" else 1,
                                  config.grid_tile_width)
      block_rows, block_cols = pl.ds(bm * block_m, block_m), pl.ds(bn * block_n, block_n)
      if config.split == "m":
        wg_rows, wg_cols = pl.ds(wg * tile_m, tile_m), slice(None)
      else:
        wg_rows, wg_cols = slice(None), pl.ds(wg * tile_n, tile_n)

      def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc(acc_ref):
          run_pipeline(acc_ref)
          acc = acc_ref[...].astype(out_dtype)   # waits for the MMAs still in flight
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last block's stores
          out = out_gmem.at[block_rows, block_cols].at[wg_rows, wg_cols]
          for pm in range(tile_m // epi_m):
            for pn in range(tile_n // epi_n):
              slot = (pm * (tile_n // epi_n) + pn) % slots
              rows, cols = slice(pm * epi_m, (pm + 1) * epi_m), slice(pn * epi_n, (pn + 1) * epi_n)
              plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
              out_smem[wg, slot] = acc[rows, cols]
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], out.at[rows, cols])

      def mma(_, a_smem, b_smem, acc_ref):
        if transpose_a:
          plgpu.wgmma(acc_ref, a_smem.at[:, wg_rows].transpose((1, 0)) if config.split == "m"
                      else a_smem.transpose((1, 0)), b_smem.at[:, wg_cols])
        else:
          plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
        plgpu.wgmma_wait(delay)
        return acc_ref

      a_view = a_gmem.at[:, block_rows] if transpose_a else a_gmem.at[block_rows, :]
      pipeline(mma, compute_context)(a_view, b_gmem.at[:, block_cols], allocations=allocations)

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
