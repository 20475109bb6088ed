"""Input checking and the `Problem` summary that backends and heuristics read.

Every public entry point validates here, so a bad argument fails with one
message style: the argument's name, its shape and dtype, and what was expected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from vision_mlp_bwd.precision import DotMode, for_inputs

SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# `mlp_backward`'s arguments and the gradients it returns, in the SOL-ExecBench contract's order.
BACKWARD_ARGS = ("grad_output", "hidden_state", "fc1_weight", "fc1_bias", "fc2_weight",
                 "fc2_bias", "fc1_output", "gelu_output")
GRADIENTS = ("grad_hidden_state", "grad_fc1_weight", "grad_fc1_bias", "grad_fc2_weight",
             "grad_fc2_bias")


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a backend needs to know to choose and configure its kernels."""

  tokens: int          # S: all leading dimensions of hidden_state, flattened
  hidden: int          # H
  intermediate: int    # I
  dtype: jnp.dtype
  mode: DotMode        # as it runs on `dtype` (`precision.for_inputs`)


def _describe(x) -> str:
  return f"shape {tuple(np.shape(x))} and dtype {getattr(x, 'dtype', type(x).__name__)}"


def _check_array(name, x, rank=None, min_rank=None):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise TypeError(f"{name} must be a JAX or NumPy array, got {type(x).__name__}.")
  if rank is not None and x.ndim != rank:
    raise ValueError(f"{name} must have rank {rank}; got {_describe(x)}.")
  if min_rank is not None and x.ndim < min_rank:
    raise ValueError(f"{name} must have rank >= {min_rank} ([..., features]); got {_describe(x)}.")


def _check_shape(name, x, expected, meaning):
  if tuple(x.shape) != tuple(expected):
    raise ValueError(f"{name} has {_describe(x)}; expected shape {tuple(expected)} ({meaning}).")


def _check_dtypes(named_arrays):
  first_name, first = named_arrays[0]
  dtype = jnp.dtype(first.dtype)
  if dtype not in SUPPORTED_DTYPES:
    raise TypeError(
        f"{first_name} has {_describe(first)}; expected a floating dtype among "
        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}.")
  for name, x in named_arrays[1:]:
    if jnp.dtype(x.dtype) != dtype:
      raise TypeError(
          f"{name} has {_describe(x)}; expected dtype {dtype} like {first_name} "
          "(all inputs must share one dtype).")
  return dtype


def check_weights(fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  """Checks the four parameters; returns (H, I)."""
  _check_array("fc1_weight", fc1_weight, rank=2)
  intermediate, hidden = fc1_weight.shape
  _check_array("fc1_bias", fc1_bias, rank=1)
  _check_shape("fc1_bias", fc1_bias, (intermediate,), "[I] with I = fc1_weight.shape[0]")
  _check_array("fc2_weight", fc2_weight, rank=2)
  _check_shape("fc2_weight", fc2_weight, (hidden, intermediate),
               "[H, I], nn.Linear layout [out, in], transposed shape of fc1_weight")
  _check_array("fc2_bias", fc2_bias, rank=1)
  _check_shape("fc2_bias", fc2_bias, (hidden,), "[H] with H = fc1_weight.shape[1]")
  return hidden, intermediate


def check_forward_args(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, mode):
  hidden, intermediate = check_weights(fc1_weight, fc1_bias, fc2_weight, fc2_bias)
  _check_array("hidden_state", hidden_state, min_rank=1)
  if hidden_state.shape[-1] != hidden:
    raise ValueError(f"hidden_state has {_describe(hidden_state)}; expected last dimension "
                     f"H = {hidden} (fc1_weight.shape[1]).")
  dtype = _check_dtypes([("hidden_state", hidden_state), ("fc1_weight", fc1_weight),
                         ("fc1_bias", fc1_bias), ("fc2_weight", fc2_weight),
                         ("fc2_bias", fc2_bias)])
  tokens = int(np.prod(hidden_state.shape[:-1], dtype=np.int64))
  return Problem(tokens, hidden, intermediate, dtype, for_inputs(mode, dtype))


def check_backward_args(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                        fc1_output, gelu_output, mode):
  """Checks the eight inputs of `mlp_backward`; returns the Problem."""
  problem = check_forward_args(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, mode)
  batch = tuple(hidden_state.shape[:-1])
  for name, x, width, meaning in (
      ("grad_output", grad_output, problem.hidden, "[..., H] like hidden_state"),
      ("fc1_output", fc1_output, problem.intermediate, "[..., I], I = fc1_weight.shape[0]"),
      ("gelu_output", gelu_output, problem.intermediate, "[..., I], I = fc1_weight.shape[0]"),
  ):
    _check_array(name, x, min_rank=1)
    _check_shape(name, x, batch + (width,), meaning)
  _check_dtypes([("hidden_state", hidden_state), ("grad_output", grad_output),
                 ("fc1_output", fc1_output), ("gelu_output", gelu_output)])
  return problem


def platform() -> str:
  """The platform computations run on by default ('gpu', 'cpu', 'tpu')."""
  return jax.default_backend()
