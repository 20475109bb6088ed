"""Test setup shared by every module.

Eight host devices let the sharding tests build meshes of 2, 4 and 8 on a CPU;
the flag must be set before JAX starts, hence here. Tests marked `gpu` are
skipped unless a CUDA GPU is present. Tests marked `transcendental` hold an fp32
exp or tanh of XLA's CPU backend to a stated bound; XLA picks those by the CPU's
vector ISA, so CI also runs them under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2.

float16 on CPUs without F16C: XLA's CPU backend converts fp32 to f16 with an
instruction of F16C, and where it may not use it (a CPU without it, or
`--xla_cpu_max_isa=SSE4_2`) it calls `__truncsfhf2`, which jaxlib's JIT does
not provide on Linux (openxla/xla#6787): every such conversion fails to link
("Failed to materialize symbols"). If a probe at start-up fails that way, a
test that fails with that same JIT error is reported as skipped, with the
reason, instead of failed; nothing else is.

Poisoning: Pallas interpret mode (every kernel on the CPU) starts each output
as NaN and reads NaN out of bounds, so an element no program writes comes out
NaN; the numerics checks (tests/bounds.py) reject non-finite outputs wherever
the float64 oracle is finite (tests/test_kernels.py shows both).
"""

import os
import sys

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "transcendental: holds XLA's fp32 exp/tanh (picked by the CPU's vector ISA) "
                 "to a stated bound; also run under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2")


def _is_f16_conversion_failure(error) -> bool:
  """The JIT's link error (the missing symbol itself is only logged)."""
  return (isinstance(error, jax.errors.JaxRuntimeError)
          and "Failed to materialize symbols" in str(error))


def _f16_conversion_fails() -> bool:
  """Whether XLA's CPU backend here cannot convert fp32 to float16 (see the docstring)."""
  if jax.default_backend() != "cpu":
    return False
  import jax.numpy as jnp
  try:
    jax.block_until_ready(jax.jit(lambda x: x.astype(jnp.float16))(jnp.arange(3.0)))
  except jax.errors.JaxRuntimeError as error:
    if _is_f16_conversion_failure(error):
      return True
    raise
  return False


F16_CONVERSION_FAILS = _f16_conversion_fails()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
  try:
    return (yield)
  except Exception as error:
    if F16_CONVERSION_FAILS and _is_f16_conversion_failure(error):
      pytest.skip("XLA's CPU backend cannot convert to float16 on this CPU or ISA "
                  "(__truncsfhf2 missing from jaxlib's JIT, openxla/xla#6787)")
    raise


@pytest.fixture(autouse=True)
def _fresh_gpu_interpreter():
  """Pallas's GPU interpreter keeps a kernel's simulated memory when the kernel raises (to
  debug it), and the next interpreted kernel with another thread count then fails an
  assertion against it: the state is reset after each test (a test skipped above for
  the f16 conversion raised inside such a kernel)."""
  yield
  module = sys.modules.get("jax._src.pallas.mosaic_gpu.interpret.interpret_pallas_call")
  reset = getattr(module, "reset_gpu_interpret_mode_state", None)
  if reset is not None:
    reset()


def _has_gpu() -> bool:
  try:
    return jax.default_backend() == "gpu"
  except RuntimeError:
    return False


def pytest_collection_modifyitems(config, items):
  del config
  if _has_gpu():
    return
  skip = pytest.mark.skip(reason="needs a CUDA GPU")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)
