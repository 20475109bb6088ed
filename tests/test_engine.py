"""The Mosaic GEMM engine (backends/mosaic/engine.py): it lowers for CUDA at the backward's
sizes in every configuration benchmarks/engine.py times, and refuses what it cannot run.

Its numbers are measured on the GPU (`python -m benchmarks.engine`, which checks each
result against 2 gamma_K |A| |B| of cuBLAS's before timing it); here, without a GPU, the
kernels are lowered (JAX 0.10 lowers Mosaic GPU kernels for CUDA on a CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import pytest

from benchmarks import engine as engine_benchmark
from vision_mlp_bwd.backends.mosaic import engine
from tests import helpers

needs_lowering = pytest.mark.skipif(not helpers.cuda_lowering_without_gpu(),
                                    reason="this JAX lowers for CUDA only on a GPU")


def _lower(m, k, n, transpose_a, config, dtype=jnp.float16):
  a = jax.ShapeDtypeStruct((k, m) if transpose_a else (m, k), dtype)
  b = jax.ShapeDtypeStruct((k, n), dtype)
  fn = functools.partial(engine.matmul, transpose_a=transpose_a, config=config, num_programs=132)
  return jax.jit(fn).trace(a, b).lower(lowering_platforms=("cuda",)).as_text()


@needs_lowering
@pytest.mark.parametrize("label", list(engine_benchmark.CONFIGS))
@pytest.mark.parametrize("product", list(engine_benchmark.PRODUCTS))
def test_every_benchmarked_config_lowers_at_full_size(product, label):
  config = engine_benchmark.CONFIGS[label]
  shape, transpose_a = engine_benchmark.PRODUCTS[product]
  if transpose_a and config.split == "m":
    pytest.skip("split='m' takes a plain A only")
  m, k, n = shape(4096, 1280, 3584)
  text = _lower(m, k, n, transpose_a, config)
  assert "mosaic_gpu" in text


@needs_lowering
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_ragged_sizes_lower_where_rows_are_whole_tma_tiles(dtype):
  """M, N and K need not be multiples of a block (TMA zero-fills reads past the ends)."""
  assert "mosaic_gpu" in _lower(216, 1280, 3584, False, engine.GemmConfig(stages=3), dtype)
  assert "mosaic_gpu" in _lower(1280, 216, 3584, True, engine.GemmConfig(stages=3), dtype)


def test_bad_operands_and_configs_are_refused_with_clear_errors():
  a16 = jax.ShapeDtypeStruct((64, 128), jnp.float16)
  with pytest.raises(TypeError, match=r"one 16-bit dtype; got a float32, b float16"):
    engine.matmul(jax.ShapeDtypeStruct((64, 128), jnp.float32), a16)
  with pytest.raises(ValueError, match=r"op\(a\) is \[64, 128\] but b has shape \(64, 128\)"):
    engine.matmul(a16, a16)
  with pytest.raises(ValueError, match="split='m' slices a transposed A"):
    engine.matmul(a16, jax.ShapeDtypeStruct((64, 256), jnp.float16), transpose_a=True,
                  config=engine.GemmConfig(split="m"))
  with pytest.raises(ValueError, match="split and grid_minor take 'm' or 'n'"):
    engine.GemmConfig(split="k")
  assert engine.GemmConfig(split="m").block == (256, 128)
  assert engine.GemmConfig(tile_n=64).block == (128, 128)
