"""The Hopper backend (Pallas Mosaic GPU): its GEMM engine and, built on it, the backward.

First in the registry (`vision_mlp_bwd.backends`, `implementation="mosaic"`);
the automatic choice takes it where `configs/h200.json`'s routing says so. On an H100,
`configs/h100.json`'s routing and table entries replace the H200's where they measured
otherwise (`backward_sm90.tables_for`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vision_mlp_bwd.backends.mosaic import backward_sm90
from vision_mlp_bwd.backends.mosaic.backward_sm90 import backward
from vision_mlp_bwd.backends.mosaic.tiles import SWIZZLE
from vision_mlp_bwd.backends.shared import in_ranges
from vision_mlp_bwd.precision import BF16X3_MODES, DotMode
from vision_mlp_bwd.problem import Problem

__all__ = ["BACKEND", "backward"]

ROW_LENGTH = SWIZZLE // 2   # H and I: whole swizzled rows of 16-bit values


class MosaicBackend:
  name = "mosaic"

  def unsupported_reason(self, problem: Problem, platform: str) -> str | None:
    on_16_bit_products = problem.dtype == jnp.float32 and (
        problem.mode == DotMode.TF32 or problem.mode in BF16X3_MODES)
    if problem.mode.operand_dtype is None and not on_16_bit_products:
      return (f"{problem.mode.name} on {problem.dtype.name} inputs multiplies in 32 bits "
              "beyond TF32 and bf16x3; this backend runs 16-bit products (F16_F16_F32 or "
              "BF16_BF16_F32 precision, or bf16/f16 inputs), and TF32 (DEFAULT) and bf16x3 "
              "(HIGHEST, HIGH) on fp32 inputs.")
    for name, size in (("H", problem.hidden), ("I", problem.intermediate)):
      if size % ROW_LENGTH:
        return f"{name}={size} is not a multiple of {ROW_LENGTH}."
    if platform != "gpu":
      return f"the Mosaic GPU kernels run on Hopper GPUs only, not on {platform}."
    capability = getattr(jax.devices()[0], "compute_capability", None)
    if capability is None or not str(capability).startswith("9"):
      return f"wgmma needs a Hopper GPU (compute capability 9.x), not {capability}."
    return None

  def preferred(self, problem: Problem, platform: str) -> bool:
    """Where it measured faster than the others on this GPU: its routing
    (`backward_sm90.routing_for`), S ranges by input dtype and mode (e.g. `{"float32":
    {"f16": [[1024, null]]}}`)."""
    del platform
    routing = backward_sm90.routing_for(jax.devices()[0].device_kind)
    return in_ranges(problem.tokens,
                     routing.get(problem.dtype.name, {}).get(problem.mode.value, ()))

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem: Problem):
    return backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                    fc1_output, gelu_output, problem)


BACKEND = MosaicBackend()
