"""How fast are Pallas Mosaic-GPU TF32 matmuls with K-major operands on this GPU?

The question behind a Hopper backend for TF32 (benchmarks/NOTES.md, 16-17):
fp32 wgmma wants both operands K-major, which in our backward means
transposed copies of the weights (and of the small `[S, ·]` activations).
This times, per seed S, each of the backward's four products computed as
`A[M, K] @ B[N, K].T` by a plain pipelined wgmma kernel (one output tile per
block), by a persistent, warp-specialized one (its per-tile pipelines apart or
chained into one), and by a plain one that takes
B as the weights are stored (`[K, N]`) and transposes its tiles in shared
memory, beside XLA's TF32 dot of the
same operands and XLA's transpose of a weight. Run on the GPU:

    python -m benchmarks.mosaic_probe --seq-lens 128 256 [--kernels plain persistent chained transposing]
    python -m benchmarks.mosaic_probe --seq-lens 128 256 --kernels converting
    python -m benchmarks.mosaic_probe --seq-lens 211 --kernels launch2 --launch2-variants 4:256 7:128
    python -m benchmarks.mosaic_probe --seq-lens 211 256 --kernels launch1 \
        [--launch1-variants one_exp_rsqrt tanh:exact:64x64x64 ...]

`converting` times instead the F16 pre-activation product (f16 activations,
fp32 weights as stored) with the weight tiles converted in shared memory,
through one or two f16 buffers, beside the Triton kernel's loop.
`launch1` times the package's Mosaic GPU launch 1 (`mosaic_gpu.launch_1`)
per variant: GELU-derivative form, approximate math, pre-activation tile and
pipeline depths. `launch2` times a prototype of launch 2 on Mosaic GPU
(`launch_2_prototype`: split input gradient, grad_fc1_weight) per split and
tile.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from benchmarks.timing import device_times_us
from vision_mlp_bwd.backends import mosaic_gpu

SWIZZLE = 128                 # bytes: one 128-byte row of fp32 is 32 elements
TILE_K = SWIZZLE // 4
SMEM_BYTES = 227 * 1024       # per block on Hopper


def _k_major_tiles():
  """Shared-memory layout of an fp32 `[rows, 32]` tile as wgmma reads it (K-major)."""
  return (plgpu.TilingTransform((8, TILE_K)), plgpu.SwizzleTransform(SWIZZLE))


def _one_tile_per_block(a, b, out_shape, *, tile_m, tile_n, accumulate, scratch_types=()):
  """A kernel whose blocks each own one `[tile_m, tile_n]` fp32 output tile.

  `accumulate(acc_ref, a_gmem, b_gmem, rows, cols, *scratch_refs)` fills the
  tile's wgmma accumulator; the tile then leaves through shared memory by TMA.
  """
  m, n = out_shape

  def kernel(a_gmem, b_gmem, o_gmem, o_smem, *scratch_refs):
    rows = pl.ds(lax.axis_index("m") * tile_m, tile_m)
    cols = pl.ds(lax.axis_index("n") * tile_n, tile_n)

    def product(acc_ref):
      accumulate(acc_ref, a_gmem, b_gmem, rows, cols, *scratch_refs)
      return acc_ref[...]

    o_smem[...] = pl.run_scoped(product, plgpu.ACC((tile_m, tile_n), jnp.float32))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows, cols])
    plgpu.wait_smem_to_gmem(0)

  return plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((m, n), jnp.float32),
      scratch_types=[plgpu.SMEM((tile_m, tile_n), jnp.float32, transforms=_k_major_tiles()),
                     *scratch_types],
      grid=(m // tile_m, n // tile_n), grid_names=("m", "n"))(a, b)


def k_major_matmul(a, b, *, tile_m, tile_n, stages):
  """`a @ b.T` for fp32 `a [M, K]`, `b [N, K]` (M, N, K multiples of the tiles) on wgmma."""
  (m, k), (n, _) = a.shape, b.shape
  transforms = _k_major_tiles()

  def accumulate(acc_ref, a_gmem, b_gmem, rows, cols):
    def step(_, a_smem, b_smem):
      plgpu.wgmma(acc_ref, a_smem, b_smem.transpose((1, 0)))
      plgpu.wgmma_wait(1)

    plgpu.emit_pipeline(
        step, grid=(k // TILE_K,), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((tile_m, TILE_K), lambda s: (0, s), transforms=transforms,
                                  delay_release=1),
                  plgpu.BlockSpec((tile_n, TILE_K), lambda s: (0, s), transforms=transforms,
                                  delay_release=1)],
    )(a_gmem.at[rows], b_gmem.at[cols])

  return _one_tile_per_block(a, b, (m, n), tile_m=tile_m, tile_n=tile_n, accumulate=accumulate)


def persistent_k_major_matmul(a, b, *, tile_m, tile_n, stages, split_k=1, num_sms=132,
                              chained=False):
  """`a @ b.T` as above, by a persistent, warp-specialized kernel (split-K summed by XLA).

  One memory warpgroup streams `[tile_m, 32]` and `[2 * tile_n, 32]` tiles with
  TMA; two compute warpgroups each own half of the `tile_m x 2 * tile_n` output
  tile. Each of `num_sms` blocks walks the (split, m, n) tiles in turn.
  `chained`: the per-tile pipelines of a block form one pipeline (Pallas's
  `PipelinePipeline` states), so the memory warpgroup loads the next tile's
  first steps while the compute warpgroups finish this one; every block then
  needs at least two tiles.
  """
  (m, k), (n, _) = a.shape, b.shape
  transforms = _k_major_tiles()
  block_n = 2 * tile_n
  m_iters, n_iters, k_per_split = m // tile_m, n // block_n, k // split_k
  k_iters = k_per_split // TILE_K
  if chained:
    num_sms = min(num_sms, split_k * m_iters * n_iters // 2)

  def kernel(a_gmem, b_gmem, o_gmem):
    def pipeline(body, compute_context, state=None):
      return plgpu.emit_pipeline_warp_specialized(
          body, grid=(k_iters,), memory_registers=40, max_concurrent_steps=stages,
          in_specs=[plgpu.BlockSpec((tile_m, TILE_K), lambda s: (0, s), transforms=transforms),
                    plgpu.BlockSpec((block_n, TILE_K), lambda s: (0, s), transforms=transforms)],
          wg_axis="wg", num_compute_wgs=2, compute_context=compute_context,
          pipeline_state=state)

    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        allocations=pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
        o_smem=plgpu.SMEM((2, tile_m, tile_n), jnp.float32, transforms=transforms),
        collective_axes="wg")
    def _(allocations, o_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((split_k * m_iters * n_iters,), collective_axes="sm")
      def _(info):
        (index,) = info.index
        split, rest = index // (m_iters * n_iters), index % (m_iters * n_iters)
        mi, ni = rest % m_iters, rest // m_iters
        contraction = pl.ds(split * k_per_split, k_per_split)

        def compute_context(run_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
          def _(acc_ref):
            run_pipeline(acc_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            o_smem[wg] = acc_ref[...]
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem.at[wg], o_gmem.at[pl.ds(split * m + mi * tile_m, tile_m),
                                         pl.ds(ni * block_n + wg * tile_n, tile_n)])

        def step(_, a_smem, b_smem, acc_ref):
          b_half = b_smem.at[pl.ds(wg * tile_n, tile_n)]
          plgpu.wgmma(acc_ref, a_smem, b_half.transpose((1, 0)))
          plgpu.wgmma_wait(0)
          return acc_ref

        state = None
        if chained:
          last = info.local_index == info.num_local_steps - 1
          state = jnp.where(info.local_index == 0, int(plgpu.PipelinePipeline.START),
                            jnp.where(last, int(plgpu.PipelinePipeline.STOP),
                                      int(plgpu.PipelinePipeline.STEADY)))
        pipeline(step, compute_context, state)(
            a_gmem.at[pl.ds(mi * tile_m, tile_m), contraction],
            b_gmem.at[pl.ds(ni * block_n, block_n), contraction], allocations=allocations)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  partials = plgpu.kernel(
      kernel, out_type=jax.ShapeDtypeStruct((split_k * m, n), jnp.float32),
      grid=(num_sms,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup))(a, b)
  return partials.reshape(split_k, m, n).sum(axis=0) if split_k > 1 else partials


def transposing_matmul(a, b, *, tile_m, tile_n, stages):
  """`a @ b` for fp32 `a [M, K]` and an N-major `b [K, N]` (the weights' layout) on wgmma.

  fp32 wgmma reads K-major operands only, and TMA cannot transpose, so each
  `[64, tile_n]` tile of `b` goes TMA -> shared memory -> registers (WGMMA
  layout, then WGMMA_TRANSPOSED: one shuffle per register pair) -> a K-major
  shared buffer that wgmma reads. No transposed copy of `b` in HBM.
  """
  (m, k), (_, n) = a.shape, b.shape
  tile_k = 64   # the rows of a WGMMA-layout tile

  def accumulate(acc_ref, a_gmem, b_gmem, rows, cols, b_k_major):
    def step(_, a_smem, b_smem):
      tile = mosaic_gpu.load_wgmma(b_smem)
      tile = plgpu.layout_cast(tile, plgpu.Layout.WGMMA_TRANSPOSED)
      b_k_major.transpose((1, 0))[...] = tile
      plgpu.commit_smem()
      plgpu.wgmma(acc_ref, a_smem, b_k_major.transpose((1, 0)))
      plgpu.wgmma_wait(0)

    plgpu.emit_pipeline(
        step, grid=(k // tile_k,), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda s: (0, s), transforms=_k_major_tiles()),
                  plgpu.BlockSpec((tile_k, tile_n), lambda s: (s, 0), transforms=_k_major_tiles())],
    )(a_gmem.at[rows], b_gmem.at[:, cols])

  return _one_tile_per_block(
      a, b, (m, n), tile_m=tile_m, tile_n=tile_n, accumulate=accumulate,
      scratch_types=[plgpu.SMEM((tile_n, tile_k), jnp.float32, transforms=_k_major_tiles())])


def _run_and_error(fn, operands, exact, context):
  """`fn(*operands)` and its relative error against `exact`, or None (reported) where it fails."""
  try:
    out = fn(*operands)
  except Exception as e:  # noqa: BLE001 - shared memory limits, lowering gaps
    print(f"  {context}: {type(e).__name__}: {(str(e).splitlines() or [repr(e)])[0][:200]}",
          flush=True)
    return None
  return float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))


def _f16_tiles():
  """Shared-memory layout of an f16 `[rows, 64]` tile (one 128-byte swizzled row)."""
  return (plgpu.TilingTransform((8, SWIZZLE // 2)), plgpu.SwizzleTransform(SWIZZLE))


def converting_matmul(a, b, *, tile_m, tile_n, stages, double_buffer):
  """`a @ b` for an f16 `a [M, K]` and an fp32 `b [K, N]` as the weights are stored, on f16 wgmma.

  F16_F16_F32's pre-activation product without an f16 copy of the weight: each
  `[64, tile_n]` tile of `b` goes TMA -> shared memory -> registers, is rounded
  to f16 and stored into an f16 buffer that wgmma reads. With one buffer each
  step waits for its wgmma, as Triton's loop does (benchmarks/NOTES.md, 22);
  `double_buffer` converts the next tile while this one's wgmma runs.
  """
  (m, k), (_, n) = a.shape, b.shape
  tile_k = 64
  buffers = 2 if double_buffer else 1

  def accumulate(acc_ref, a_gmem, b_gmem, rows, cols, b16):
    def step(indices, a_smem, b_smem):
      slot = indices[0] % buffers
      tile = mosaic_gpu.load_wgmma(b_smem)
      b16.at[slot][...] = tile.astype(jnp.float16)
      plgpu.commit_smem()
      plgpu.wgmma(acc_ref, a_smem, b16.at[slot])
      plgpu.wgmma_wait(buffers - 1)

    plgpu.emit_pipeline(
        step, grid=(k // tile_k,), max_concurrent_steps=stages,
        in_specs=[plgpu.BlockSpec((tile_m, tile_k), lambda s: (0, s), transforms=_f16_tiles(),
                                  delay_release=1),
                  plgpu.BlockSpec((tile_k, tile_n), lambda s: (s, 0),
                                  transforms=_k_major_tiles())],
    )(a_gmem.at[rows], b_gmem.at[:, cols])
    plgpu.wgmma_wait(0)

  return _one_tile_per_block(
      a, b, (m, n), tile_m=tile_m, tile_n=tile_n, accumulate=accumulate,
      scratch_types=[plgpu.SMEM((buffers, tile_k, tile_n), jnp.float16,
                                transforms=_f16_tiles())])


def converting_probe(seq_lens, h, i):
  """The pre-activation product in F16 (f16 `grad_output`, fp32 `fc2_weight [H, I]`):
  `converting_matmul` with one or two f16 buffers beside the Triton kernel's loop."""
  from vision_mlp_bwd.backends.triton.config import TileConfig
  from vision_mlp_bwd.backends.triton.kernels import tiled_matmul
  from vision_mlp_bwd.precision import DotMode
  rows = []
  for s in seq_lens:
    a = jax.random.normal(jax.random.key(1), (s, h)).astype(jnp.float16)
    b = jax.random.normal(jax.random.key(2), (h, i)) / 30
    exact = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float16).astype(jnp.float32),
                    precision=lax.Precision.HIGHEST)
    runs = [(f"triton 128x64x64 w{w}", functools.partial(
        tiled_matmul, tile=TileConfig(128, 64, 64, num_warps=w), mode=DotMode.F16,
        out_dtype=jnp.float32)) for w in (4, 8)]
    for tile_m, tile_n, stages, double in itertools.product((64, 128), (64, 128), (2, 4),
                                                           (False, True)):
      smem = (stages * 64 * (2 * tile_m + 4 * tile_n) + (1 + double) * 64 * tile_n * 2
              + 4 * tile_m * tile_n)
      if s % tile_m == 0 and smem <= SMEM_BYTES:
        runs.append((f"mosaic {tile_m}x{tile_n} st{stages} {'two' if double else 'one'} buffer",
                     functools.partial(converting_matmul, tile_m=tile_m, tile_n=tile_n,
                                       stages=stages, double_buffer=double)))
    for label, kernel in runs:
      fn = jax.jit(kernel)
      error = _run_and_error(fn, (a, b), exact, f"S={s} {label}")
      if error is None:
        continue
      us = device_times_us(fn, a, b).median_us
      rows.append(dict(name="pre_f16", s=s, kernel=label, us=us, error=error))
      print(f"S={s:4d} pre-activation F16 {label:34s} {us:6.1f} us  error {error:.1e}",
            flush=True)
  return rows


