"""The backward under sharding: data, tensor (Megatron) and 2-D parallel, on 8 host devices.

Every case checks three things: the gradients are within their bounds
(tests/bounds.py, chex) of the float64 oracle of the unsharded problem (sums
over devices are fp32 sums like any other, inside gamma_K; 16-bit results
summed over devices in their own dtype add one rounding per device); they
come out sharded as the strategy says; and the
compiled HLO moves no activation between devices. The HLO check is two
assertions: no collective has the shape of a (partly) gathered
`hidden_state`, `fc1_output` or `gelu_output`, and the only collectives are
sums of gradient blocks. `test_hlo_checks_flag_unpartitioned_kernels` shows
both fail for a backward XLA cannot partition.

Shapes are chosen so that no gathered activation has the shape of a gradient
block: S = 80 tokens, H = 32, I = 96, so tokens per device are 80/40/20/10 and
the intermediate blocks 96/48/24/12. "triton" runs the kernels in Pallas
interpret mode (slow, so fewer cases); "xla" runs the reference per device
(fast). Also covered: reduce-scatter on request, GSPMD, `jax.set_mesh` with
constraints only, explicit mesh axes, eager calls, a user's `shard_map`,
vmap / jvp, and the per-device body lowering to Triton for CUDA.
"""

from __future__ import annotations

import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import vision_mlp_bwd
from vision_mlp_bwd import reference, sharding
from vision_mlp_bwd.precision import DotMode
from tests import bounds, helpers

F32 = jax.lax.DotAlgorithmPreset.F32_F32_F32
TOKENS, HIDDEN, INTERMEDIATE = 80, 32, 96
BATCH = (8, 10)  # the same 80 tokens as [batch, sequence]


# ------------------------------------------------------------------------------------------
# Meshes and specs.

def make_mesh(data, model):
  """A mesh of data * model devices; axes of size 1 are left out (1-D meshes stay 1-D)."""
  sizes = {name: size for name, size in (("data", data), ("model", model)) if size > 1}
  devices = np.array(jax.devices()[:data * model]).reshape(tuple(sizes.values()))
  return Mesh(devices, tuple(sizes))


def axis(mesh, name):
  return name if name in mesh.axis_names else None


def input_specs(mesh, rank):
  """Specs of the 8 inputs: tokens on `data`, the intermediate axis on `model`."""
  d, m = axis(mesh, "data"), axis(mesh, "model")
  lead = (d,) + (None,) * (rank - 2)
  return (P(*lead, None), P(*lead, None), *sharding.tensor_parallel_specs(m),
          P(*lead, m), P(*lead, m))


def output_specs(mesh, rank):
  """Specs the 5 gradients must have: like the inputs they belong to."""
  specs = input_specs(mesh, rank)
  return (specs[1],) + specs[2:6]


def put(arrays, mesh, specs):
  return [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs)]


def assert_sharded_as(outs, mesh, specs):
  for name, out, spec in zip(helpers.OUT_NAMES, outs, specs):
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, spec), out.ndim), (
        name, out.sharding, spec)


# ------------------------------------------------------------------------------------------
# Reading collectives out of compiled HLO.

_COLLECTIVE = re.compile(
    r"=\s+(?P<type>\([^()]*\)|\S+)\s+(?P<op>all-gather|all-reduce|reduce-scatter|all-to-all|"
    r"collective-permute|collective-broadcast|ragged-all-to-all)(?:-start)?\(")
_SHAPE = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")


def collectives(hlo):
  """[(op, [result shapes], line)] for every collective in an HLO module's text."""
  found = []
  for line in hlo.splitlines():
    match = _COLLECTIVE.search(line)
    if match:
      shapes = [tuple(int(d) for d in dims.split(",") if d)
                for dims in _SHAPE.findall(match["type"])]
      found.append((match["op"], shapes, line.strip()[:160]))
  return found


def collectives_by_op(hlo):
  counts = {}
  for op, _, _ in collectives(hlo):
    counts[op] = counts.get(op, 0) + 1
  return counts


