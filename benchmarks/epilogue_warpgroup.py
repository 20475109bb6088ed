"""`python -m benchmarks.epilogue_warpgroup`: the fused pre-GELU product with its epilogue
on a warpgroup of its own (a probe, not the engine).

The engine's fused product (`engine.matmul(epilogue=...)`) runs its epilogue on the
two compute warpgroups after each block's MMAs, so the tensor cores idle through it
(about a third of the compute warps' time at S=4096: benchmarks/NOTES.md, 47a), and
overlapping it inside one Pallas pipeline per program lost (48d). This kernel splits
the work across four warpgroups with explicit barriers instead:
- a memory warpgroup streams A and B tiles by TMA into a ring of `stages` buffers,
  across block boundaries;
- two MMA warpgroups each accumulate 64 rows of a 128 x 128 block with wgmma, hand
  the accumulator to shared memory (`handoff`, fp32) and go straight on to the next
  block's steps;
- an epilogue warpgroup reads the handoff in 64 x 64 pieces beside `fc1_output`'s
  (TMA, double-buffered), computes `reference.gelu_backward`, rounds to f16 and stores
  by TMA, then frees the handoff for the next block.
So the epilogue of block i runs while the MMAs of block i + 1 do, as long as it is
shorter. Registers move from the memory and MMA warpgroups to the epilogue one.

    python -m benchmarks.epilogue_warpgroup --seq-lens 1024 4096 --out DIR

times it against the engine's fused product (the fp32_inputs table's config, no copy
programs, no bias sums: `epilogue_costs`' "f16: + GELU derivative" step) and against the
engine's plain product, with CUPTI and a cold L2, and reports the largest difference
between the two fused outputs. M a multiple of 8 (TMA's tiled rows); N and K of
whole 64-element tiles.
"""

from __future__ import annotations

import argparse
import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from vision_mlp_bwd import reference
from vision_mlp_bwd.backends.mosaic import engine
from vision_mlp_bwd.backends.mosaic.tiles import swizzled_tiles
from vision_mlp_bwd.backends.shared import sum_in_order

BLOCK_M, BLOCK_N, TILE_K = 128, 128, 64
PIECE = 64            # the epilogue's pieces: PIECE x PIECE
MMA_ROWS = BLOCK_M // 2
# Registers per thread after the split (the launch gives 65536 / 512 = 128 to each).
MEMORY_REGISTERS, MMA_REGISTERS, EPILOGUE_REGISTERS = 40, 120, 232


