"""The registry of backward implementations, tried in order as in tokamax.

A backend is an object with a `name`, `unsupported_reason(problem, platform)`
(None when it can run the problem), `preferred(problem, platform)` (whether the
automatic choice should take it) and `backward(...)`. A new backend is one
module plus one line in `_REGISTRY`; callers of the public API do not change.
The Hopper backend (`backends/mosaic`) is first in order; the automatic choice
takes it where its routing data (`backends/mosaic/configs/h200.json`, and on an H100
`h100.json` where that card measured otherwise) says it measured faster.
"""

from __future__ import annotations

from typing import Protocol

from vision_mlp_bwd.backends import mosaic as _mosaic
from vision_mlp_bwd.backends import triton as _triton
from vision_mlp_bwd.backends import xla as _xla
from vision_mlp_bwd.problem import Problem


class Backend(Protocol):
  name: str

  def unsupported_reason(self, problem: Problem, platform: str) -> str | None: ...

  def preferred(self, problem: Problem, platform: str) -> bool: ...

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem: Problem):
    """Returns the five gradients of the contract for 2-D `[S, ·]` activations."""


# Automatic choice tries these in order; "xla" accepts everything, so it is last.
_REGISTRY: dict[str, Backend] = {
    "mosaic": _mosaic.BACKEND,
    "triton": _triton.BACKEND,
    "xla": _xla.BACKEND,
}


def names() -> tuple[str, ...]:
  return tuple(_REGISTRY)


def get(name: str) -> Backend:
  if name not in _REGISTRY:
    raise ValueError(f"implementation={name!r} is unknown; expected None or one of {names()}.")
  return _REGISTRY[name]


def choose(implementation: str | None, problem: Problem, platform: str) -> Backend:
  """The backend to run: the one named, or the first preferred one in order."""
  if implementation is not None:
    if not isinstance(implementation, str):
      raise TypeError(f"implementation must be None or a str, got {implementation!r}.")
    backend = get(implementation)
    reason = backend.unsupported_reason(problem, platform)
    if reason is not None:
      raise ValueError(f"implementation={implementation!r} cannot run this problem: {reason}")
    return backend
  for backend in _REGISTRY.values():
    if backend.unsupported_reason(problem, platform) is None and backend.preferred(problem, platform):
      return backend
  return _REGISTRY["xla"]


def jnp_autodiff_preferred(problem: Problem, platform: str) -> bool:
  """Whether `vision_mlp`'s automatic choice is jax's autodiff of the model written in jnp.

  True on 16-bit inputs multiplied in their own dtype wherever the XLA backward
  would run. There XLA compiles jnp's autodiff into fewer passes over the
  `[S, I]` tensors than our XLA backward: it writes the 16-bit pre-GELU
  gradient once and sums the bias gradient in the same pass, where ours writes
  it in fp32 first. On the H200, bf16 at S=16384, 1400 µs against 1502 µs
  (benchmarks/results/probes/training_step/training_step_h200_20261201-134437_breakdown.md).
  """
  own_dtype = problem.mode.operand_dtype is not None and (
      problem.mode.operand_dtype == problem.dtype)   # so 16-bit inputs
  return own_dtype and choose(None, problem, platform).name == "xla"
