"""`python -m benchmarks.pingpong`: ping-pong compute warpgroups over one shared ring (a
probe, not the engine).

The engine runs each output block on both compute warpgroups at once (each a half), so
the tensor cores idle through every block's epilogue: about a third of the fused pre-GELU
product's time at S=4096 (benchmarks/NOTES.md, 41c, 47a). Section 41's ping-pong tries gave
each compute warpgroup a ring of its own (fed by one memory warpgroup in tile order, or
loaded by the warpgroup itself), which left each ring 2-3 stages deep, and the fused
product's whole fp32 operand tile took the rest of shared memory. Here, as in CUTLASS's
ping-pong kernels:
- one memory warpgroup streams the program's blocks in order through ONE ring of `stages`
  buffers (block j's steps, then block j + 1's), and block j belongs to compute warpgroup
  j mod 2, which owns the whole 128 x `block_n` accumulator;
- each ring slot has a "full" barrier per compute warpgroup (a warpgroup waits on every
  phase of its own barriers only) and one "consumed" barrier, which the memory warpgroup
  waits on before it refills the slot;
- so one warpgroup's epilogue runs while the other's MMAs do, and the ring serves
  whichever warpgroup is in its main loop;
- the fused epilogue reads `fc1_output` in 64 x 64 fp32 pieces through `operand_slots`
  buffers per warpgroup (the first ones loaded when its block starts), not as a whole
  tile, and the column sums (a bias gradient) add the block's two row halves in
  registers, then reduce across warps, the two warpgroups taking turns at Pallas's one
  reduction scratch (as the engine does).

    python -m benchmarks.pingpong --seq-lens 1024 4096 --out DIR

times, for grad_output @ fc2_weight (S x H x I; f16 operands in HBM), cuBLAS, the engine's
plain and fused products in the backward's configs for this GPU (no copy programs), and
this kernel plain and fused, with CUPTI and a cold L2; each result is checked first
(plain: within 2 gamma_K (|A| |B|) of cuBLAS's; fused: within its bound of the fp32
HIGHEST reference; both bitwise the same on a second call). M a multiple of 8 (TMA's
tiled rows), N a multiple of `block_n`, K of 64.
"""

from __future__ import annotations

import argparse
import functools
import json
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

BLOCK_M, TILE_K, PIECE = 128, 64, 64
# Registers per thread after the split (the launch gives 65536 / 384 = 170 to each).
MEMORY_REGISTERS, COMPUTE_REGISTERS = 40, 232


