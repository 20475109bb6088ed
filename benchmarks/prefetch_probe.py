"""The pre-activation product alone at F16 S=211: fp32 or f16 weight, B prefetched 0-3 steps ahead.

    python -m benchmarks.prefetch_probe     (CUDA GPU; benchmarks/NOTES.md, section 23)
"""
import jax, jax.numpy as jnp
from benchmarks.timing import device_times_us
from vision_mlp_bwd.backends.triton.config import TileConfig
from vision_mlp_bwd.backends.triton.kernels import tiled_matmul
from vision_mlp_bwd.precision import DotMode
k = jax.random.split(jax.random.key(0), 3)
dy = jax.random.normal(k[0], (211, 1280)).astype(jnp.float16)
w2 = jax.random.normal(k[1], (1280, 3584)) / 60.0
x = jax.random.normal(k[2], (211, 3584))
for name, b in (("B fp32", w2), ("B f16", w2.astype(jnp.float16))):
  for pf in (0, 1, 2, 3):
    tile = TileConfig(128, 64, 64, prefetch_b=pf)
    fn = jax.jit(lambda a, b, x, tile=tile: tiled_matmul(a, b, gelu_input=x, tile=tile, mode=DotMode.F16, out_dtype=jnp.float16))
    print(f"pre-activation alone, A f16, {name}, prefetch_b={pf}: {device_times_us(fn, dy, b, x, iterations=30).median_us:.1f} us", flush=True)
