"""The XLA backend: the reference backward, compiled by XLA. Runs anywhere."""

from __future__ import annotations

from vision_mlp_bwd import reference


class XlaBackend:
  name = "xla"

  def unsupported_reason(self, problem, platform):
    del problem, platform
    return None

  def preferred(self, problem, platform):
    del problem, platform
    return True

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem):
    return reference.mlp_backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight,
                                  fc2_bias, fc1_output, gelu_output, precision=problem.mode)


BACKEND = XlaBackend()
