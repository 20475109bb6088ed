"""The Triton backend's launch 1 as one Pallas Mosaic-GPU grid (Hopper: wgmma fed by TMA).

Pallas-Triton converts an fp32 weight tile to a 16-bit operand through one
shared-memory buffer, so every contraction step's MMAs wait for the next
conversion (benchmarks/NOTES.md, 22). Here the converted tiles alternate
between two buffers, so one wgmma group stays in flight, and TMA feeds the
pipelines.

`launch_1` is the 16-bit modes' first launch: the pre-GELU gradient
`(grad_output @ fc2_weight) * gelu'(fc1_output)` and `grad_fc2_weight =
grad_output.T @ gelu_output` as one grid, as the Triton launch runs them. The
Triton backend runs it where its Config says (`Config.mosaic_launch_1`) and
`unsupported_reason` allows; its casts launch writes the 16-bit operands with
the padded rows this kernel reads. Its tiles are built from
`converted_weight_product` (x @ fp32 weight), `weight_grad_tile` (g.T @ z
over S) and `write_tile`, which a launch 2 can share (a prototype:
benchmarks/mosaic_probe.py).
"""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from vision_mlp_bwd.backends.mosaic.tiles import (ROW_MULTIPLE, padded_rows, swizzled_tiles,
                                                   tma_tile_rows)
from vision_mlp_bwd.backends.shared import out_struct
from vision_mlp_bwd.problem import Problem
from vision_mlp_bwd.reference import gelu_tanh_grad

WEIGHT_GRAD_TILE = (128, 128, 64)   # grad_fc2_weight: rows (H), columns (I), step (S)

gelu_derivative = gelu_tanh_grad   # the epilogue's (benchmarks/gelu_forms.py replaces it to time)


def pre_tiling(tokens: int) -> tuple[tuple[int, int, int], int]:
  """The pre-GELU gradient's tile (rows, columns, contraction step) and pipeline depth for S.

  Above S=128 one 256-row block of rows reads and converts each fp32 weight
  tile once where two 128-row blocks did it twice: at S=211 the launch moves
  ~49 MB through L2 instead of ~67 MB (it is bound by that traffic), 20.7
  against 23.0 us; S=131 21.1 / 22.2, S=256 21.0 / 23.5 (benchmarks/NOTES.md,
  24). Four stages of it exceed shared memory."""
  return ((128, 64, 64), 4) if tokens <= 128 else ((256, 64, 64), 3)


def unsupported_reason(problem: Problem, interpret: bool) -> str | None:
  """Why `launch_1` cannot run `problem` here, or None."""
  for name, size, tile in (("H", problem.hidden, WEIGHT_GRAD_TILE[0]),
                           ("I", problem.intermediate, WEIGHT_GRAD_TILE[1])):
    if size % tile:
      return f"{name}={size} is not a multiple of {tile}."
  if interpret:
    return "Mosaic GPU kernels do not run in Pallas interpret mode."
  capability = getattr(jax.devices()[0], "compute_capability", None)
  if capability is None or not str(capability).startswith("9"):
    return f"wgmma needs a Hopper GPU (compute capability 9.x), not {capability}."
  return None


# JAX 0.11 deprecates `plgpu.load`'s index argument, which 0.10 requires.
_LOAD_NEEDS_INDEX = (inspect.signature(plgpu.load).parameters["idx"].default
                     is inspect.Parameter.empty)


def load_wgmma(ref):
  """The whole shared-memory `ref` in registers, in wgmma's accumulator layout."""
  if _LOAD_NEEDS_INDEX:
    return plgpu.load(ref, (), layout=plgpu.Layout.WGMMA)
  return plgpu.load(ref, layout=plgpu.Layout.WGMMA)


def write_tile(value, out_gmem, rows_per_tile=ROW_MULTIPLE):
  """Stores a register tile to `out_gmem` through shared memory, allocated where a finished
  pipeline's buffers were."""
  def store(out_smem):
    out_smem[...] = value
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(out_smem, out_gmem)
    plgpu.wait_smem_to_gmem(0)

  pl.run_scoped(store, plgpu.SMEM(value.shape, value.dtype,
                                  transforms=swizzled_tiles(value.dtype, rows_per_tile)))


def converted_weight_product(acc_ref, b16, x_gmem, w_gmem, stages):
  """`acc_ref += x_gmem @ w_gmem`: 16-bit `x [M, K]` tiles, fp32 `w [K, N]` tiles rounded to
  x's dtype into the two alternating buffers `b16 [2, step, N]`, so one wgmma group stays in
  flight while the next tile converts."""
  (m, k), (_, step_k, n), dtype = x_gmem.shape, b16.shape, x_gmem.dtype

  def step(indices, a_smem, b_smem):
    slot = indices[0] % 2
    b16.at[slot][...] = load_wgmma(b_smem).astype(dtype)
    plgpu.commit_smem()
    plgpu.wgmma(acc_ref, a_smem, b16.at[slot])
    plgpu.wgmma_wait(1)   # the previous step's MMAs: their buffer is converted into next

  plgpu.emit_pipeline(
      step, grid=(pl.cdiv(k, step_k),), max_concurrent_steps=stages,
      in_specs=[plgpu.BlockSpec((m, step_k), lambda j: (0, j),
                                transforms=swizzled_tiles(dtype), delay_release=1),
                plgpu.BlockSpec((step_k, n), lambda j: (j, 0),
                                transforms=swizzled_tiles(jnp.float32))],
  )(x_gmem, w_gmem)
  plgpu.wgmma_wait(0)