def gathered_shapes(global_shape, block_shape):
  """Every shape a gather of this activation could produce: larger than its block, with each
  dimension a power-of-two fraction of the global one; also flattened to [tokens, features]."""
  options = [sorted({g // k for k in (1, 2, 4, 8) if g % k == 0 and g // k >= b})
             for g, b in zip(global_shape, block_shape)]
  shapes = set(itertools.product(*options)) - {tuple(block_shape)}
  return shapes | {(math.prod(s[:-1]), s[-1]) for s in shapes if len(s) > 2}


def moved_activations(hlo, mesh, arrays, specs):
  """Collectives whose result looks like a gathered hidden_state, fc1_output or gelu_output."""
  forbidden = set()
  for i in (1, 6, 7):
    block = NamedSharding(mesh, specs[i]).shard_shape(arrays[i].shape)
    forbidden |= gathered_shapes(arrays[i].shape, block)
  return [c for c in collectives(hlo) if any(s in forbidden for s in c[1])]


def gradient_blocks(mesh, arrays, specs, extra=()):
  """Shapes the legitimate sums may have: the per-device blocks of the gradients
  (grad_hidden_state only with a model axis, the weight gradients only with a data axis)."""
  d, m = "data" in mesh.axis_names, "model" in mesh.axis_names
  allowed = set(extra)
  for i, x in enumerate(arrays[1:6]):
    block = NamedSharding(mesh, specs[i + 1]).shard_shape(x.shape)
    if (i == 0 and m) or (i > 0 and d):
      allowed |= {block, (math.prod(block[:-1]), block[-1])} if i == 0 else {block}
  return allowed


def unexpected_collectives(hlo, allowed):
  """Collectives other than all-reduce / reduce-scatter of the `allowed` shapes."""
  return [c for c in collectives(hlo)
          if c[0] not in ("all-reduce", "reduce-scatter") or not set(c[1]) <= allowed]


def assert_no_activation_traffic(hlo, mesh, arrays, specs, extra=()):
  moved = moved_activations(hlo, mesh, arrays, specs)
  assert not moved, "activations gathered:\n" + "\n".join(c[2] for c in moved)
  unexpected = unexpected_collectives(hlo, gradient_blocks(mesh, arrays, specs, extra))
  assert not unexpected, "unexpected collectives:\n" + "\n".join(c[2] for c in unexpected)


# ------------------------------------------------------------------------------------------
# mlp_backward on sharded arrays under jit.

CASES = [
    # (implementation, data, model, leading dims)
    ("xla", 2, 1, None), ("xla", 4, 1, None), ("xla", 8, 1, BATCH),
    ("xla", 1, 2, None), ("xla", 1, 4, BATCH), ("xla", 1, 8, None),
    ("xla", 2, 2, None), ("xla", 2, 4, BATCH), ("xla", 4, 2, None),
    ("triton", 8, 1, BATCH), ("triton", 1, 4, None), ("triton", 2, 4, None),
]


def _case_id(case):
  impl, data, model, batch = case
  return f"{impl}-data{data}-model{model}" + ("-batched" if batch else "")


def _inputs(batch, dtype=jnp.float32):
  return helpers.backward_inputs(TOKENS, HIDDEN, INTERMEDIATE, dtype=dtype, batch=batch)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_backward_matches_unsharded_and_moves_no_activations(case):
  impl, data, model, batch = case
  mesh = make_mesh(data, model)
  inputs = _inputs(batch)
  specs = input_specs(mesh, inputs[1].ndim)
  sharded = put(inputs, mesh, specs)
  run = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward, precision=F32,
                                  implementation=impl))
  outs = run(*sharded)
  bounds.check_backward(outs, inputs, F32, _case_id(case))
  assert_sharded_as(outs, mesh, output_specs(mesh, inputs[1].ndim))
  assert_no_activation_traffic(run.lower(*sharded).compile().as_text(), mesh, inputs, specs)


def test_bfloat16_data_parallel():
  mesh = make_mesh(4, 1)
  inputs = _inputs(None, jnp.bfloat16)
  outs = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward, implementation="xla"))(
      *put(inputs, mesh, input_specs(mesh, 2)))
  # The four weight and bias gradients are bf16 sums over the 4 devices of `data`.
  bounds.check_backward(outs, inputs, None, "bf16 data parallel", devices=(1, 4, 4, 4, 4))


def test_axis_that_does_not_divide_is_replicated_not_padded():
  mesh = make_mesh(8, 1)
  inputs = helpers.backward_inputs(36, HIDDEN, INTERMEDIATE)  # 36 tokens over 8 devices
  specs = input_specs(mesh, 2)

  def run(*arrays):  # jax.Arrays cannot be split unevenly, values inside a jit can
    arrays = [jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))
              for x, s in zip(arrays, specs)]
    return vision_mlp_bwd.mlp_backward(*arrays, precision=F32, implementation="xla")

  outs = jax.jit(run)(*inputs)
  bounds.check_backward(outs, inputs, F32)


