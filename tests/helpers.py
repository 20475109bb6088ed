"""Inputs, float64 oracles and checks shared by the test modules.

Inputs are fresh random draws (`fresh_key`: a new key per call), never zeros; the error
model and the chex check against it are in `tests/bounds.py`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json

import chex
import jax
import jax.numpy as jnp
import numpy as np

from tests import bounds
from vision_mlp_bwd.problem import BACKWARD_ARGS as ARG_NAMES, GRADIENTS as OUT_NAMES

_seeds = itertools.count(1234)


def with_pre_gelu(tables, inputs: str, config):
  """`tables` with `config` as the fused product's config for `inputs` at every S."""
  return dataclasses.replace(tables, pre_gelu={**tables.pre_gelu, inputs: ((None, config),)})


def copy_warpgroup_tables(tokens: int, tables=None):
  """`tables` (default: the Mosaic backward's default tables), with the fused product's
  config on fp32 inputs at S=`tokens` (ping-pong, with copy programs) making its side
  copies by a fourth, copy warpgroup of every program instead
  (`GemmConfig.copy_warpgroup`; 4 ring stages, so the copier's buffers fit beside them)."""
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  tables = tables or backward_sm90.TABLES
  config = tables.config_for(tables.pre_gelu, "fp32_inputs", tokens)
  assert config.ping_pong and config.copy_programs, config
  return with_pre_gelu(tables, "fp32_inputs", dataclasses.replace(
      config, stages=4, copy_programs=0, copy_warpgroup=True))


def tf32_ping_pong_tables(tokens: int, tables=None, copy_warpgroup: bool = False):
  """`tables` (default: the Mosaic backward's default tables), with DEFAULT's fused product
  (its scales, line maxima and speculated copies) at S=`tokens` run ping-pong: the tile,
  ring and pieces of the fp32 inputs' ping-pong row, its own copy programs kept, or with
  `copy_warpgroup` its scaled side copies made by a copy warpgroup (4 ring stages)."""
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  tables = tables or backward_sm90.TABLES
  ping_pong = tables.config_for(tables.pre_gelu, "fp32_inputs", 1 << 30)
  assert ping_pong.ping_pong, ping_pong
  config = dataclasses.replace(
      ping_pong, copy_programs=tables.config_for(tables.pre_gelu, "tf32_on_f16",
                                                 tokens).copy_programs)
  if copy_warpgroup:
    config = dataclasses.replace(config, stages=4, copy_programs=0, copy_warpgroup=True)
  return with_pre_gelu(tables, "tf32_on_f16", config)


def mosaic_backward_fn(tables, inputs, precision):
  """(the Mosaic backward of `inputs`' shapes under `precision` with `tables` in place of
  this GPU's, jitted; its `Problem`)."""
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from vision_mlp_bwd.precision import canonicalize
  from vision_mlp_bwd.problem import check_backward_args
  problem = check_backward_args(*inputs, canonicalize(precision))
  return jax.jit(lambda *a: backward_sm90.backward(*a, problem=problem, tables=tables)), problem


def fresh_key():
  """A new PRNG key per call, so every check sees different inputs."""
  return jax.random.key(next(_seeds))


def fresh_seed() -> int:
  """A new integer seed per call (for `nnx.Rngs` and the like)."""
  return next(_seeds)


def backward_inputs(tokens, hidden, intermediate, dtype=jnp.float32, key=None, batch=None):
  """Random inputs drawn as SOL-ExecBench draws them (N(0,1), weights / sqrt(fan_in))."""
  key = fresh_key() if key is None else key
  lead = tuple(batch) if batch is not None else (tokens,)
  k = jax.random.split(key, 8)
  normal = lambda i, shape, scale=1.0: (jax.random.normal(k[i], shape) * scale).astype(dtype)
  return (
      normal(0, lead + (hidden,)),
      normal(1, lead + (hidden,)),
      normal(2, (intermediate, hidden), hidden ** -0.5),
      normal(3, (intermediate,)),
      normal(4, (hidden, intermediate), intermediate ** -0.5),
      normal(5, (hidden,)),
      normal(6, lead + (intermediate,)),
      normal(7, lead + (intermediate,)),
  )


def off_the_speculated_scale(inputs):
  """`backward_inputs` with lines outside `precision.SPECULATED_SCALE`'s window:
  grad_output wholly below it (a loss gradient's magnitude, which its speculated scale
  follows, `precision.speculated_scale`) but for its middle row, 2^16 above the rest;
  column 5 of hidden_state, fc1_weight, fc2_weight and gelu_output below the window,
  and the middle row of hidden_state too; and one element of hidden_state, fc1_weight
  and gelu_output 2^14 above it, outside the samples the scales follow (their first 8
  rows and 128 columns), whose column the speculated scale would overflow."""
  inputs = list(inputs)
  middle = inputs[0].shape[0] // 2
  inputs[0] = (inputs[0] * 2.0 ** -24).at[middle].multiply(2.0 ** 16)
  for j in (1, 2, 4, 7):
    inputs[j] = inputs[j].at[:, 5].multiply(2.0 ** -16)
  inputs[1] = inputs[1].at[middle].multiply(2.0 ** -20)
  for j in (1, 2, 7):   # hidden_state, fc1_weight, gelu_output
    row, col = inputs[j].shape[0] - 1, inputs[j].shape[1] - 1
    inputs[j] = inputs[j].at[row, col].set(2.0 ** 14)
  return tuple(inputs)


