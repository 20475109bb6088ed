"""`python -m benchmarks.overlap_probe gpu`: a probe of the fused product with its epilogue
overlapped (benchmarks/NOTES.md, 48d): one warp-specialized pipeline per program over all of
its blocks (a grid of blocks x K steps), the previous block's accumulator carried in registers,
its GELU epilogue run while the next block's first wgmma groups are in flight: whole at the
block's first step (`chunks=1`), or in `chunks` 64-row x (128 / chunks)-column pieces over its
first steps. No column sums. Times it against the engine's fused product (the F16 table's
config, without sums) at M = 2048 and 4096, checking both against jnp. `lower` lowers it for
CUDA without a GPU."""
import functools, sys
import jax, jax.numpy as jnp, numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from vision_mlp_bwd import reference
from vision_mlp_bwd.backends.mosaic.tiles import swizzled_tiles

def matmul(a, b, x, tile_m=128, tile_n=64, tile_k=64, stages=4, programs=132, interpret=None,
           reset="cond", approx=True, chunks=1):
  m, k = a.shape; n = b.shape[1]
  block_m, block_n = tile_m, 2 * tile_n
  grid_m, grid_n = m // block_m, n // block_n
  blocks = grid_m * grid_n
  k_steps = k // tile_k

  def kernel(a_gmem, b_gmem, x_gmem, out_gmem):
    program = lax.axis_index("program")
    here = jnp.maximum(blocks - program + programs - 1, 0) // programs
    def block_of(local):
      index = program + local * programs
      return index // grid_n, index % grid_n
    a_spec = plgpu.BlockSpec((block_m, tile_k), lambda s: (block_of(s // k_steps)[0], s % k_steps),
                             transforms=swizzled_tiles(a.dtype))
    b_spec = plgpu.BlockSpec((tile_k, block_n), lambda s: (s % k_steps, block_of(s // k_steps)[1]),
                             transforms=swizzled_tiles(b.dtype))
    wg = lax.axis_index("wg")
    wg_cols = pl.ds(wg * tile_n, tile_n)

    col_chunks = max(chunks // 2, 1)
    width = tile_n // col_chunks
    def tiles(dtype):
      swizzle = min(128, width * jnp.dtype(dtype).itemsize)
      return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
              plgpu.SwizzleTransform(swizzle))
    @functools.partial(
        pl.run_scoped,
        out_smem=plgpu.SMEM((2, tile_m, tile_n), out_dtype, transforms=tiles(out_dtype)),
        x_smem=plgpu.SMEM((2, tile_m, tile_n), x.dtype, transforms=tiles(x.dtype)),
        x_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=2),
        collective_axes="wg")
    def _scope(out_smem, x_smem, x_arrived):
      def tile_at(local):
        bm, bn = block_of(local)
        return pl.ds(bm * block_m, tile_m), pl.ds(bn * block_n + wg * tile_n, tile_n)

      def start(local):
        plgpu.copy_gmem_to_smem(x_gmem.at[tile_at(local)], x_smem.at[wg], x_arrived.at[wg])

      def finish(value, local):
        plgpu.barrier_wait(x_arrived.at[wg])
        value = reference.gelu_backward(value, x_smem[wg].astype(jnp.float32))
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        out_smem[wg] = value.astype(out_dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[tile_at(local)])

      def finish_chunk(value, c):
        """Chunk c (64 rows x `width` columns) of the previous block's epilogue into out_smem."""
        if c == 0:
          plgpu.barrier_wait(x_arrived.at[wg])
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        r, q = divmod(c, col_chunks)
        rows, cols = slice(r * 64, (r + 1) * 64), slice(q * width, (q + 1) * width)
        part = reference.gelu_backward(value[rows, cols], x_smem[wg, rows, cols].astype(jnp.float32))
        out_smem[wg, rows, cols] = part.astype(out_dtype)

      def body(idx, a_smem, b_smem, carry):
        acc_ref, prev = carry
        (step,) = idx
        kk, local = step % k_steps, step // k_steps
        plgpu.wgmma(acc_ref, a_smem, b_smem.at[:, wg_cols])
        if chunks == 1:
          @pl.when((kk == 0) & (local > 0))
          def _():
            finish(prev, local - 1)
          @pl.when(kk == 0)
          def _():
            start(local)
        else:
          for c in range(chunks):
            @pl.when((kk == c) & (local > 0))
            def _(c=c):
              finish_chunk(prev, c)
              if c == chunks - 1:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[tile_at(local - 1)])
          @pl.when(kk == chunks - 1)
          def _():
            start(local)
        plgpu.wgmma_wait(0)
        last = kk == k_steps - 1
        if reset == "cond":
          prev = lax.cond(last, lambda: acc_ref[...], lambda: prev)
          @pl.when(last)
          def _():
            acc_ref[...] = jnp.zeros((tile_m, tile_n), jnp.float32)
        else:
          acc = acc_ref[...]
          mask = lax.broadcast_in_dim(last, acc.shape, ())
          prev = lax.select(mask, acc, prev)
          acc_ref[...] = lax.select(mask, jnp.zeros_like(acc), acc)
        return acc_ref, prev

      def compute_context(run):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc(acc_ref):
          _, prev = run((acc_ref, jnp.zeros((tile_m, tile_n), jnp.float32)))
          @pl.when(here > 0)
          def _():
            finish(prev, here - 1)

      plgpu.emit_pipeline_warp_specialized(
          body, grid=(here * k_steps,), memory_registers=40, in_specs=[a_spec, b_spec],
          wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=stages,
          compute_context=compute_context)(a_gmem, b_gmem)
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_dtype = a.dtype
  return plgpu.kernel(kernel, out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
                      grid=(programs,), grid_names=("program",), num_threads=3, thread_name="wg",
                      compiler_params=plgpu.CompilerParams(
                          lowering_semantics=plgpu.LoweringSemantics.Warpgroup, approx_math=approx),
                      **({} if interpret is None else dict(interpret=interpret)))(a, b, x)

if __name__ == "__main__":
  mode = sys.argv[1] if len(sys.argv) > 1 else "gpu"
  if mode == "lower":
    for reset, chunks in (("cond", 1), ("cond", 4), ("cond", 8)):
      a = jax.ShapeDtypeStruct((4096, 1280), jnp.float16); b = jax.ShapeDtypeStruct((1280, 3584), jnp.float16)
      x = jax.ShapeDtypeStruct((4096, 3584), jnp.float32)
      text = jax.jit(functools.partial(matmul, reset=reset, chunks=chunks)).trace(a, b, x).lower(lowering_platforms=("cuda",)).as_text()
      print("lowered", reset, len(text))
  else:   # on the GPU: check and time against the engine's fused product
    from benchmarks import timing
    from vision_mlp_bwd.backends.mosaic import engine
    table = engine.GemmConfig(tile_n=64, stages=4, epilogue_tile=(64, 64), epilogue_buffers=1, chained=True)
    for m in (2048, 4096):
      ka, kb, kx = jax.random.split(jax.random.key(m), 3)
      a = jax.random.normal(ka, (m, 1280), jnp.float16); b = (jax.random.normal(kb, (1280, 3584)) / 36).astype(jnp.float16)
      x = jax.random.normal(kx, (m, 3584), jnp.float32)
      ref = np.asarray(reference.gelu_backward(jnp.dot(a, b, preferred_element_type=jnp.float32), x))
      fns = {"engine (table, no sums)": jax.jit(lambda a, b, x: engine.matmul(a, b, out_dtype=jnp.float16, config=table, epilogue=reference.gelu_backward, epilogue_operand=x, approx_math=True))}
      for reset, stages, chunks in (("cond", 3, 1), ("cond", 4, 1), ("where", 3, 1), ("where", 4, 1),
                                    ("cond", 4, 4), ("cond", 4, 8)):
        fns[f"overlap reset={reset} stages={stages} chunks={chunks}"] = jax.jit(
            functools.partial(matmul, reset=reset, stages=stages, chunks=chunks))
      for name, fn in fns.items():
        try:
          out = np.asarray(fn(a, b, x), np.float32)
          err = float(np.nanmax(np.abs(out - ref) / (np.abs(ref) + 1e-3)))
          t = timing.device_times_us(fn, a, b, x, warmup=3, iterations=20)
          print(f"M={m} {name:32s} {t.median_us:8.1f} us  max rel err {err:.2e}  nan {int(np.isnan(out).sum())}", flush=True)
        except Exception as e:
          print(f"M={m} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
