"""The Pallas-Triton backend: the backward as three launches of `tiled_matmul`.

1. `grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output)`
   (GELU derivative fused into the epilogue);
2. `grad_fc2_weight, grad_fc2_bias` and `grad_fc1_weight, grad_fc1_bias`
   (bias sums fused into the weight-gradient products, which read the same data);
3. `grad_hidden_state = grad_fc1_output @ fc1_weight`.

On a CPU the same kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from vision_mlp_bwd.backends.triton.config import (
    TRITON_WINS_UP_TO_TOKENS, Config, TileConfig, default_config, interpret_config)
from vision_mlp_bwd.backends.triton.kernels import tiled_matmul
from vision_mlp_bwd.problem import Problem

__all__ = ["BACKEND", "Config", "TileConfig", "backward", "default_config"]


def _gpu_reason() -> str | None:
  device = jax.devices()[0]
  capability = getattr(device, "compute_capability", None)
  if capability is not None and float(capability) < 8.0:
    return f"Pallas-Triton needs compute capability >= 8.0, this GPU has {capability}."
  return None


def backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output,
             gelu_output, problem: Problem, config: Config | None = None,
             interpret: bool = False):
  """The five gradients for 2-D activations `[S, ·]`, computed by the Triton kernels."""
  if config is None:
    config = interpret_config(problem) if interpret else default_config(problem)
  mode = problem.mode
  # The pre-GELU gradient is only ever a matmul operand: 16-bit modes store it
  # in their operand dtype, which halves its traffic and rounds it as the
  # products would anyway.
  pre_dtype = mode.operand_dtype or jnp.float32
  common = dict(mode=mode, interpret=interpret)

  grad_pre = tiled_matmul(grad_output, fc2_weight, gelu_input=fc1_output,
                          tile=config.pre_activation, out_dtype=pre_dtype,
                          name="grad_fc1_output", **common)
  grad_fc2_weight, grad_fc2_bias = tiled_matmul(
      grad_output, gelu_output, transpose_a=True, row_sums=True, tile=config.weight_grads,
      out_dtype=fc2_weight.dtype, name="grad_fc2_weight", **common)
  grad_fc1_weight, grad_fc1_bias = tiled_matmul(
      grad_pre, hidden_state, transpose_a=True, row_sums=True, tile=config.weight_grads,
      out_dtype=fc1_weight.dtype, name="grad_fc1_weight", **common)
  grad_hidden_state = tiled_matmul(grad_pre, fc1_weight, tile=config.input_grad,
                                   out_dtype=hidden_state.dtype, name="grad_hidden_state",
                                   **common)
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias.astype(fc1_bias.dtype),
          grad_fc2_weight, grad_fc2_bias.astype(fc2_bias.dtype))


class TritonBackend:
  name = "triton"

  def unsupported_reason(self, problem: Problem, platform: str) -> str | None:
    del problem
    if platform == "gpu":
      return _gpu_reason()
    if platform == "cpu":
      return None  # Pallas interpret mode
    return f"Pallas-Triton runs on CUDA GPUs (and in interpret mode on the CPU), not on {platform}."

  def preferred(self, problem: Problem, platform: str) -> bool:
    limit = TRITON_WINS_UP_TO_TOKENS.get(problem.mode, -1)
    return platform == "gpu" and problem.tokens <= limit

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem: Problem):
    return backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                    fc1_output, gelu_output, problem, interpret=jax.default_backend() != "gpu")


BACKEND = TritonBackend()