def pingpong_matmul(a, b, x=None, *, stages: int = 4, block_n: int = 128,
                    operand_slots: int = 2, out_slots: int = 2, column_sums: bool = False,
                    out_dtype=jnp.float32, grid_tile_width: int = 8,
                    num_programs: int | None = None, approx_math: bool = True, interpret=None):
  """a @ b (a [M, K], b [K, N], 16-bit) in fp32 accumulation, stored as `out_dtype`; with
  `x` ([M, N] fp32), `reference.gelu_backward(a @ b, x)` instead, and with `column_sums`
  also its fp32 column sums (of the unrounded values), `(out, sums)`."""
  (m, k), n = a.shape, b.shape[1]
  if b.shape[0] != k or m % 8 or n % block_n or k % TILE_K or (
      x is not None and x.shape != (m, n)) or (column_sums and x is None):
    raise ValueError(f"pingpong_matmul: a {a.shape}, b {b.shape}, "
                     f"x {None if x is None else x.shape}")
  programs = num_programs or engine.num_sms()
  grid = (pl.cdiv(m, BLOCK_M), n // block_n)
  blocks = grid[0] * grid[1]
  k_steps = k // TILE_K
  fused = x is not None
  smem = _shared_memory_bytes(a.dtype, out_dtype, stages, block_n, operand_slots if fused else 0,
                              out_slots, column_sums)
  if smem > engine.SHARED_MEMORY_BYTES - engine.BARRIER_SLACK_BYTES:
    raise ValueError(f"pingpong_matmul: {smem} bytes of shared memory (stages={stages}, "
                     f"operand_slots={operand_slots}, out_slots={out_slots}); an sm_90 block "
                     f"has {engine.SHARED_MEMORY_BYTES}.")
  pieces = [(pm, pn) for pn in range(block_n // PIECE) for pm in range(BLOCK_M // PIECE)]

  def kernel(a_gmem, b_gmem, *refs):
    refs = list(refs)
    x_gmem = refs.pop(0) if fused else None
    out_gmem = refs.pop(0)
    sums_gmem = refs.pop(0) if column_sums else None
    program = lax.axis_index("program")
    here = engine._count_here(blocks, program, programs)

    def block_origin(local):
      bm, bn = plgpu.planar_snake(program + local * programs, grid, 1, grid_tile_width)
      return bm * BLOCK_M, bn * block_n

    scratch = dict(
        a_smem=plgpu.SMEM((stages, BLOCK_M, TILE_K), a.dtype, transforms=swizzled_tiles(a.dtype)),
        b_smem=plgpu.SMEM((stages, TILE_K, block_n), b.dtype, transforms=swizzled_tiles(b.dtype)),
        out_smem=plgpu.SMEM((2, out_slots, PIECE, PIECE), out_dtype,
                            transforms=swizzled_tiles(out_dtype)),
        a_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
        b_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * stages),
        consumed=plgpu.Barrier(num_arrivals=1, num_barriers=stages))
    if fused:
      scratch.update(
          x_smem=plgpu.SMEM((2, operand_slots, PIECE, PIECE), jnp.float32,
                            transforms=swizzled_tiles(jnp.float32)),
          x_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * operand_slots))
    if column_sums:
      scratch.update(sums_smem=plgpu.SMEM((2, block_n // PIECE, PIECE), jnp.float32),
                     turn=plgpu.Barrier(num_arrivals=1, num_barriers=2))

    @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
    def _scope(a_smem, b_smem, out_smem, a_full, b_full, consumed, x_smem=None, x_full=None,
               sums_smem=None, turn=None):
      wg = lax.axis_index("wg")

      @pl.when(wg == 2)
      def _memory():
        plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

        @pl.loop(0, here * k_steps)
        def _step(g):
          local = lax.div(g, k_steps)
          kk = g - local * k_steps
          owner = lax.rem(local, 2)
          row0, col0 = block_origin(local)
          slot = lax.rem(g, stages)

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(consumed.at[slot])
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(row0, BLOCK_M), pl.ds(kk * TILE_K, TILE_K)],
                                  a_smem.at[slot], a_full.at[owner * stages + slot])
          plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(kk * TILE_K, TILE_K), pl.ds(col0, block_n)],
                                  b_smem.at[slot], b_full.at[owner * stages + slot])

        @pl.loop(jnp.maximum(here * k_steps - stages, 0), here * k_steps)
        def _drain(g):   # every phase of `consumed` is waited on
          plgpu.barrier_wait(consumed.at[lax.rem(g, stages)])

      if column_sums:
        @pl.when(wg == 1)
        def _first_turn():
          plgpu.barrier_arrive(turn.at[0])

      @pl.when(wg < 2)
      def _compute():
        plgpu.set_max_registers(COMPUTE_REGISTERS, action="increase")
        mine = lax.div(here - wg + 1, 2)   # blocks wg, wg + 2, ... below `here`

        @pl.loop(0, mine)
        def _block(i):
          local = 2 * i + wg
          row0, col0 = block_origin(local)

          def load_x(p):
            pm, pn = pieces[p]
            slot = p % operand_slots
            plgpu.copy_gmem_to_smem(
                x_gmem.at[pl.ds(row0 + pm * PIECE, PIECE), pl.ds(col0 + pn * PIECE, PIECE)],
                x_smem.at[wg, slot], x_full.at[wg * operand_slots + slot])

          if fused:   # the first pieces arrive during the main loop
            for p in range(min(operand_slots, len(pieces))):
              load_x(p)

          def accumulate(acc_ref):
            def step(kk, carry):
              g = local * k_steps + kk
              slot = lax.rem(g, stages)
              plgpu.barrier_wait(a_full.at[wg * stages + slot])
              plgpu.barrier_wait(b_full.at[wg * stages + slot])
              plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot])
              plgpu.wgmma_wait(1)   # the previous step's MMAs are done: free its slot

              @pl.when(kk > 0)
              def _():
                plgpu.barrier_arrive(consumed.at[lax.rem(g - 1, stages)])
              return carry
            lax.fori_loop(0, k_steps, step, None)
            plgpu.wgmma_wait(0)
            plgpu.barrier_arrive(consumed.at[lax.rem(local * k_steps + k_steps - 1, stages)])
            return acc_ref[...]
          acc = pl.run_scoped(accumulate, plgpu.ACC((BLOCK_M, block_n), jnp.float32))

          if column_sums:
            plgpu.barrier_wait(turn.at[wg])
          half_sum = None
          for p, (pm, pn) in enumerate(pieces):
            rows, cols = slice(pm * PIECE, (pm + 1) * PIECE), slice(pn * PIECE, (pn + 1) * PIECE)
            value = acc[rows, cols]
            if fused:
              slot = p % operand_slots
              plgpu.barrier_wait(x_full.at[wg * operand_slots + slot])
              value = reference.gelu_backward(value, x_smem[wg, slot])
            out_slot = p % out_slots
            plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
            out_smem[wg, out_slot] = value.astype(out_dtype)
            plgpu.commit_smem()   # (a warpgroup barrier too: every thread read its x piece)
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, out_slot],
                out_gmem.at[pl.ds(row0 + pm * PIECE, PIECE), pl.ds(col0 + pn * PIECE, PIECE)])
            if fused and p + operand_slots < len(pieces):
              load_x(p + operand_slots)
            if column_sums:   # the two row halves of a column piece, then across warps
              if pm == 0:
                half_sum = value
              else:
                sums_smem[wg, pn] = jnp.sum(half_sum + value, axis=0)
          if column_sums:
            @pl.when(local + 1 < here)
            def _():
              plgpu.barrier_arrive(turn.at[1 - wg])
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                sums_smem.at[wg],
                sums_gmem.at[lax.div(row0, BLOCK_M), pl.ds(col0 // PIECE, block_n // PIECE)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # before the next block's sums
        plgpu.wait_smem_to_gmem(0)

  out_type = [jax.ShapeDtypeStruct((m, n), out_dtype)]
  if column_sums:   # one row per block row, in PIECE-wide pieces
    out_type.append(jax.ShapeDtypeStruct((grid[0], n // PIECE, PIECE), jnp.float32))
  outs = plgpu.kernel(
      kernel, out_type=tuple(out_type),
      grid=(programs,), grid_names=("program",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=approx_math),
      **({} if interpret is None else dict(interpret=interpret)),
  )(a, b, *(() if x is None else (x,)))
  if column_sums:
    return outs[0], sum_in_order(outs[1].reshape(grid[0], n))
  return outs[0]


def _shared_memory_bytes(dtype, out_dtype, stages, block_n, operand_slots, out_slots,
                         column_sums) -> int:
  """What `pingpong_matmul` allocates, each buffer aligned as Pallas places them."""
  item = jnp.dtype(dtype).itemsize
  buffers = [stages * BLOCK_M * TILE_K * item, stages * TILE_K * block_n * item,
             2 * out_slots * PIECE * PIECE * jnp.dtype(out_dtype).itemsize,
             2 * operand_slots * PIECE * PIECE * 4]
  if column_sums:
    buffers += [2 * block_n * 4, engine.REDUCTION_SCRATCH_BYTES]
  align = engine.SMEM_ALIGNMENT_BYTES
  return sum(-(-size // align) * align for size in buffers if size)


VARIANTS = {   # name -> pingpong_matmul options ("stN": ring stages, "xN": fc1_output
    # pieces in flight per warpgroup, "oN": output pieces in flight per warpgroup)
    "st4 x2 o1": dict(stages=4, operand_slots=2, out_slots=1),
    "st4 x2 o2": dict(stages=4, operand_slots=2, out_slots=2),
    "st5 x1 o1": dict(stages=5, operand_slots=1, out_slots=1),
    "st3 x3 o2": dict(stages=3, operand_slots=3, out_slots=2),
}


def main(argv=None):
  from benchmarks import cases, timing
  from benchmarks.engine import reference_and_bound
  from benchmarks.epilogue_costs import step_fn
  from benchmarks.run import write_result_json
  parser = argparse.ArgumentParser(prog="python -m benchmarks.pingpong", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
  parser.add_argument("--extra", nargs="*", default=[],
                      help="more variants, as JSON objects of pingpong_matmul options")
  parser.add_argument("--rows-product", action="store_true",
                      help="also time grad_pre @ fc1_weight (S x I x H), plain, against cuBLAS")
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--out", default=os.path.join("benchmarks", "results", "probes", "engine"))
  args = parser.parse_args(argv)
  variants = {name: VARIANTS[name] for name in args.variants}
  variants.update({text: json.loads(text) for text in args.extra})
  rows = []
  for tokens in args.seq_lens:
    grad_output, _, fc1_weight, _, fc2_weight, _, fc1_output, _ = cases.make_inputs(
        jax.random.key(tokens), tokens, cases.HIDDEN, cases.INTERMEDIATE)
    a, b, x = grad_output.astype(jnp.float16), fc2_weight.astype(jnp.float16), fc1_output
    product, product_bound = reference_and_bound(a, b, False)
    exact = reference.gelu_backward(jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32),
                                            precision="highest"), x)
    exact_sums = jnp.sum(exact, axis=0)
    # fused: the product's own error through gelu' (|gelu'| <= 1.13), then f16's rounding
    fused_bound = 1.13 * product_bound + 2.0 ** -11 * jnp.abs(exact) + 2.0 ** -24
    fns = {"cuBLAS": (jax.jit(lambda a, b, x: jnp.dot(a, b, preferred_element_type=jnp.float32)),
                      "plain")}
    for label, step in (("engine, plain", "f16: plain product"),
                        ("engine, fused", "f16: + GELU derivative"),
                        ("engine, fused + sums", "f16: + bias sums (the table's product)")):
      fn = step_fn(step, tokens)
      fns[label] = (lambda a, b, x, fn=fn: fn(a, b, x, None, None),
                    "plain" if step.endswith("plain product") else "fused")
    for name, options in variants.items():
      for kind in ("plain", "fused", "fused + sums"):
        opts = dict(options, column_sums=kind == "fused + sums",
                    out_dtype=jnp.float32 if kind == "plain" else jnp.float16)
        fn = jax.jit(functools.partial(pingpong_matmul, **opts))
        fns[f"pingpong {name}, {kind}"] = ((lambda a, b, x, fn=fn: fn(a, b)) if kind == "plain"
                                           else fn, kind.split(" ")[0])
    row = dict(seq_len=tokens)
    for label, (fn, kind) in fns.items():
      try:
        out = fn(a, b, x)
        again = fn(a, b, x)
      except Exception as e:   # a variant over shared memory, or a lowering failure
        row[label] = f"failed: {type(e).__name__}: {str(e)[:300]}"
        print(f"S={tokens} {label}: {row[label]}", flush=True)
        continue
      out, sums = out if isinstance(out, tuple) else (out, None)
      again = again[0] if isinstance(again, tuple) else again
      err = jnp.abs(out.astype(jnp.float32) - (product if kind == "plain" else exact))
      bound = product_bound if kind == "plain" else fused_bound
      row[label + ": within bound"] = bool(jnp.all(err <= bound))
      row[label + ": max err / bound"] = float(jnp.max(err / bound))
      row[label + ": deterministic"] = bool(jnp.all(out == again))
      if sums is not None:
        row[label + ": max |sums - fp32 HIGHEST| / max |sums|"] = float(
            jnp.max(jnp.abs(sums - exact_sums)) / jnp.max(jnp.abs(exact_sums)))
      row[label] = timing.device_times_us(fn, a, b, x, warmup=5,
                                          iterations=args.iterations).median_us
      print(f"S={tokens} {label}: {row[label]:.1f} us, within bound "
            f"{row[label + ': within bound']}, deterministic {row[label + ': deterministic']}",
            flush=True)
    rows.append(row)
    if args.rows_product:   # the input gradient's shape, plain: a stand-in grad_pre [S, I]
      a, b = fc1_output.astype(jnp.float16), fc1_weight.astype(jnp.float16)
      product, product_bound = reference_and_bound(a, b, False)
      row = dict(seq_len=tokens, product="grad_pre @ fc1_weight")
      fns = {"cuBLAS": jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32))}
      fns.update({f"pingpong {name}, plain": jax.jit(functools.partial(
          pingpong_matmul, **dict(options, out_dtype=jnp.float32)))
          for name, options in variants.items()})
      for label, fn in fns.items():
        out, again = fn(a, b), fn(a, b)
        row[label + ": within bound"] = bool(jnp.all(jnp.abs(out - product) <= product_bound))
        row[label + ": deterministic"] = bool(jnp.all(out == again))
        row[label] = timing.device_times_us(fn, a, b, warmup=5,
                                            iterations=args.iterations).median_us
        print(f"S={tokens} grad_pre @ fc1_weight {label}: {row[label]:.1f} us, within bound "
              f"{row[label + ': within bound']}, deterministic "
              f"{row[label + ': deterministic']}", flush=True)
      rows.append(row)
  write_result_json(args.out, "pingpong", rows=rows)


if __name__ == "__main__":
  main()
