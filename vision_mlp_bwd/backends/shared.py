"""Pieces every backend shares: output types under `shard_map`, the manual-axes helpers, S
ranges, the fixed-order sum.

Kept apart from `vision_mlp_bwd.sharding` (which imports the backends) so that
the backends import nothing of the layer above them.
"""

from __future__ import annotations

import jax
from jax import lax


def _varying_axes(x):
  """The manual mesh axes `x` varies over inside a `shard_map` (empty elsewhere)."""
  aval = jax.typeof(x)
  mat = getattr(aval, "mat", None)  # JAX 0.10 / 0.11; older JAX named it `vma`
  return frozenset(mat.varying if mat is not None else getattr(aval, "vma", ()))


def in_shard_map(*arrays) -> bool:
  """Whether any array varies over a manual mesh axis (is inside a `shard_map`)."""
  return any(_varying_axes(x) for x in arrays)


def match_varying_axes(*arrays):
  """Casts each array to vary over every manual axis any of them varies over.

  Inside a `shard_map` (with its default `check_vma=True`) the gradient a
  `custom_vjp` returns must vary over the same axes as its primal input, but
  the gradient of a replicated weight computed from sharded tokens varies over
  the token axis. Casting the weight to varying first (what `jnp` code does
  implicitly) fixes the types, and its transpose is the `psum` that makes the
  weight gradient whole, exactly as for the `jnp` reference. A no-op outside
  `shard_map` and under `check_vma=False`.
  """
  axes = [_varying_axes(x) for x in arrays]
  union = frozenset().union(*axes)
  return tuple(
      jax.lax.pcast(x, tuple(sorted(union - own)), to="varying") if union - own else x
      for x, own in zip(arrays, axes))


def out_struct(shape, dtype, like):
  """An output varying over the same `shard_map` axes as `like` (Pallas checks that)."""
  mat = None if like is None else getattr(jax.typeof(like), "mat", None)
  if mat is not None:
    try:
      return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)
    except TypeError:  # a JAX without manual-axis types on ShapeDtypeStruct
      pass
  return jax.ShapeDtypeStruct(shape, dtype)


def in_ranges(tokens: int, ranges) -> bool:
  """Whether S lies in one of the inclusive `(lo, hi)` ranges (hi None: no upper end), as
  the routing tables of the configs files write them."""
  return any(lo <= tokens and (hi is None or tokens <= hi) for lo, hi in ranges)


def sum_in_order(x, axis: int = 0):
  """The sum over `axis`, added first to last: a fixed order, bitwise deterministic (the
  partial sums the kernels leave, one row per tile)."""
  total = lax.index_in_dim(x, 0, axis, keepdims=False)
  for i in range(1, x.shape[axis]):
    total = total + lax.index_in_dim(x, i, axis, keepdims=False)
  return total
