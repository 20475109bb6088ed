"""Device time of one call, as SOL-ExecBench measures it: CUPTI, cold L2, medians.

`device_times_us(fn, *args)` returns the per-call device time (the sum of the
call's kernel durations, read with CUPTI through
`jax.experimental.mosaic.gpu.profiler.measure`) for `iterations` calls, each
preceded by a write of a buffer twice the L2 size, so every call starts cold.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

H200_L2_BYTES = 60 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Timing:
  median_us: float
  p10_us: float
  p90_us: float
  kernels: int  # kernels launched by one call

  @classmethod
  def from_samples(cls, samples_us, kernels):
    s = np.asarray(samples_us, np.float64)
    return cls(float(np.median(s)), float(np.percentile(s, 10)), float(np.percentile(s, 90)),
               kernels)


def _l2_bytes() -> int:
  device = jax.devices()[0]
  return int(getattr(device, "l2_cache_size", 0) or H200_L2_BYTES)


@jax.jit
def _flush(buffer):
  return buffer + 1


def device_times_us(fn, *args, warmup: int = 10, iterations: int = 50) -> Timing:
  """Times `fn(*args)` (a jitted function) with CUPTI, L2 flushed before every call."""
  from jax.experimental.mosaic.gpu import profiler  # needs a GPU build of jaxlib

  buffer = jnp.zeros((2 * _l2_bytes() // 4,), jnp.float32)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  measured = profiler.measure(fn, aggregate=False)
  samples, kernels = [], 0
  for _ in range(iterations):
    buffer = jax.block_until_ready(_flush(buffer))
    out, per_kernel = measured(*args)
    jax.block_until_ready(out)
    per_kernel = per_kernel or []
    kernels = len(per_kernel)
    samples.append(1e3 * sum(ms for _, ms in per_kernel))
  return Timing.from_samples(samples, kernels)
