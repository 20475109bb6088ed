"""Flax modules for the vision MLP whose gradient runs our backward (needs the `flax` extra).

`VisionMLP` (flax.nnx) and `VisionMLPLinen` (flax.linen) call `vision_mlp`, so
`nnx.grad` / `jax.grad` of any model built from them run `mlp_backward`.
Parameters are named and laid out like Hugging Face vision MLPs (torch
`nn.Linear`): `fc1.weight` `[I, H]`, `fc1.bias` `[I]`, `fc2.weight` `[H, I]`,
`fc2.bias` `[H]` (CLIP, SigLIP, Qwen2-VL; Qwen3-VL names them `linear_fc1`,
`linear_fc2`: pass `rename=QWEN3_VL`). `load_state_dict` / `state_dict` move the
parameters of any nnx module (or linen variables) to and from torch or numpy
checkpoints by name.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, traverse_util
from flax.nnx.nn.dtypes import promote_dtype

from vision_mlp_bwd.api import vision_mlp

__all__ = ["QWEN3_VL", "Linear", "VisionMLP", "VisionMLPLinen", "load_state_dict", "state_dict"]

# Our name -> the checkpoint's, for one component of a dotted name (see `load_state_dict`).
QWEN3_VL = {"fc1": "linear_fc1", "fc2": "linear_fc2"}


def torch_linear_init(fan_in: int):
  """torch `nn.Linear`'s init for weight and bias: U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
  bound = 1.0 / math.sqrt(fan_in)
  return lambda key, shape, dtype=jnp.float32: jax.random.uniform(key, shape, dtype, -bound, bound)


def _apply(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, dtype, precision, implementation):
  args = promote_dtype((x, fc1_weight, fc1_bias, fc2_weight, fc2_bias), dtype=dtype, inexact=True)
  return vision_mlp(*args, precision=precision, implementation=implementation)


class Linear(nnx.Module):
  """The parameters of a torch `nn.Linear`: `weight` `[out, in]` and `bias` `[out]`."""

  def __init__(self, in_features: int, out_features: int, *, rngs: nnx.Rngs,
               param_dtype=jnp.float32):
    init = torch_linear_init(in_features)
    self.weight = nnx.Param(init(rngs.params(), (out_features, in_features), param_dtype))
    self.bias = nnx.Param(init(rngs.params(), (out_features,), param_dtype))


class VisionMLP(nnx.Module):
  """fc1 -> tanh-GELU -> fc2 on `[..., hidden_size]`, differentiated by our kernels.

  `precision` and `implementation` are those of `vision_mlp`; `dtype` is the
  computation dtype (input and parameters are cast to it; `None` promotes them).
  """

  def __init__(self, hidden_size: int, intermediate_size: int, *, rngs: nnx.Rngs,
               precision=None, implementation: str | None = None, dtype=None,
               param_dtype=jnp.float32):
    self.fc1 = Linear(hidden_size, intermediate_size, rngs=rngs, param_dtype=param_dtype)
    self.fc2 = Linear(intermediate_size, hidden_size, rngs=rngs, param_dtype=param_dtype)
    self.precision, self.implementation, self.dtype = precision, implementation, dtype

  def __call__(self, x):
    return _apply(x, self.fc1.weight[...], self.fc1.bias[...], self.fc2.weight[...],
                  self.fc2.bias[...], self.dtype, self.precision, self.implementation)


class _LinenLinear(nn.Module):
  in_features: int
  out_features: int
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self):
    init = torch_linear_init(self.in_features)
    return (self.param("weight", init, (self.out_features, self.in_features), self.param_dtype),
            self.param("bias", init, (self.out_features,), self.param_dtype))


