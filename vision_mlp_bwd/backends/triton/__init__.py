"""The Pallas-Triton backend: the backward as four tiled products in two launches.

Launch 1: `grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output)`
(GELU derivative fused into the epilogue) beside `grad_fc2_weight =
grad_output.T @ gelu_output` (with `grad_fc2_bias` summed from the same tiles).
Launch 2: `grad_hidden_state = grad_fc1_output @ fc1_weight` beside
`grad_fc1_weight = grad_fc1_output.T @ hidden_state` (with `grad_fc1_bias`).
`Config.group_launches=False` runs the four products as four launches.

On a CPU the same kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from vision_mlp_bwd.backends.triton.config import (
    Config, TileConfig, default_config, interpret_config, triton_wins)
from vision_mlp_bwd.backends.triton.kernels import Product, grouped_matmul
from vision_mlp_bwd.problem import Problem

__all__ = ["BACKEND", "Config", "TileConfig", "backward", "default_config", "interpret_config"]


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
  s, h, i = problem.tokens, problem.hidden, problem.intermediate
  # The pre-GELU gradient is only ever a matmul operand: 16-bit modes store it
  # in their operand dtype, which halves its traffic and rounds it as the
  # products would anyway.
  pre_dtype = jnp.dtype(problem.mode.operand_dtype or jnp.float32)
  pre_activation = Product(s, i, h, config.pre_activation, pre_dtype, fuse_gelu=True)
  fc2_weight_grad = Product(h, i, s, config.weight_grads, fc2_weight.dtype, transpose_a=True,
                            row_sums=True)
  fc1_weight_grad = Product(i, h, s, config.weight_grads, fc1_weight.dtype, transpose_a=True,
                            row_sums=True)
  input_grad = Product(s, h, i, config.input_grad, hidden_state.dtype)
  run = functools.partial(grouped_matmul, mode=problem.mode, interpret=interpret)

  # Launch 1 needs only inputs; launch 2 needs the pre-GELU gradient of launch 1.
  first = [(pre_activation, (grad_output, fc2_weight, fc1_output), "grad_fc1_output"),
           (fc2_weight_grad, (grad_output, gelu_output), "grad_fc2_weight")]
  if config.group_launches:
    grad_pre, (grad_fc2_weight, grad_fc2_bias) = run(
        [p for p, _, _ in first], [o for _, o, _ in first], name="mlp_backward_1")
  else:
    grad_pre, (grad_fc2_weight, grad_fc2_bias) = [run([p], [o], name=n)[0] for p, o, n in first]
  second = [(input_grad, (grad_pre, fc1_weight), "grad_hidden_state"),
            (fc1_weight_grad, (grad_pre, hidden_state), "grad_fc1_weight")]
  if config.group_launches:
    grad_hidden_state, (grad_fc1_weight, grad_fc1_bias) = run(
        [p for p, _, _ in second], [o for _, o, _ in second], name="mlp_backward_2")
  else:
    grad_hidden_state, (grad_fc1_weight, grad_fc1_bias) = [
        run([p], [o], name=n)[0] for p, o, n in second]
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
    return platform == "gpu" and problem.dtype == jnp.float32 and triton_wins(problem)

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem: Problem):
    return backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                    fc1_output, gelu_output, problem, interpret=jax.default_backend() != "gpu")


BACKEND = TritonBackend()