def backward_float64(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                     fc1_output, gelu_output, operand=None):
  """The contract's five formulas in NumPy float64 (GELU derivative included): the oracle.

  `operand`, if given, maps each fp32 matmul operand first (the pre-GELU gradient rounded to
  fp32 before), e.g. `tf32_operand` for exact TF32 products. The numerics tests take the
  oracle with its bounds from `bounds.backward_oracle_and_bounds`; this is the bare oracle.
  """
  f = lambda x: np.asarray(x).astype(np.float64)
  dy, hs, w1, w2, x, a = map(f, (grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                                gelu_output))
  dy, hs, x, a = (t.reshape(-1, t.shape[-1]) for t in (dy, hs, x, a))
  op = (lambda t: operand(t.astype(np.float32))) if operand else (lambda t: t)
  grad_pre = (op(dy) @ op(w2)) * bounds.gelu_grad64(x)
  return ((op(grad_pre) @ op(w1)).reshape(np.shape(hidden_state)), op(grad_pre).T @ op(hs),
          grad_pre.sum(0), op(dy).T @ op(a), dy.sum(0))


def tf32_operand(x):
  """fp32 `x` rounded to TF32 as the tensor cores take it (ties away), in float64."""
  from vision_mlp_bwd.precision import round_to_tf32
  return np.asarray(round_to_tf32(jnp.asarray(x, jnp.float32)), np.float64)


def forward_float64(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  f = lambda x: np.asarray(x).astype(np.float64)
  x = f(hidden_state) @ f(fc1_weight).T + f(fc1_bias)
  return bounds.gelu64(x) @ f(fc2_weight).T + f(fc2_bias)


def relative_error(out, ref):
  """‖out − ref‖ / ‖ref‖ (Frobenius), in float64."""
  out = np.asarray(out).astype(np.float64)
  ref = np.asarray(ref).astype(np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def assert_close_to_oracle(outs, oracle, tolerance, label=""):
  """chex: shapes and finiteness, then each output within `tolerance` relative Frobenius
  error of the oracle (`bounds.relative_frobenius_tolerance`: where it says more than the
  elementwise bound)."""
  assert len(outs) == len(oracle) == 5
  chex.assert_tree_all_finite(tuple(outs), custom_message=f"{label}: unwritten or NaN")
  bounds.assert_relative_frobenius(outs, oracle, tolerance, label)


def cuda_lowering_without_gpu() -> bool:
  """Whether this JAX lowers for CUDA on a machine without a GPU (0.10 does; 0.11 does not)."""
  if jax.default_backend() == "gpu":
    return True
  major, minor = (int(v) for v in jax.__version__.split(".")[:2])
  return (major, minor) < (0, 11)


def check_backward(inputs, label="", precision=None, implementation="triton", **kwargs):
  """Runs `mlp_backward` (the Triton kernels by default) and holds it to the float64 oracle
  (`bounds.check_backward`: every element within its bound, the relative Frobenius error
  within its tolerance where there is one). Returns the outputs."""
  import vision_mlp_bwd
  outs = vision_mlp_bwd.mlp_backward(*inputs, precision=precision,
                                     implementation=implementation, **kwargs)
  bounds.check_backward(outs, inputs, precision, label)
  return outs


def check_triton_backward(inputs, tolerance, label="", **kwargs):
  """The older check: the Triton kernels' outputs, typed like the inputs, within `tolerance`
  relative Frobenius error of the oracle. New tests use `check_backward` (the bounds)."""
  import vision_mlp_bwd
  outs = vision_mlp_bwd.mlp_backward(*inputs, implementation="triton", **kwargs)
  chex.assert_type(tuple(outs), [x.dtype for x in inputs[1:6]])
  assert_close_to_oracle(outs, backward_float64(*inputs), tolerance, label)
  return outs


def recorded_commit(path):
  """The commit a result file records about itself, or None (no record, or 'unknown')."""
  json_path = path.with_suffix(".json")
  if not json_path.exists():
    return None
  record = json.loads(json_path.read_text())
  if not isinstance(record, dict):
    return None
  commit = record.get("meta", {}).get("git_commit") or record.get("commit")
  return None if commit in (None, "unknown") else commit