def launch_1_probe(seq_lens, h, i, variants):
  """The package's Mosaic GPU launch 1 (`mosaic_gpu.launch_1`, F16) per variant and S.

  A variant is `(gelu form, approx_math, pre_tile, stages, weight_grad_stages)`
  (`benchmarks/gelu_forms.py` names the forms). The figures in
  results/probes/mosaic/mosaic_probe_launch1*_h200.json came from its prototype (commits
  6a3ebfd, 9bd6650), which took the GELU derivative precomputed; compare with
  the Triton launch 1 that `tune --variants default` reports as
  mlp_backward_1."""
  from benchmarks import gelu_forms
  from vision_mlp_bwd.reference import gelu_tanh_grad
  rows = []
  for s in seq_lens:
    keys = jax.random.split(jax.random.key(s), 4)
    pad = [(0, mosaic_gpu.padded_rows(s) - s), (0, 0)]
    g16 = jnp.pad(jax.random.normal(keys[0], (s, h)).astype(jnp.float16), pad)
    w2 = jax.random.normal(keys[1], (h, i)) / 36
    x = jax.random.normal(keys[2], (s, i))
    gelu16 = jnp.pad(jax.random.normal(keys[3], (s, i)).astype(jnp.float16), pad)
    f32 = lambda v: v.astype(jnp.float32)
    exact_pre = jnp.dot(f32(g16), f32(w2.astype(jnp.float16)),
                        precision=lax.Precision.HIGHEST)[:s] * gelu_tanh_grad(x)
    exact_wg = jnp.dot(f32(g16).T, f32(gelu16), precision=lax.Precision.HIGHEST)
    for form, approx_math, pre_tile, stages, weight_grad_stages in variants:
      gelu_forms.use(form)
      default_tile, default_stages = mosaic_gpu.pre_tiling(s)
      pre_tile, stages = pre_tile or default_tile, stages or default_stages
      label = (f"{form}{'' if approx_math else ' exact'} pre {pre_tile} st{stages}, "
               f"weight grad st{weight_grad_stages}")
      fn = jax.jit(functools.partial(mosaic_gpu.launch_1, stages=stages,
                                     weight_grad_stages=weight_grad_stages,
                                     pre_tile=pre_tile, approx_math=approx_math))
      try:
        pre, wg = fn(g16, w2, x, gelu16)
        errors = [float(jnp.linalg.norm(f32(out) - exact) / jnp.linalg.norm(exact))
                  for out, exact in ((pre, exact_pre), (wg, exact_wg))]
        max_error = float(jnp.max(jnp.abs(f32(pre) - exact_pre)))
      except Exception as e:  # noqa: BLE001 - e.g. shared memory: report, go on
        print(f"  S={s} {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
              flush=True)
        continue
      us = device_times_us(fn, g16, w2, x, gelu16).median_us
      rows.append(dict(name="f16_launch_1", s=s, kernel=label, us=us, errors=errors,
                       pre_max_error=max_error))
      print(f"S={s:4d} {label:60s} {us:6.1f} us  errors {errors[0]:.2e} {errors[1]:.1e} "
            f"max {max_error:.2e}", flush=True)
  gelu_forms.use(None)
  return rows