def weight_grad_tile(g_gmem, z_gmem, out_gmem, stages):
  """`out_gmem [M, N] = g_gmem[S, M].T @ z_gmem[S, N]` in fp32, 16-bit operands, over S in
  steps of `WEIGHT_GRAD_TILE[2]`."""
  (s, m), n, step_k = g_gmem.shape, z_gmem.shape[1], WEIGHT_GRAD_TILE[2]
  dtype = g_gmem.dtype

  def tile(acc_ref):
    def step(_, a_smem, b_smem):
      plgpu.wgmma(acc_ref, a_smem.transpose((1, 0)), b_smem)
      plgpu.wgmma_wait(1)

    plgpu.emit_pipeline(
        step, grid=(pl.cdiv(s, step_k),), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((step_k, m), lambda j: (j, 0), transforms=swizzled_tiles(dtype),
                                  delay_release=1),
                  plgpu.BlockSpec((step_k, n), lambda j: (j, 0), transforms=swizzled_tiles(dtype),
                                  delay_release=1)],
    )(g_gmem, z_gmem)
    plgpu.wgmma_wait(0)
    write_tile(acc_ref[...], out_gmem)

  pl.run_scoped(tile, plgpu.ACC((m, n), jnp.float32))


def launch_1(grad_output16, fc2_weight, fc1_output, gelu_output16, *, stages=None,
             weight_grad_stages=4, pre_tile=None, approx_math=True):
  """`(grad_fc1_output [S, I] 16-bit, grad_fc2_weight [H, I] fp32)` in one Mosaic GPU grid.

  `grad_output16 [padded_rows(S), H]` and `gelu_output16 [padded_rows(S), I]`
  are the 16-bit operands with zero rows past S; `fc2_weight [H, I]` and
  `fc1_output [S, I]` are fp32 as the caller has them. Blocks
  `[0, n_pre)` each compute one `pre_tile` of the pre-GELU gradient
  (`pre_tiling(S)` unless given, with its `stages`): its fp32
  weight tiles are rounded to the operand dtype into two alternating buffers
  that wgmma reads, and the GELU derivative is applied in the epilogue (its
  tanh form cost ~2.5 us there at S=211, but was slower computed during the
  first steps or by the casts launch; benchmarks/NOTES.md, 23). The
  other blocks each compute one tile of `grad_fc2_weight`. Reads past the
  last row are zeros and writes there are dropped (TMA). `approx_math` lets
  the GELU derivative's exp and rsqrt use the hardware's `ex2.approx` and
  `rsqrt.approx` (relative errors near 2^-22, far below the 16-bit rounding
  of the output): 1.1 us faster at S=211 (benchmarks/NOTES.md, 24).
  """
  (s, i), h = fc1_output.shape, fc2_weight.shape[0]
  dtype = grad_output16.dtype
  default_tile, default_stages = pre_tiling(s)
  pm, pn, pk = pre_tile or default_tile
  stages = stages or default_stages
  rows_per_tile = tma_tile_rows(s)   # of fc1_output's, the output's
  wm, wn, _ = WEIGHT_GRAD_TILE
  gm = pl.cdiv(s, pm)
  n_pre = gm * pl.cdiv(i, pn)
  n_weight_grad = (h // wm) * (i // wn)

  def kernel(g_gmem, w_gmem, x_gmem, gelu_gmem, pre_gmem, weight_grad_gmem):
    block = lax.axis_index("block")

    @pl.when(block < n_pre)
    def _():
      rows, cols = pl.ds((block % gm) * pm, pm), pl.ds((block // gm) * pn, pn)

      def tile(acc_ref, b16, x_smem, x_arrived):
        plgpu.copy_gmem_to_smem(x_gmem.at[rows, cols], x_smem, x_arrived)  # for the epilogue
        converted_weight_product(acc_ref, b16, g_gmem.at[rows], w_gmem.at[:, cols], stages)
        plgpu.barrier_wait(x_arrived)
        write_tile((acc_ref[...] * gelu_derivative(load_wgmma(x_smem))).astype(dtype),
                   pre_gmem.at[rows, cols], rows_per_tile)

      pl.run_scoped(tile, plgpu.ACC((pm, pn), jnp.float32),
                    plgpu.SMEM((2, pk, pn), dtype, transforms=swizzled_tiles(dtype)),
                    plgpu.SMEM((pm, pn), jnp.float32,
                               transforms=swizzled_tiles(jnp.float32, rows_per_tile)),
                    plgpu.Barrier(num_arrivals=1))

    @pl.when(block >= n_pre)
    def _():
      job = block - n_pre
      rows, cols = pl.ds((job % (h // wm)) * wm, wm), pl.ds((job // (h // wm)) * wn, wn)
      weight_grad_tile(g_gmem.at[:, rows], gelu_gmem.at[:, cols],
                       weight_grad_gmem.at[rows, cols], weight_grad_stages)

  return plgpu.kernel(
      kernel, out_type=(out_struct((s, i), dtype, fc1_output),
                        out_struct((h, i), jnp.float32, fc1_output)),
      grid=(n_pre + n_weight_grad,), grid_names=("block",),
      compiler_params=plgpu.CompilerParams(approx_math=approx_math),
  )(grad_output16, fc2_weight, fc1_output, gelu_output16)