def fused_product(a, b, x, *, stages: int = 3, column_sums: bool = False,
                  num_programs: int | None = None, approx_math: bool = True, interpret=None):
  """f16(gelu_backward(a @ b, x)): a [M, K], b [K, N] f16; x [M, N] fp32. With
  `column_sums`, also the fp32 sums of its columns (of the unrounded values), `(out, sums)`."""
  (m, k), n = a.shape, b.shape[1]
  if b.shape[0] != k or x.shape != (m, n) or m % 8 or n % PIECE or k % TILE_K:
    raise ValueError(f"fused_product: a {a.shape}, b {b.shape}, x {x.shape}")
  programs = num_programs or engine.num_sms()
  grid_n = pl.cdiv(n, BLOCK_N)
  blocks = pl.cdiv(m, BLOCK_M) * grid_n
  k_steps = k // TILE_K

  def kernel(a_gmem, b_gmem, x_gmem, out_gmem, sums_gmem=None):
    program = lax.axis_index("program")
    here = engine._count_here(blocks, program, programs)

    def block_origin(local):
      bm, bn = divmod(program + local * programs, grid_n)
      return bm * BLOCK_M, bn * BLOCK_N

    @functools.partial(
        pl.run_scoped,
        a_smem=plgpu.SMEM((stages, BLOCK_M, TILE_K), a.dtype, transforms=swizzled_tiles(a.dtype)),
        b_smem=plgpu.SMEM((stages, TILE_K, BLOCK_N), b.dtype, transforms=swizzled_tiles(b.dtype)),
        handoff=plgpu.SMEM((2, MMA_ROWS, BLOCK_N), jnp.float32,
                           transforms=swizzled_tiles(jnp.float32)),
        x_smem=plgpu.SMEM((2, PIECE, PIECE), jnp.float32, transforms=swizzled_tiles(jnp.float32)),
        out_smem=plgpu.SMEM((2, PIECE, PIECE), jnp.float16,
                            transforms=swizzled_tiles(jnp.float16)),
        a_full=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        b_full=plgpu.Barrier(num_arrivals=1, num_barriers=stages),
        consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages),
        x_full=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        handoff_full=plgpu.Barrier(num_arrivals=2, num_barriers=1),
        handoff_free=plgpu.Barrier(num_arrivals=1, num_barriers=1),
        sums_smem=plgpu.SMEM((BLOCK_N // PIECE, PIECE), jnp.float32),
        collective_axes="wg")
    def _scope(a_smem, b_smem, handoff, x_smem, out_smem, a_full, b_full, consumed, x_full,
               handoff_full, handoff_free, sums_smem):
      wg = lax.axis_index("wg")

      @pl.when(wg == 3)
      def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        @pl.loop(0, here * k_steps)
        def _step(g):
          local, kk = divmod(g, k_steps)
          row0, col0 = block_origin(local)
          slot = lax.rem(g, stages)

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(row0, BLOCK_M), pl.ds(kk * TILE_K, TILE_K)],
                                  a_smem.at[slot], a_full.at[slot])
          plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(kk * TILE_K, TILE_K), pl.ds(col0, BLOCK_N)],
                                  b_smem.at[slot], b_full.at[slot])

        @pl.loop(jnp.maximum(here * k_steps - stages, 0), here * k_steps)
        def _drain(g):   # every barrier phase is waited on (the interpreter checks it)
          plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

      @pl.when(wg < 2)
      def _mma():
        plgpu.set_max_registers(MMA_REGISTERS, action="decrease")
        rows = pl.ds(wg * MMA_ROWS, MMA_ROWS)

        @pl.loop(0, here)
        def _block(local):
          def accumulate(acc_ref):
            def step(kk, carry):
              slot = lax.rem(local * k_steps + kk, stages)
              plgpu.barrier_wait(a_full.at[slot])
              plgpu.barrier_wait(b_full.at[slot])
              plgpu.wgmma(acc_ref, a_smem.at[slot].at[rows], b_smem.at[slot])
              plgpu.wgmma_wait(1)   # the previous step's MMAs are done: free its stage

              @pl.when(kk > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(local * k_steps + kk - 1, stages)])
              return carry
            lax.fori_loop(0, k_steps, step, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[lax.rem(local * k_steps + k_steps - 1, stages)])
            return acc_ref[...]
          acc = pl.run_scoped(accumulate, plgpu.ACC((MMA_ROWS, BLOCK_N), jnp.float32))

          @pl.when(local > 0)
          def _():
            plgpu.barrier_wait(handoff_free)
          handoff[wg] = acc
          plgpu.commit_smem()   # (and a warpgroup barrier: every thread's stores before the arrival)
          plgpu.barrier_arrive(handoff_full)

        @pl.when(here > 0)
        def _():
          plgpu.barrier_wait(handoff_free)   # the last block's

      @pl.when(wg == 2)
      def _epilogue():
        plgpu.set_max_registers(EPILOGUE_REGISTERS, action="increase")
        # A block's pieces, column piece by column piece, each over the two MMA halves
        # (so a column piece's sums are complete after two pieces).
        pieces = [(c, half) for c in range(BLOCK_N // PIECE) for half in range(2)]

        def load_x(j):   # the j-th piece of this program, j in [0, here * len(pieces))
          local, p = divmod(j, len(pieces))
          row0, col0 = block_origin(local)
          c = lax.div(p, 2)
          half = p - 2 * c
          plgpu.copy_gmem_to_smem(
              x_gmem.at[pl.ds(row0 + half * MMA_ROWS, PIECE), pl.ds(col0 + c * PIECE, PIECE)],
              x_smem.at[lax.rem(j, 2)], x_full.at[lax.rem(j, 2)])

        total = here * len(pieces)
        for j in range(2):
          pl.when(j < total)(functools.partial(load_x, j))

        @pl.loop(0, here)
        def _block(local):
          row0, col0 = block_origin(local)
          plgpu.barrier_wait(handoff_full)
          sums = None
          for p, (c, half) in enumerate(pieces):
            j = local * len(pieces) + p
            slot = p % 2
            plgpu.barrier_wait(x_full.at[slot])
            acc = handoff[half, :, pl.ds(c * PIECE, PIECE)]
            value = reference.gelu_backward(acc, x_smem[slot])
            plgpu.wait_smem_to_gmem(1, wait_read_only=True)
            out_smem[slot] = value.astype(jnp.float16)
            if column_sums:
              piece_sums = jnp.sum(value, axis=0)
              sums = piece_sums if half == 0 else sums + piece_sums
            plgpu.commit_smem()   # every thread has read this piece's handoff and x tile
            plgpu.copy_smem_to_gmem(
                out_smem.at[slot],
                out_gmem.at[pl.ds(row0 + half * MMA_ROWS, PIECE), pl.ds(col0 + c * PIECE, PIECE)])
            pl.when(j + 2 < total)(functools.partial(load_x, j + 2))
            if p == len(pieces) - 1:
              plgpu.barrier_arrive(handoff_free)
            if column_sums and half == 1:
              sums_smem[c] = sums
              plgpu.commit_smem()
              plgpu.copy_smem_to_gmem(
                  sums_smem.at[c], sums_gmem.at[lax.div(row0, BLOCK_M), pl.ds(col0 + c * PIECE, PIECE)])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the sums rows, before reuse
        plgpu.wait_smem_to_gmem(0)

  out_type = [jax.ShapeDtypeStruct((m, n), jnp.float16)]
  if column_sums:
    out_type.append(jax.ShapeDtypeStruct((pl.cdiv(m, BLOCK_M), n), jnp.float32))
  outs = plgpu.kernel(
      kernel, out_type=tuple(out_type),
      grid=(programs,), grid_names=("program",), num_threads=4, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=approx_math),
      **({} if interpret is None else dict(interpret=interpret)),
  )(a, b, x)
  return (outs[0], sum_in_order(outs[1])) if column_sums else outs[0]

def main(argv=None):
  from benchmarks import cases, timing
  from benchmarks.epilogue_costs import step_fn
  from benchmarks.run import write_result_json
  parser = argparse.ArgumentParser(prog="python -m benchmarks.epilogue_warpgroup",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--stages", type=int, nargs="+", default=[3])
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--out", default=os.path.join("benchmarks", "results", "probes", "engine"))
  args = parser.parse_args(argv)
  rows = []
  for tokens in args.seq_lens:
    grad_output, _, _, _, fc2_weight, _, fc1_output, _ = cases.make_inputs(
        jax.random.key(tokens), tokens, cases.HIDDEN, cases.INTERMEDIATE)
    a, b = grad_output.astype(jnp.float16), fc2_weight.astype(jnp.float16)
    engine_steps = {"engine, plain product": "f16: plain product",
                    "engine, fused": "f16: + GELU derivative",
                    "engine, fused with bias sums": "f16: + bias sums (the table's product)"}
    fns = {name: (lambda a, b, x, fn=step_fn(step, tokens): fn(a, b, x, None, None))
           for name, step in engine_steps.items()}
    for stages in args.stages:
      for sums in (False, True):
        fns[f"epilogue warpgroup, {stages} stages{', with bias sums' if sums else ''}"] = (
            jax.jit(functools.partial(fused_product, stages=stages, column_sums=sums)))
    row = dict(seq_len=tokens)
    exact = reference.gelu_backward(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                            precision="highest"), fc1_output)
    exact_sums = jnp.sum(exact, axis=0)
    for name, fn in fns.items():
      row[name] = timing.device_times_us(fn, a, b, fc1_output, warmup=5,
                                         iterations=args.iterations).median_us
      if name == "engine, plain product":
        continue
      out = fn(a, b, fc1_output)
      out, sums = out if isinstance(out, tuple) else (out, None)
      row[name + ": max |out - fp32 HIGHEST|"] = float(jnp.max(jnp.abs(
          out.astype(jnp.float32) - exact)))
      if sums is not None:
        row[name + ": max |sums - fp32 HIGHEST| / max |sums|"] = float(
            jnp.max(jnp.abs(sums - exact_sums)) / jnp.max(jnp.abs(exact_sums)))
    print(row, flush=True)
    rows.append(row)
  write_result_json(args.out, "epilogue_warpgroup", rows=rows)


if __name__ == "__main__":
  main()
