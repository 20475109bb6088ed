"""Public API: `mlp_backward` (the SOL-ExecBench contract) and `vision_mlp`.

`vision_mlp` is the forward fc1 -> tanh-GELU -> fc2 as a `jax.custom_vjp`
whose backward is `mlp_backward`, so `jax.grad` of any model that calls it
runs our kernels.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from vision_mlp_bwd import backends, reference, sharding
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import check_backward_args, check_forward_args, platform


def mlp_backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                 fc1_output, gelu_output, *, precision=None, implementation=None):
  """Gradients of the vision MLP, in the order of the SOL-ExecBench contract.

  Args:
    grad_output: `[..., H]`, the gradient of the MLP's output.
    hidden_state: `[..., H]`, the MLP's input.
    fc1_weight, fc1_bias: `[I, H]`, `[I]` (torch `nn.Linear` layout).
    fc2_weight, fc2_bias: `[H, I]`, `[H]`.
    fc1_output: `[..., I]`, the pre-activation `hidden_state @ fc1_weight.T + fc1_bias`.
    gelu_output: `[..., I]`, the activation; read, never recomputed.
    precision: what `jnp.matmul` takes, meaning what it means there: on fp32
      inputs `None` is TF32 on the GPU, like XLA; on bf16/f16 inputs every
      32-bit precision multiplies the 16-bit values with fp32 accumulation
      (`vision_mlp_bwd.precision.for_inputs`).
    implementation: `None` (best for the platform), or a name in
      `vision_mlp_bwd.backends.names()`: `"mosaic"` (Hopper), `"triton"` or `"xla"`.

  Returns:
    `(grad_hidden_state, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight,
    grad_fc2_bias)`, each shaped and typed like the input it belongs to.
  """
  mode = canonicalize(precision)
  problem = check_backward_args(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight,
                                fc2_bias, fc1_output, gelu_output, mode)
  backends.choose(implementation, problem, platform())  # fail here, not per device
  if problem.tokens == 0:
    return (jnp.zeros(hidden_state.shape, hidden_state.dtype),
            jnp.zeros_like(fc1_weight), jnp.zeros_like(fc1_bias),
            jnp.zeros_like(fc2_weight), jnp.zeros_like(fc2_bias))
  # Runs per device under sharding (see `vision_mlp_bwd.sharding`).
  return sharding.partitioned_mlp_backward(mode, implementation, grad_output, hidden_state,
                                           fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                                           fc1_output, gelu_output)


def vision_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, *, precision=None,
               implementation=None):
  """fc1 -> tanh-GELU -> fc2 on `hidden_state` `[..., H]`; differentiable with our backward.

  The forward runs in XLA at `precision`; its gradient runs `mlp_backward` with
  the same `precision` and `implementation`. It saves the input, the
  parameters and the two activations `[..., I]` in the input dtype for the
  backward (plain autodiff of the same model saves about three times more).
  Where the automatic choice would run the XLA backward on 16-bit inputs, it
  is instead jax's autodiff of the same model written in jnp, which XLA
  compiles into a faster program (`backends.jnp_autodiff_preferred`). Works
  under `jit`, `grad`, `vmap` and `jax.checkpoint`.
  """
  problem = check_forward_args(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                               canonicalize(precision))
  mode = problem.mode   # as it runs on this dtype
  if implementation is not None:
    backends.get(implementation)  # fail on unknown names now, not inside the backward
  elif backends.jnp_autodiff_preferred(problem, platform()):
    return reference.jnp_mlp(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                             precision=mode)
  # Inside a shard_map, give every input the varying axes of all; under explicit
  # sharding, run with those axes automatic (see `vision_mlp_bwd.sharding`).
  arrays = sharding.match_varying_axes(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
  return sharding.with_auto_axes(functools.partial(_vision_mlp, mode, implementation), arrays,
                                 like=hidden_state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _vision_mlp(mode, implementation, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  output, _, _ = _forward_rows(mode, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias)
  return output


def _forward_rows(mode, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  batch = hidden_state.shape[:-1]
  rows = hidden_state.reshape(-1, hidden_state.shape[-1])
  output, fc1_output, gelu_output = reference.mlp_forward(
      rows, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision=mode)
  return output.reshape(*batch, -1), fc1_output, gelu_output


def _vision_mlp_fwd(mode, implementation, hidden_state, fc1_weight, fc1_bias, fc2_weight,
                    fc2_bias):
  output, fc1_output, gelu_output = _forward_rows(mode, hidden_state, fc1_weight, fc1_bias,
                                                  fc2_weight, fc2_bias)
  residuals = (hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output, gelu_output)
  return output, residuals


def _vision_mlp_bwd(mode, implementation, residuals, grad_output):
  hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output, gelu_output = residuals
  rows = hidden_state.reshape(-1, hidden_state.shape[-1])
  grads = mlp_backward(grad_output.reshape(rows.shape[0], -1), rows, fc1_weight, fc1_bias,
                       fc2_weight, fc2_bias, fc1_output, gelu_output, precision=mode,
                       implementation=implementation)
  return (grads[0].reshape(hidden_state.shape), *grads[1:])


_vision_mlp.defvjp(_vision_mlp_fwd, _vision_mlp_bwd)