class VisionMLPLinen(nn.Module):
  """`VisionMLP` for flax.linen, with the same parameter names, layout and init."""

  hidden_size: int
  intermediate_size: int
  precision: Any = None
  implementation: str | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32

  @nn.compact
  def __call__(self, x):
    h, i, pd = self.hidden_size, self.intermediate_size, self.param_dtype
    fc1 = _LinenLinear(h, i, pd, name="fc1")()
    fc2 = _LinenLinear(i, h, pd, name="fc2")()
    return _apply(x, *fc1, *fc2, self.dtype, self.precision, self.implementation)


def _flat_params(target) -> dict[str, Any]:
  """Dotted name -> nnx.Param (nnx module or State) or array (linen variables or params)."""
  dotted = lambda path: ".".join(map(str, path))
  if isinstance(target, nnx.Module):
    return {dotted(p): v for p, v in nnx.iter_graph(target) if isinstance(v, nnx.Param)}
  if isinstance(target, nnx.State):
    return {dotted(p): v for p, v in nnx.to_flat_state(target) if isinstance(v, nnx.Param)}
  return traverse_util.flatten_dict(dict(target.get("params", target)), sep=".")


def _key(prefix: str, name: str, rename) -> str:
  return prefix + ".".join((rename or {}).get(part, part) for part in name.split("."))


def _to_numpy(value) -> np.ndarray:
  if hasattr(value, "detach"):  # a torch tensor; torch itself is never imported here
    value = value.detach().cpu()
    if str(value.dtype) == "torch.bfloat16":  # numpy has no bfloat16
      value = value.float()
    return value.numpy()
  return np.asarray(value)


def load_state_dict(target, state_dict, prefix: str = "", rename: dict[str, str] | None = None):
  """Loads parameters by name from a dict of numpy arrays or torch tensors.

  Every parameter `name` of `target` (e.g. `fc1.weight`) is read from
  `state_dict[prefix + name]`, e.g. `prefix="blocks.0.mlp."` for a Qwen vision
  block; other entries are ignored. `rename` maps components of our names to
  the checkpoint's, e.g. `rename=QWEN3_VL` reads `fc1.weight` from
  `prefix + "linear_fc1.weight"`. Nothing is written unless every entry is
  present with the right shape. `target` is an nnx module (loaded in place and
  returned) or linen variables / params (a loaded copy is returned).
  Raises KeyError for a missing entry and ValueError for a wrong shape.
  """
  if isinstance(target, nnx.State):
    raise TypeError("load_state_dict loads into an nnx module (or linen variables), not a State.")
  flat = _flat_params(target)
  loaded = {}
  for name, param in flat.items():
    key = _key(prefix, name, rename)
    if key not in state_dict:
      near = sorted(k for k in state_dict if k.startswith(prefix))[:8]
      raise KeyError(f"state_dict has no entry {key!r} (needed for parameter {name!r}); "
                     f"entries under prefix {prefix!r}: {near}")
    value = _to_numpy(state_dict[key])
    expected = tuple(param.shape)
    if value.shape != expected:
      hint = (" It looks transposed: weights use the torch nn.Linear layout [out, in]."
              if value.shape[::-1] == expected and len(expected) == 2 else "")
      raise ValueError(f"state_dict[{key!r}] has shape {value.shape}; expected {expected}.{hint}")
    loaded[name] = jnp.asarray(value, param.dtype)
  if isinstance(target, nnx.Module):
    for name, param in flat.items():
      param[...] = loaded[name]
    return target
  params = traverse_util.unflatten_dict(loaded, sep=".")
  return {**target, "params": params} if "params" in target else params


def state_dict(target, prefix: str = "", rename: dict[str, str] | None = None
               ) -> dict[str, np.ndarray]:
  """`{prefix + name: numpy array}` for the parameters of an nnx module or State (e.g. the
  gradients from `nnx.grad`), or of linen variables; `rename` as in `load_state_dict`."""
  value = lambda p: np.asarray(p[...] if isinstance(p, nnx.Variable) else p)
  return {_key(prefix, name, rename): value(param)
          for name, param in _flat_params(target).items()}