def test_weight_gradients_reduce_scatter_when_the_caller_shards_them():
  """ZeRO-style: ask for weight gradients sharded over `data` too; the sum is a
  reduce-scatter into that sharding, not an all-reduce followed by a slice."""
  mesh = make_mesh(2, 4)
  inputs = _inputs(None)
  specs = input_specs(mesh, 2)
  want = (P("data"), P(("model", "data")), P(("model", "data")), P("data", "model"), P("data"))
  run = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward, precision=F32,
                                  implementation="xla"),
                out_shardings=tuple(NamedSharding(mesh, s) for s in want))
  sharded = put(inputs, mesh, specs)
  outs = run(*sharded)
  bounds.check_backward(outs, inputs, F32)
  assert_sharded_as(outs, mesh, want)
  hlo = run.lower(*sharded).compile().as_text()
  scattered = {NamedSharding(mesh, s).shard_shape(x.shape) for s, x in zip(want[1:], inputs[2:6])}
  assert_no_activation_traffic(hlo, mesh, inputs, specs, extra=scattered)
  ops = collectives_by_op(hlo)
  assert ops.get("reduce-scatter", 0) >= 4, ops  # the four weight and bias gradients
  assert ops.get("all-reduce", 0) == 1, ops      # grad_hidden_state over `model`


def test_gspmd_partitioner():
  """The deprecated GSPMD partitioner reads `infer_sharding_from_operands`, not the rule."""
  previous = jax.config.jax_use_shardy_partitioner
  jax.config.update("jax_use_shardy_partitioner", False)
  try:
    mesh = make_mesh(2, 2)
    inputs = _inputs(None)
    specs = input_specs(mesh, 2)
    sharded = put(inputs, mesh, specs)
    run = jax.jit(lambda *a: vision_mlp_bwd.mlp_backward(*a, precision=F32,
                                                         implementation="xla"))
    outs = run(*sharded)
    bounds.check_backward(outs, inputs, F32)
    assert_sharded_as(outs, mesh, output_specs(mesh, 2))
    assert_no_activation_traffic(run.lower(*sharded).compile().as_text(), mesh, inputs, specs)
  finally:
    jax.config.update("jax_use_shardy_partitioner", previous)


def test_set_mesh_with_sharding_constraints_only():
  """No NamedSharding on the jit's inputs or outputs: the mesh comes from `jax.set_mesh`."""
  mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  inputs = _inputs(None)
  specs = input_specs(mesh, 2)

  def run(*arrays):
    arrays = [jax.lax.with_sharding_constraint(x, s) for x, s in zip(arrays, specs)]
    return vision_mlp_bwd.mlp_backward(*arrays, precision=F32, implementation="xla")

  with jax.set_mesh(mesh):
    outs = jax.jit(run)(*inputs)
    hlo = jax.jit(run).lower(*inputs).compile().as_text()
  bounds.check_backward(outs, inputs, F32)
  assert_sharded_as(outs, mesh, output_specs(mesh, 2))
  assert_no_activation_traffic(hlo, mesh, inputs, specs)


def test_explicit_axes():
  mesh = jax.make_mesh((2, 2), ("data", "model"),
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  inputs = _inputs(BATCH)
  specs = input_specs(mesh, 3)
  sharded = put(inputs, mesh, specs)
  run = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward, precision=F32,
                                  implementation="xla"))
  outs = run(*sharded)
  bounds.check_backward(outs, inputs, F32)
  assert_sharded_as(outs, mesh, output_specs(mesh, 3))
  assert_no_activation_traffic(run.lower(*sharded).compile().as_text(), mesh, inputs, specs)


def test_eager_call_on_sharded_arrays_is_partitioned():
  mesh = make_mesh(4, 2)
  inputs = _inputs(None)
  outs = vision_mlp_bwd.mlp_backward(*put(inputs, mesh, input_specs(mesh, 2)), precision=F32,
                                     implementation="xla")
  bounds.check_backward(outs, inputs, F32)
  assert_sharded_as(outs, mesh, output_specs(mesh, 2))


# ------------------------------------------------------------------------------------------
# The checks fail for a backward XLA cannot partition.

def _opaque_backward(*arrays):
  """The backward as an opaque host call: XLA sees a custom call it cannot split, as it
  sees a GPU pallas_call without custom partitioning."""
  shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in arrays[1:6]]
  return jax.pure_callback(
      lambda *a: reference.mlp_backward(*a, precision="highest"), shapes, *arrays)