def launch_2_prototype(grad_pre16, fc1_weight, hidden16, *, split_k, tile=(256, 64, 64),
                       stages=3, weight_grad_stages=4):
  """Launch 2 as one Mosaic GPU grid, without its bias sums: `(partials, grad_fc1_weight)`.

  The input gradient `grad_pre16 @ fc1_weight` comes as `split_k` partial sums over
  I, `[split_k * rows, H]` fp32 (rows: S rounded up to `tile`'s), each block one
  tile of one split with `mosaic_gpu`'s converting pipeline; the caller sums
  them. The other blocks each compute one `[128, 128]` tile of
  `grad_fc1_weight = grad_pre16.T @ hidden16` as launch 1 does grad_fc2_weight.
  What it measures: whether a Mosaic launch 2 beats Triton's (25 us at F16
  S=211, benchmarks/NOTES.md 24) before a deterministic in-kernel split sum is
  built for it."""
  (rows_in, i), h = grad_pre16.shape, fc1_weight.shape[1]
  dtype = grad_pre16.dtype
  pm, pn, pk = tile
  gm, gn = pl.cdiv(rows_in, pm), h // pn
  k_len = i // split_k
  assert k_len * split_k == i and k_len % pk == 0, (i, split_k, pk)
  n_input = gm * gn * split_k
  wm, wn, _ = mosaic_gpu.WEIGHT_GRAD_TILE

  def kernel(x_gmem, w_gmem, z_gmem, partial_gmem, weight_grad_gmem):
    block = lax.axis_index("block")

    @pl.when(block < n_input)
    def _():
      split, r, c = block // (gm * gn), block % gm, (block // gm) % gn
      ks, cols = pl.ds(split * k_len, k_len), pl.ds(c * pn, pn)

      def tile_(acc_ref, b16):
        mosaic_gpu.converted_weight_product(acc_ref, b16, x_gmem.at[pl.ds(r * pm, pm), ks],
                                             w_gmem.at[ks, cols], stages)
        mosaic_gpu.write_tile(acc_ref[...],
                              partial_gmem.at[pl.ds((split * gm + r) * pm, pm), cols])

      pl.run_scoped(tile_, plgpu.ACC((pm, pn), jnp.float32),
                    plgpu.SMEM((2, pk, pn), dtype, transforms=mosaic_gpu.swizzled_tiles(dtype)))

    @pl.when(block >= n_input)
    def _():
      job = block - n_input
      rows, cols = pl.ds((job % (i // wm)) * wm, wm), pl.ds((job // (i // wm)) * wn, wn)
      mosaic_gpu.weight_grad_tile(x_gmem.at[:, rows], z_gmem.at[:, cols],
                                   weight_grad_gmem.at[rows, cols], weight_grad_stages)

  return plgpu.kernel(
      kernel, out_type=(jax.ShapeDtypeStruct((split_k * gm * pm, h), jnp.float32),
                        jax.ShapeDtypeStruct((i, h), jnp.float32)),
      grid=(n_input + (i // wm) * (h // wn),), grid_names=("block",),
  )(grad_pre16, fc1_weight, hidden16)


def launch_2_probe(seq_lens, h, i, variants):
  """`launch_2_prototype` (F16) per `(split_k, tile rows)` and S: the kernel alone, and with
  the XLA sum of its partials."""
  rows = []
  for s in seq_lens:
    keys = jax.random.split(jax.random.key(s), 3)
    pad = [(0, mosaic_gpu.padded_rows(s) - s), (0, 0)]
    pre16 = jnp.pad((jax.random.normal(keys[0], (s, i)) / 4).astype(jnp.float16), pad)
    w1 = jax.random.normal(keys[1], (i, h)) / 60
    x16 = jnp.pad(jax.random.normal(keys[2], (s, h)).astype(jnp.float16), pad)
    f32 = lambda v: v.astype(jnp.float32)
    exact_in = jnp.dot(f32(pre16), f32(w1.astype(jnp.float16)),
                       precision=lax.Precision.HIGHEST)[:s]
    exact_wg = jnp.dot(f32(pre16).T, f32(x16), precision=lax.Precision.HIGHEST)
    for split_k, tile_rows in variants:
      label = f"split {split_k}, {tile_rows}x64 input-gradient tiles"
      kernel = jax.jit(functools.partial(launch_2_prototype, split_k=split_k,
                                         tile=(tile_rows, 64, 64),
                                         stages=3 if tile_rows == 256 else 4))

      def summed(a, b, c, kernel=kernel, split_k=split_k):
        partials, wg = kernel(a, b, c)
        return partials.reshape(split_k, -1, h)[:, :s].sum(0), wg

      try:
        grad_in, wg = jax.jit(summed)(pre16, w1, x16)
        errors = [float(jnp.linalg.norm(out - exact) / jnp.linalg.norm(exact))
                  for out, exact in ((grad_in, exact_in), (wg, exact_wg))]
      except Exception as e:  # noqa: BLE001 - e.g. shared memory: report, go on
        print(f"  S={s} {label}: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}",
              flush=True)
        continue
      alone = device_times_us(kernel, pre16, w1, x16).median_us
      total = device_times_us(jax.jit(summed), pre16, w1, x16).median_us
      rows.append(dict(name="f16_launch_2", s=s, kernel=label, us=alone, with_sum_us=total,
                       errors=errors))
      print(f"S={s:4d} {label:40s} {alone:6.1f} us, with the XLA sum {total:6.1f} us  "
            f"errors {errors[0]:.1e} {errors[1]:.1e}", flush=True)
  return rows


def _launch_1_variants(text):
  """`form[:exact][:MxNxK[:stages[:weight_grad_stages]]]`, e.g. `tanh:exact:256x64x64:3:4`.

  `exact` turns `approx_math` off; a missing tile or depth is `launch_1`'s
  default (`mosaic_gpu.pre_tiling`)."""
  parts = text.split(":")
  approx = "exact" not in parts
  form, *rest = [p for p in parts if p != "exact"]
  tile, stages, weight_grad_stages = (rest + [None, None, "4"][len(rest):])[:3]
  return (form, approx, tile and tuple(int(d) for d in tile.split("x")),
          stages and int(stages), int(weight_grad_stages))


def products(s, h, i):
  """The backward's four products as (name, M, N, K), all operands K-major."""
  return [("pre", s, i, h), ("input_grad", s, h, i), ("fc2_weight_grad", h, i, s),
          ("fc1_weight_grad", i, h, s)]


def candidates(kernel_name, m, n, k):
  """(label, function of (a, b)) for each tile setting of `kernel_name` worth timing."""
  out = []
  if kernel_name == "plain":
    for tile_m, tile_n, stages in itertools.product((64, 128), (64, 128, 256), (2, 4)):
      if m % tile_m == 0 and n % tile_n == 0:
        out.append((f"{tile_m}x{tile_n} st{stages}", functools.partial(
            k_major_matmul, tile_m=tile_m, tile_n=tile_n, stages=stages)))
    return out
  if kernel_name == "transposing":
    for tile_m, tile_n, stages in itertools.product((64, 128), (64, 128), (2, 3, 4)):
      smem = 4 * (stages * 64 * (tile_m + tile_n) + tile_n * 64 + tile_m * tile_n)
      if m % tile_m == 0 and n % tile_n == 0 and k % 64 == 0 and smem <= SMEM_BYTES:
        out.append((f"{tile_m}x{tile_n} st{stages}", functools.partial(
            transposing_matmul, tile_m=tile_m, tile_n=tile_n, stages=stages)))
    return out
  chained = kernel_name == "chained"
  splits = (1, 2, 4) if k >= 1024 else (1,)
  for tile_m, tile_n, stages, split in itertools.product(
      (64, 128), (64, 128), (2, 4, 8) if chained else (3, 4, 6), splits):
    smem = 4 * (stages * TILE_K * (tile_m + 2 * tile_n) + 2 * tile_m * tile_n)
    steps = k // (split * TILE_K)
    if (m % tile_m == 0 and n % (2 * tile_n) == 0 and k % (split * TILE_K) == 0
        and smem <= SMEM_BYTES and (not chained or (steps % stages == 0 and (
            split * (m // tile_m) * (n // (2 * tile_n)) >= 2)))):
      out.append((f"{tile_m}x2x{tile_n} st{stages} split{split}", functools.partial(
          persistent_k_major_matmul, tile_m=tile_m, tile_n=tile_n, stages=stages,
          split_k=split, num_sms=getattr(jax.devices()[0], "core_count", 132),
          chained=chained)))
  return out


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 256])
  parser.add_argument("--kernels", nargs="+", default=["plain", "persistent"],
                      choices=["plain", "persistent", "chained", "transposing", "converting",
                               "launch1", "launch2"])
  parser.add_argument("--launch1-variants", type=_launch_1_variants, nargs="+",
                      default=[_launch_1_variants("no_cancellation")],
                      help="form[:exact]:MxNxK:stages:weight_grad_stages, for --kernels launch1")
  parser.add_argument("--launch2-variants", nargs="+", default=["4:256"],
                      help="split_k:tile_rows, for --kernels launch2")
  parser.add_argument("--out", default=os.environ.get("RESULTS_DIR", "."))
  args = parser.parse_args()
  h, i = 1280, 3584
  rows = []
  if args.kernels in (["converting"], ["launch1"], ["launch2"]):
    launch_2_variants = [tuple(map(int, v.split(":"))) for v in args.launch2_variants]
    rows = {"converting": lambda: converting_probe(args.seq_lens, h, i),
            "launch1": lambda: launch_1_probe(args.seq_lens, h, i, args.launch1_variants),
            "launch2": lambda: launch_2_probe(args.seq_lens, h, i, launch_2_variants),
            }[args.kernels[0]]()
    with open(os.path.join(args.out, f"mosaic_probe_{args.kernels[0]}.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
                indent=1)
    return
  w = jax.random.normal(jax.random.key(0), (h, i))
  t = device_times_us(jax.jit(lambda x: x.T), w)
  print(f"XLA transpose of a [{h}, {i}] weight: {t.median_us:.1f} us", flush=True)
  rows.append(dict(name="xla_transpose_weight", us=t.median_us))
  for s in args.seq_lens:
    for name, m, n, k in products(s, h, i):
      a = jax.random.normal(jax.random.key(1), (m, k))
      b = jax.random.normal(jax.random.key(2), (n, k)) / 30
      exact = lax.dot_general(a, b, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
      xla = jax.jit(lambda a, b: lax.dot_general(a, b, (((1,), (1,)), ((), ()))))
      flops = 2 * m * n * k
      x = device_times_us(xla, a, b).median_us
      rows.append(dict(name=name, s=s, xla_us=x))
      for kernel_name in args.kernels:
        best = (float("inf"), None)
        # The transposing kernel takes B as the weights are stored, [K, N].
        operands = (a, b.T) if kernel_name == "transposing" else (a, b)
        for label, kernel in candidates(kernel_name, m, n, k):
          fn = jax.jit(kernel)
          error = _run_and_error(fn, operands, exact, f"{name} S={s} {kernel_name} {label}")
          if error is None:
            continue
          us = device_times_us(fn, *operands).median_us
          rows.append(dict(name=name, s=s, kernel=kernel_name, config=label, us=us,
                           error=error))
          best = min(best, (us, label, error))
        print(f"S={s:4d} {name:16s} M={m} N={n} K={k}: {kernel_name} {best[0]:6.1f} us "
              f"({flops / best[0] / 1e6:5.0f} TFLOP/s, {best[1:]}), XLA TF32 {x:6.1f} us",
              flush=True)
  with open(os.path.join(args.out, "mosaic_probe.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f,
              indent=1)


if __name__ == "__main__":
  main()
