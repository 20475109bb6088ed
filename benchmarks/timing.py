"""Device time of one call, as SOL-ExecBench measures it: CUPTI, cold L2, medians.

`device_times_us(fn, *args)` times a jitted `fn` over `iterations` calls after
`warmup` untimed ones. Before every timed call a buffer twice the L2 size is
rewritten (a separate, untimed program), then CUPTI records that one call's
kernels; a sample is the sum of their durations (the kernels of one call run
back to back on one stream, so this is first start to last end minus launch
gaps). The median of each kernel's own duration is kept too, to show where a
call's time goes. CUPTI is driven directly through the extension that
`jax.experimental.mosaic.gpu.profiler.measure` uses, because `measure` runs an
extra untimed call before each timed one, which would refill the L2 after the
flush.

`wall_times_us` is the CPU stand-in (host wall clock), for the CPU demo only.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

H200_L2_BYTES = 60 * 1024 * 1024   # 50 MiB on an H200, rounded up; used when the device does not say


@dataclasses.dataclass(frozen=True)
class Timing:
  median_us: float
  p10_us: float
  p90_us: float
  kernels: int                      # kernels launched by one call (0: not known, wall clock)
  kernel_names: tuple[str, ...] = ()
  kernel_median_us: tuple[float, ...] = ()   # per kernel, in launch order (CUPTI only)

  @classmethod
  def from_samples(cls, samples_us, kernels=0, kernel_names=(), kernel_samples_us=()):
    s = np.asarray(samples_us, np.float64)
    per_kernel = tuple(float(np.median(k)) for k in kernel_samples_us)
    return cls(float(np.median(s)), float(np.percentile(s, 10)), float(np.percentile(s, 90)),
               kernels, tuple(kernel_names), per_kernel)


def l2_bytes() -> int:
  device = jax.devices()[0]
  return int(getattr(device, "l2_cache_size", 0) or H200_L2_BYTES)


@jax.jit
def _flush(buffer):
  return buffer + 1


def _cupti():
  """(start, stop) of one CUPTI kernel trace; stop(finalize) returns [(name, ms), ...]."""
  try:
    from jax._src.lib import mosaic_gpu  # shipped with the CUDA plugin of jaxlib only
  except ImportError:
    mosaic_gpu = None
  if mosaic_gpu is None:
    raise RuntimeError("CUPTI timing needs a CUDA build of jaxlib (jax[cuda12] or jax[cuda13]).")
  ext = mosaic_gpu._mosaic_gpu_ext

  def timings(finalize):
    try:
      return ext._cupti_get_timings(finalize)
    except TypeError:                # older jaxlib: no `finalize` argument
      return ext._cupti_get_timings()
  return ext._cupti_init, timings


def device_times_us(fn, *args, warmup: int = 10, iterations: int = 50) -> Timing:
  """CUPTI device time of `fn(*args)` (a jitted function), L2 flushed before every call."""
  cupti_start, cupti_stop = _cupti()
  buffer = jnp.zeros((2 * l2_bytes() // 4,), jnp.float32)
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples, per_kernel, kernel_samples = [], [], []
  for i in range(iterations):
    buffer = jax.block_until_ready(_flush(buffer))
    cupti_start()
    try:
      jax.block_until_ready(fn(*args))
    finally:
      per_kernel = cupti_stop(i == iterations - 1) or []   # detach CUPTI after the last call
    samples.append(1e3 * sum(ms for _, ms in per_kernel))
    kernel_samples.append([1e3 * ms for _, ms in per_kernel])
  if len({len(k) for k in kernel_samples}) != 1:  # a call whose kernels varied: no per-kernel split
    kernel_samples = [[]]
  return Timing.from_samples(samples, len(per_kernel), [name for name, _ in per_kernel],
                             list(zip(*kernel_samples)))


def wall_times_us(fn, *args, warmup: int = 10, iterations: int = 50) -> Timing:
  """Host wall-clock time of `fn(*args)` until its outputs are ready (CPU demo only)."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  samples = []
  for _ in range(iterations):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    samples.append(1e6 * (time.perf_counter() - start))
  return Timing.from_samples(samples)