def test_hlo_checks_flag_unpartitioned_kernels():
  mesh = make_mesh(2, 1)
  inputs = _inputs(None)
  specs = input_specs(mesh, 2)
  sharded = put(inputs, mesh, specs)
  allowed = gradient_blocks(mesh, inputs, specs)

  # An opaque kernel: XLA all-gathers the activations to run it.
  hlo = jax.jit(_opaque_backward).lower(*sharded).compile().as_text()
  gathered = moved_activations(hlo, mesh, inputs, specs)
  assert any(op == "all-gather" and (TOKENS, HIDDEN) in shapes for op, shapes, _ in gathered)
  assert any(op == "all-gather" and (TOKENS, INTERMEDIATE) in shapes for op, shapes, _ in gathered)
  with pytest.raises(AssertionError, match="activations gathered"):
    assert_no_activation_traffic(hlo, mesh, inputs, specs)

  # The interpret-mode kernels without custom partitioning: XLA partitions the
  # emulated loads as gathers from sharded operands, i.e. all-reduces of tiles.
  naive = jax.jit(functools.partial(sharding.local_mlp_backward, DotMode.F32, "triton"))
  hlo = naive.lower(*sharded).compile().as_text()
  assert unexpected_collectives(hlo, allowed)

  # The same kernels through the public API pass both checks.
  public = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward, precision=F32,
                                     implementation="triton"))
  assert_no_activation_traffic(public.lower(*sharded).compile().as_text(), mesh, inputs, specs)


@pytest.mark.skipif(not helpers.cuda_lowering_without_gpu(),
                    reason="this JAX cannot lower for CUDA without a GPU")
def test_per_device_body_lowers_to_triton_for_cuda(monkeypatch):
  """What XLA compiles per device on a GPU: the partition rule's body for a 2-D mesh at
  ViT-H size, lowered for CUDA on this CPU (real Triton lowering, not interpret mode)."""
  from vision_mlp_bwd.backends import triton as triton_backend
  monkeypatch.setattr(triton_backend.BACKEND, "backward",
                      lambda *args: triton_backend.backward(*args, interpret=False))
  mesh = make_mesh(2, 4)
  s, h, i = 1024, 1280, 3584
  shapes = [(s, h), (s, h), (i, h), (i,), (h, i), (h,), (s, i), (s, i)]
  specs = input_specs(mesh, 2)
  typed = lambda shape, spec: jax.ShapeDtypeStruct(shape, jnp.float32,
                                                   sharding=NamedSharding(mesh, spec))
  args = tuple(map(typed, shapes, specs))
  results = tuple(map(typed, shapes[1:6], output_specs(mesh, 2)))
  part_mesh, per_device, result_shardings, arg_shardings = sharding._partition(
      DotMode.TF32, "triton", None, mesh, args, results)
  body = jax.shard_map(per_device, mesh=part_mesh,
                       in_specs=tuple(a.spec for a in arg_shardings),
                       out_specs=tuple(r.spec for r in result_shardings), check_vma=False)
  text = jax.jit(body).trace(*[jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes]).lower(
      lowering_platforms=("cuda",)).as_text()
  assert "__gpu$xla.gpu.triton" in text
  assert "all_reduce" in text and "all_gather" not in text


# ------------------------------------------------------------------------------------------
# Gradients of vision_mlp: a training step under jit, with a user's shard_map, under vmap.

def _params(key=None):
  k = jax.random.split(helpers.fresh_key() if key is None else key, 4)
  return (jax.random.normal(k[0], (INTERMEDIATE, HIDDEN)) * HIDDEN ** -0.5,
          jax.random.normal(k[1], (INTERMEDIATE,)) * 0.1,
          jax.random.normal(k[2], (HIDDEN, INTERMEDIATE)) * INTERMEDIATE ** -0.5,
          jax.random.normal(k[3], (HIDDEN,)) * 0.1)


def _loss(params, x, cotangent, implementation):
  """A linear loss: its cotangent reaches the backward exactly, so the float64 gradient with
  the forward's own errors (`bounds.gradient_oracle_and_bounds`) is the oracle."""
  y = vision_mlp_bwd.vision_mlp(x, *params, precision=F32, implementation=implementation)
  return jnp.sum(y * cotangent)


_grad = jax.grad(_loss, argnums=(0, 1))


