"""How `mlp_backward` (and so the gradient of `vision_mlp`) runs on sharded arrays.

A `pallas_call` is opaque to XLA's SPMD partitioner: under `jax.jit` on
sharded arrays XLA would all-gather every input onto every device, run the
whole backward there, and slice the results. This module stops that by
wrapping the per-device backward in `jax.experimental.custom_partitioning`,
so the partitioner asks us how to split it, and the strategy is inferred from
the shardings the caller already gave the arrays; nothing to configure:

* **Data parallel.** Tokens (any leading dimensions of `hidden_state`) sharded
  over mesh axes `D`, weights replicated over `D`: every device runs the kernels
  on its own tokens; the four weight and bias gradients are summed over `D`
  (`psum`, or `psum_scatter` along a dimension where the sharding XLA asks for
  the result splits that dimension over some of `D`, e.g. ZeRO-style gradient
  sharding).
* **Tensor parallel (Megatron).** The intermediate axis `I` sharded over mesh
  axes `M`: `fc1_weight` `[I, H]` and `fc1_bias` `[I]` on dimension 0 (fc1
  column-parallel), `fc2_weight` `[H, I]` on dimension 1 (fc2 row-parallel),
  `fc1_output` / `gelu_output` on their last dimension. Every device runs the
  kernels on its slice of `I`; `grad_hidden_state` is summed over `M`; the
  weight gradients stay sharded like the weights, and `grad_fc2_bias` (which
  does not depend on `I`) is computed replicated.
* Both at once on a 2-D (or larger) mesh; mesh axes that shard neither are
  replicated work.

`D` is read from the leading dimensions of the first of `hidden_state`,
`grad_output`, `fc1_output`, `gelu_output` that is sharded there; `M` from
`fc1_weight`, then `fc2_weight`, `fc1_bias`, `fc1_output`, `gelu_output`. A
sharded `H` dimension is not supported (it is gathered), and an axis whose size
does not divide its dimension is dropped (replicated), never padded.

Why `custom_partitioning` and not a `shard_map` wrapper: it needs no mesh or
axis names from the user and works through the existing public functions:
`jax.jit(jax.grad(loss))` of a model calling `vision_mlp` on sharded params
and activations partitions the kernels the same way XLA partitions the
surrounding `jnp` code (also inside `lax.scan` over layers, with `jax.set_mesh`
or `with mesh:` or neither, with Auto or Explicit mesh axes). An explicit
wrapper would make every model thread a mesh and axis names through to the
MLP, and would still all-gather when they disagree with how the arrays are
actually sharded.

Versions. Tested on JAX 0.10.2 (CPU, 8 host devices) with both partitioners:
Shardy (the default) reads `_SHARDING_RULE`, the deprecated GSPMD partitioner
(`jax_use_shardy_partitioner=False`) reads `infer_sharding_from_operands`.
JAX 0.11 made that second function mandatory under GSPMD (it raises
`NotImplementedError` without one); we give both. Its other changes to
`custom_partitioning` (the `ClosedJaxpr` merge, tracing through flat trees)
are internal; the `partition` callback's signature and the per-device
lowering are unchanged, and the body must still close over no array constants
(ours does not). tests/test_sharding.py also passes on JAX 0.11.2 (its CPU
backend, on the GPU machine; 2026-11-29).

Limits. `custom_partitioning` has no vmap or JVP rule, so `mlp_backward` adds
them: under `jax.vmap` or `jax.jvp` it runs the per-device backward vmapped /
differentiated as before, which XLA partitions by itself (gathering). Inside
a `shard_map` that leaves some mesh axes automatic, those axes are gathered
(correct, not partitioned). A jitted function containing the op on several
devices cannot be serialised with `jax.export` (the partitioner is a Python
callback).

Explicit sharding (`AxisType.Explicit`, `jax.make_mesh`'s default): the
`jnp` reference and a `pallas_call` cannot type the sharding of a sum over
sharded tokens, so `mlp_backward` and `vision_mlp` run inside
`jax.sharding.auto_axes` (`with_auto_axes`), which turns those axes
automatic for the call, where the custom partitioning above applies, and
types each result as sharded like the input it belongs to.

Inside your own `jax.shard_map` (every mesh axis manual) the custom
partitioning is bypassed: `mlp_backward` / `vision_mlp` see per-device blocks
and compute per-device results, and cross-device sums are the caller's, as
for any function in a `shard_map`:

* `mlp_backward` returns per-device partial sums: `jax.lax.psum` the weight
  and bias gradients over the data axis, and `grad_hidden_state` over the
  model axis.
* `jax.grad` through `vision_mlp` behaves exactly like `jnp` code: with the
  default `check_vma=True`, JAX's autodiff inserts the sums itself (the
  gradients of weights replicated over the data axis come out summed; for
  Megatron you `psum` the forward output over the model axis, and the
  gradient of the replicated input is summed by that psum's transpose). For
  that `vision_mlp` first casts its inputs to vary over the same axes
  (`match_varying_axes`). With `check_vma=False` you `psum` the gradients
  yourself.

`partitioned_mlp_backward` is the function `api.mlp_backward` calls.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from vision_mlp_bwd import backends
from vision_mlp_bwd.backends.shared import in_shard_map, match_varying_axes
from vision_mlp_bwd.problem import check_backward_args, platform

__all__ = ["local_mlp_backward", "match_varying_axes", "partitioned_mlp_backward",
           "tensor_parallel_specs", "with_auto_axes"]

# Shardy's view of the op: `...` are the token dimensions, `i` the intermediate
# axis shared by fc1 and fc2, `h` the hidden axis, which must stay whole.
_SHARDING_RULE = "... h, ... h, i h, i, h i, h, ... i, ... i -> ... h, i h, i, h i, h"


def tensor_parallel_specs(model_axis):
  """PartitionSpecs of `(fc1_weight, fc1_bias, fc2_weight, fc2_bias)` for Megatron TP."""
  return P(model_axis, None), P(model_axis), P(None, model_axis), P(None)


def _explicit_mesh(arrays):
  """The mesh of the first array typed as sharded over `AxisType.Explicit` axes, or None."""
  for x in arrays:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and AxisType.Explicit in mesh.axis_types:
      return mesh
  return None


def with_auto_axes(fn, arrays, like):
  """`fn(*arrays)`, with any `Explicit` mesh axes of their types made `Auto` inside.

  Under explicit sharding (`jax.make_mesh`'s default) every op must be able to
  type its result's sharding, which neither the `jnp` reference nor a
  `pallas_call` can for a sum over sharded tokens. `jax.sharding.auto_axes`
  hands those axes to the partitioner for the call (where the custom
  partitioning applies) and types the results as sharded like `like` (a
  pytree of arrays matching `fn`'s results). A plain call when no axis is
  explicit.
  """
  mesh = _explicit_mesh(arrays)
  if mesh is None:
    return fn(*arrays)
  axes = tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
  out_sharding = jax.tree.map(lambda x: jax.typeof(x).sharding, like)
  return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding)(*arrays)


def local_mlp_backward(mode, implementation, grad_output, hidden_state, fc1_weight, fc1_bias,
                       fc2_weight, fc2_bias, fc1_output, gelu_output):
  """The backward on one device's arrays: no collectives, backend chosen for these shapes."""
  problem = check_backward_args(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight,
                                fc2_bias, fc1_output, gelu_output, mode)
  backend = backends.choose(implementation, problem, platform())
  if problem.tokens == 0:
    return (jnp.zeros(hidden_state.shape, hidden_state.dtype),
            jnp.zeros_like(fc1_weight), jnp.zeros_like(fc1_bias),
            jnp.zeros_like(fc2_weight), jnp.zeros_like(fc2_bias))
  rows = lambda x: x.reshape(problem.tokens, x.shape[-1])
  grad_hidden_state, *weight_grads = backend.backward(
      rows(grad_output), rows(hidden_state), fc1_weight, fc1_bias, fc2_weight, fc2_bias,
      rows(fc1_output), rows(gelu_output), problem)
  return (grad_hidden_state.reshape(hidden_state.shape), *weight_grads)


# --------------------------------------------------------------------------------------
# The partitioning rules.

def _dim_axes(sharding, ndim):
  """The mesh axes sharding each dimension, as tuples; () for all of a non-named sharding."""
  spec = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  spec += (None,) * (ndim - len(spec))
  return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def _ordered_subsets(names):
  return [p for r in range(len(names) + 1) for c in itertools.combinations(names, r)
          for p in itertools.permutations(c)]


def _name_sharding(sharding, shape, mesh):
  """`sharding` (an unnamed GSPMDSharding) as a NamedSharding on `mesh`, or None.

  Tries the specs whose per-dimension split counts match the sharding's and
  keeps the one XLA says is equivalent.
  """
  try:
    ways = [g // b for g, b in zip(shape, sharding.shard_shape(shape))]
  except Exception:  # uneven or unusual shardings: treated as replicated
    return None
  subsets = _ordered_subsets(mesh.axis_names)
  options = [[t for t in subsets if math.prod(mesh.shape[a] for a in t) == w] for w in ways]
  for combo in itertools.product(*options):
    flat = [a for t in combo for a in t]
    if len(flat) != len(set(flat)):
      continue
    candidate = NamedSharding(mesh, P(*map(_entry, combo)))
    if candidate.is_equivalent_to(sharding, len(shape)):
      return candidate
  return None


def _context_mesh(mesh, abstract_mesh, *shape_trees):
  """The mesh to partition on, and `shape_trees` with NamedShardings on it.

  The lowering names the shardings only when the jit's own inputs or outputs
  carry NamedShardings; with `jax.set_mesh` and sharding constraints alone it
  hands over an empty mesh and unnamed shardings. Then the abstract mesh seen
  at trace time, laid over the jit's devices in order (as JAX's own lowering
  does for an abstract mesh), names them.
  """
  if not mesh.empty or abstract_mesh is None:
    return (mesh, *shape_trees)
  # Private, but what JAX's custom_partitioning lowering itself reads.
  devices = getattr(shape_trees[0][1].sharding, "_device_assignment", None)
  if devices is None or len(devices) != abstract_mesh.size:
    return (mesh, *shape_trees)
  mesh = Mesh(np.array(devices).reshape(abstract_mesh.axis_sizes), abstract_mesh.axis_names)

  def name(x):
    sharding = x.sharding
    if sharding is not None and not isinstance(sharding, NamedSharding):
      sharding = _name_sharding(sharding, x.shape, mesh)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return (mesh, *(tuple(map(name, tree)) for tree in shape_trees))


def _divisible_prefix(axes, size, mesh):
  """The longest prefix of `axes` whose combined size divides `size` (no padded shards)."""
  kept = []
  for axis in axes:
    if size % (math.prod(mesh.shape[a] for a in kept) * mesh.shape[axis]):
      break
    kept.append(axis)
  return tuple(kept)


def _entry(axes):
  return None if not axes else axes[0] if len(axes) == 1 else tuple(axes)


def _plan(mesh, arg_shapes):
  """(per-token-dimension axes, all token axes, model axes) from the operands' shardings."""
  grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, _, fc1_output, gelu_output = (
      arg_shapes)
  lead = hidden_state.ndim - 1
  token = [()] * lead
  for x in (hidden_state, grad_output, fc1_output, gelu_output):
    candidate = _dim_axes(x.sharding, x.ndim)[:lead]
    if any(candidate):
      token = candidate
      break
  used = []
  for d in range(lead):
    axes = _divisible_prefix([a for a in token[d] if a not in used], hidden_state.shape[d], mesh)
    token[d] = axes
    used.extend(axes)
  model = ()
  for x, dim in ((fc1_weight, 0), (fc2_weight, 1), (fc1_bias, 0), (fc1_output, -1),
                 (gelu_output, -1)):
    model = _dim_axes(x.sharding, x.ndim)[dim]
    if model:
      break
  model = _divisible_prefix([a for a in model if a not in used], fc1_weight.shape[0], mesh)
  return token, tuple(used), model


def _base_specs(token, model):
  """Per-dimension axes of the 8 operands and the 5 results before any reduction."""
  tok, none = list(token), [()]
  hidden = tok + none
  inter = tok + [model]
  operands = (hidden, hidden, [model, ()], [model], [(), model], none, inter, inter)
  results = (hidden, [model, ()], [model], [(), model], none)
  return operands, results


def _named(mesh, dims):
  return NamedSharding(mesh, P(*map(_entry, dims)))


def _reductions(results, token_axes, model, result_shapes, mesh):
  """For each result: [(dimension, axes) to psum_scatter], axes left to psum, final dims.

  A result is a sum over the token axes (weight and bias gradients) or over the
  model axes (`grad_hidden_state`). Where the sharding XLA asks for a result
  splits one of its dimensions further by some of those axes (and evenly), the
  sum is a reduce-scatter along that dimension instead of an all-reduce.
  """
  plans = []
  for k, (dims, shape) in enumerate(zip(results, result_shapes)):
    pending = list(model if k == 0 else token_axes)
    dims = [tuple(d) for d in dims]
    wanted = _dim_axes(shape.sharding, len(dims)) if shape.sharding is not None else []
    scatters = []
    for d, want in enumerate(wanted):
      extra = want[len(dims[d]):]
      if (want[:len(dims[d])] != dims[d] or not extra
          or not all(a in pending for a in extra)):
        continue
      local = shape.shape[d] // math.prod(mesh.shape[a] for a in dims[d])
      if local % math.prod(mesh.shape[a] for a in extra):
        continue
      scatters.append((d, tuple(extra)))
      dims[d] = dims[d] + tuple(extra)
      pending = [a for a in pending if a not in extra]
    plans.append((scatters, tuple(pending), dims))
  return plans


def _partition(mode, implementation, abstract_mesh, mesh, arg_shapes, result_shapes):
  mesh, arg_shapes, result_shapes = _context_mesh(mesh, abstract_mesh, arg_shapes,
                                                  result_shapes)
  token, token_axes, model = _plan(mesh, arg_shapes)
  operands, results = _base_specs(token, model)
  plans = _reductions(results, token_axes, model, result_shapes, mesh)

  def per_device(*arrays):
    grads = local_mlp_backward(mode, implementation, *arrays)
    out = []
    for grad, (scatters, pending, _) in zip(grads, plans):
      for dim, axes in scatters:
        grad = jax.lax.psum_scatter(grad, axes, scatter_dimension=dim, tiled=True)
      if pending:
        grad = jax.lax.psum(grad, pending)
      out.append(grad)
    return tuple(out)

  arg_shardings = tuple(_named(mesh, dims) for dims in operands)
  result_shardings = tuple(_named(mesh, dims) for _, _, dims in plans)
  return mesh, per_device, result_shardings, arg_shardings


def _infer_sharding_from_operands(mode, implementation, abstract_mesh, mesh, arg_shapes,
                                  result_shapes):
  """The results' shardings for the GSPMD partitioner (Shardy reads `_SHARDING_RULE`)."""
  del mode, implementation, result_shapes
  mesh, arg_shapes = _context_mesh(mesh, abstract_mesh, arg_shapes)
  token, _, model = _plan(mesh, arg_shapes)
  return tuple(_named(mesh, dims) for dims in _base_specs(token, model)[1])


def _partitioned_body(mode, implementation, abstract_mesh, *arrays):
  del abstract_mesh  # only read by the partitioning rules
  return local_mlp_backward(mode, implementation, *arrays)


_partitioned = custom_partitioning(_partitioned_body, static_argnums=(0, 1, 2))
_partitioned.def_partition(
    partition=_partition,
    infer_sharding_from_operands=_infer_sharding_from_operands,
    sharding_rule=_SHARDING_RULE,
    need_replication_factors=("h",),
)


def _auto_abstract_mesh():
  """The context's abstract mesh (`jax.set_mesh`) if it has axes, all automatic; else None."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or any(t != AxisType.Auto for t in mesh.axis_types):
    return None
  return mesh


@functools.cache
def _entry_point(mode, implementation):
  """`mlp_backward` for one (mode, implementation): jit(custom_jvp(custom_vmap(partitioned)))."""
  local = functools.partial(local_mlp_backward, mode, implementation)

  @custom_vmap
  def batchable(*arrays):
    return _partitioned(mode, implementation, _auto_abstract_mesh(), *arrays)

  @batchable.def_vmap
  def _vmap_rule(axis_size, in_batched, *arrays):
    del axis_size
    grads = jax.vmap(local, in_axes=tuple(0 if b else None for b in in_batched))(*arrays)
    return grads, (True,) * len(grads)

  @jax.custom_jvp
  def differentiable(*arrays):
    return batchable(*arrays)

  @differentiable.defjvp
  def _jvp(primals, tangents):
    return jax.jvp(local, primals, tangents)

  # The jit makes eager calls on sharded arrays partition too (custom
  # partitioning only acts when compiled); inside a jit it is inlined.
  return jax.jit(differentiable)


def partitioned_mlp_backward(mode, implementation, grad_output, hidden_state, fc1_weight,
                             fc1_bias, fc2_weight, fc2_bias, fc1_output, gelu_output):
  """`local_mlp_backward`, partitioned by XLA as this module's docstring says.

  Arguments are validated already (`api.mlp_backward` does it); `mode` is a
  `DotMode`, `implementation` a backend name or None.
  """
  arrays = (grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output,
            gelu_output)
  return with_auto_axes(_entry_point(mode, implementation), arrays, like=arrays[1:6])
