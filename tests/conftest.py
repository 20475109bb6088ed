"""Test setup shared by every module.

Eight host devices let the sharding tests build meshes of 2, 4 and 8 on a CPU;
the flag must be set before JAX starts, hence here. Tests marked `gpu` are
skipped unless a CUDA GPU is present. Tests marked `transcendental` hold an fp32
exp or tanh of XLA's CPU backend to a stated bound; XLA picks those by the CPU's
vector ISA, so CI also runs them under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2.

Poisoning: Pallas interpret mode (every kernel on the CPU) starts each output
as NaN and reads NaN out of bounds, so an element no program writes comes out
NaN; the numerics checks (tests/bounds.py) reject non-finite outputs wherever
the float64 oracle is finite (tests/test_kernels.py shows both).
"""

import os

if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                             + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import pytest  # noqa: E402


def pytest_configure(config):
  config.addinivalue_line(
      "markers", "transcendental: holds XLA's fp32 exp/tanh (picked by the CPU's vector ISA) "
                 "to a stated bound; also run under XLA_FLAGS=--xla_cpu_max_isa=SSE4_2")


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