def _cotangent(x):
  return jax.random.normal(helpers.fresh_key(), x.shape)


def _check_grads(got, params, x, cotangent, label="", keep=(0, 1, 2, 3, 4)):
  """(param grads, x grad) within their bounds of the float64 gradient; `keep` picks the five
  gradients (hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias) compared."""
  oracle, limits = bounds.gradient_oracle_and_bounds(cotangent, x, params, F32)
  grads = (got[1], *got[0])
  pick = lambda t: [t[i] for i in keep]
  bounds.assert_within_bounds(pick(grads), pick(oracle), pick(limits), jnp.float32, label,
                              names=pick(helpers.OUT_NAMES))


@pytest.mark.parametrize("implementation,data,model,axis_type",
                         [("xla", 4, 2, "auto"), ("triton", 2, 4, "auto"),
                          ("triton", 2, 4, "explicit")], ids=str)
def test_grad_of_vision_mlp_under_jit(implementation, data, model, axis_type):
  if axis_type == "auto":
    mesh = make_mesh(data, model)
  else:  # jax.make_mesh's default: sharding in types
    mesh = jax.make_mesh((data, model), ("data", "model"),
                         axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  params, x = _params(), jax.random.normal(helpers.fresh_key(), BATCH + (HIDDEN,))
  cotangent = _cotangent(x)
  _check_grads(_grad(params, x, cotangent, "xla"), params, x, cotangent, "unsharded xla")
  param_specs = sharding.tensor_parallel_specs("model")
  sharded_params = tuple(put(params, mesh, param_specs))
  sharded_x, sharded_c = (jax.device_put(t, NamedSharding(mesh, P("data")))
                          for t in (x, cotangent))
  step = jax.jit(_grad, static_argnums=3)
  got = step(sharded_params, sharded_x, sharded_c, implementation)
  _check_grads(got, params, x, cotangent, f"{implementation} data={data} model={model}")
  for g, spec in zip(got[0], param_specs):
    assert g.sharding.is_equivalent_to(NamedSharding(mesh, spec), g.ndim), (g.sharding, spec)
  # The forward's fc1_output / gelu_output are residuals [80 / data, 96 / model].
  rows = jax.ShapeDtypeStruct((math.prod(BATCH), INTERMEDIATE), jnp.float32)
  arrays = (x, x, *params, rows, rows)   # only their shapes are read
  specs = (P("data"), P("data"), *param_specs, P("data", "model"), P("data", "model"))
  hlo = step.lower(sharded_params, sharded_x, sharded_c, implementation).compile().as_text()
  # fc2 is row-parallel, so the forward sums its output over `model` (grad_hidden_state's shape).
  assert_no_activation_traffic(hlo, mesh, arrays, specs, extra={()})


def test_inside_shard_map_data_parallel():
  """Per-device calls in a user's shard_map: with check_vma (the default) JAX's autodiff sums
  the replicated weights' gradients, as for any jnp code; without it the user does."""
  mesh = make_mesh(8, 1)
  params, x = _params(), jax.random.normal(helpers.fresh_key(), BATCH + (HIDDEN,))
  cotangent = _cotangent(x)
  checked = jax.shard_map(lambda p, x, c: _grad(p, x, c, "xla")[0], mesh=mesh,
                          in_specs=(P(), P("data"), P("data")), out_specs=P())
  weights_only = (1, 2, 3, 4)
  _check_grads((jax.jit(checked)(params, x, cotangent), None), params, x, cotangent,
               "checked", keep=weights_only)
  unchecked = jax.shard_map(lambda p, x, c: jax.lax.psum(_grad(p, x, c, "xla")[0], "data"),
                            mesh=mesh, in_specs=(P(), P("data"), P("data")), out_specs=P(),
                            check_vma=False)
  _check_grads((jax.jit(unchecked)(params, x, cotangent), None), params, x, cotangent,
               "unchecked", keep=weights_only)


def test_in_shard_map_tells_manual_axes():
  """The Triton backend keeps its Triton launch 1 inside a shard_map (Config.mosaic_launch_1)."""
  mesh = make_mesh(8, 1)
  x = jnp.ones((16, 4))
  assert not sharding.in_shard_map(x)
  seen = []

  def body(x, w):
    seen.append((sharding.in_shard_map(x), sharding.in_shard_map(w)))
    return x
  jax.shard_map(body, mesh=mesh, in_specs=(P("data"), P()), out_specs=P("data"))(x, x)
  assert seen == [(True, False)]


def test_inside_shard_map_tensor_parallel():
  """Megatron by hand: the user sums the row-parallel fc2 output over `model`; the psum's
  transpose makes grad_hidden_state whole."""
  mesh = make_mesh(1, 4)
  params, x = _params(), jax.random.normal(helpers.fresh_key(), (16, HIDDEN))
  cotangent = _cotangent(x)

  def local(params, x, c):
    def loss(params, x):
      y = vision_mlp_bwd.vision_mlp(x, *params, precision=F32, implementation="xla")
      return jnp.sum(jax.lax.psum(y, "model") * c)
    return jax.grad(loss, argnums=(0, 1))(params, x)

  specs = sharding.tensor_parallel_specs("model")
  tp = jax.shard_map(local, mesh=mesh, in_specs=(specs[:3] + (P(),), P(), P()),
                     out_specs=((*specs[:3], P()), P()))
  got = jax.jit(tp)(params, x, cotangent)
  # fc2_bias is added on every model shard before the psum here, so its gradient is a sum
  # over the shards, not the unsharded one; the other four are (the loss is linear, so the
  # extra bias in the forward changes no gradient).
  _check_grads(got, params, x, cotangent, "tensor parallel", keep=(0, 1, 2, 3))


def test_mlp_backward_inside_shard_map_gives_per_device_sums():
  """2-D mesh, kernels per device; the user sums weight gradients over `data` and
  grad_hidden_state over `model`."""
  mesh = make_mesh(2, 2)
  inputs = _inputs(None)
  specs = input_specs(mesh, 2)

  def step(*arrays):
    grad_hidden, *weight_grads = vision_mlp_bwd.mlp_backward(*arrays, precision=F32,
                                                            implementation="triton")
    return jax.lax.psum(grad_hidden, "model"), *jax.lax.psum(weight_grads, "data")

  # check_vma=False: JAX cannot infer that these hand-placed psums replicate what the
  # out_specs say; test_triton_inside_shard_map_with_check_vma covers the checked mode.
  run = jax.shard_map(step, mesh=mesh, in_specs=specs, out_specs=output_specs(mesh, 2),
                      check_vma=False)
  outs = jax.jit(run)(*inputs)
  bounds.check_backward(outs, inputs, F32)


def test_triton_inside_shard_map_with_check_vma():
  mesh = make_mesh(2, 1)
  params, x = _params(), jax.random.normal(helpers.fresh_key(), (32, HIDDEN))
  cotangent = _cotangent(x)
  checked = jax.shard_map(lambda p, x, c: _grad(p, x, c, "triton")[0], mesh=mesh,
                          in_specs=(P(), P("data"), P("data")), out_specs=P())
  _check_grads((jax.jit(checked)(params, x, cotangent), None), params, x, cotangent,
               "triton in shard_map", keep=(1, 2, 3, 4))


def test_vmap_and_jvp_still_work():
  """custom_partitioning has no vmap or JVP rule; mlp_backward falls back to the per-device
  function there."""
  inputs = helpers.backward_inputs(None, 16, 24, batch=(3, 5))
  run = functools.partial(vision_mlp_bwd.mlp_backward, precision=F32, implementation="xla")
  per_row = lambda go, x, f, g: run(go, x, *inputs[2:6], f, g)
  batched = jax.vmap(per_row)(inputs[0], inputs[1], inputs[6], inputs[7])
  for i in range(3):
    row = (inputs[0][i], inputs[1][i], *inputs[2:6], inputs[6][i], inputs[7][i])
    oracle, limits = bounds.check_backward(per_row(*row[:2], *row[6:]), row, F32, f"row {i}")
    bounds.assert_within_bounds([b[i] for b in batched], oracle, limits, jnp.float32,
                                f"vmapped row {i}")
  primal, tangent = jax.jvp(lambda x: run(*inputs[:1], x, *inputs[2:])[1], (inputs[1],),
                            (jnp.ones_like(inputs[1]),))
  # grad_fc1_weight is linear in hidden_state: its tangent along ones is pre.T @ ones.
  along_ones = (inputs[0], jnp.ones_like(inputs[1]), *inputs[2:])
  for value, arrays, label in ((primal, inputs, "primal"), (tangent, along_ones, "tangent")):
    oracle, limits = bounds.backward_oracle_and_bounds(arrays, F32)
    bounds.assert_within_bounds([value], oracle[1:2], limits[1:2], jnp.float32, label,
                                names=("grad_fc1_weight",))
