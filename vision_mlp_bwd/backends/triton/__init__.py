"""The Pallas-Triton backend: the backward as four tiled products in two launches.

Launch 1: `grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output)`
(GELU derivative fused into the epilogue) beside `grad_fc2_weight =
grad_output.T @ gelu_output` (with `grad_fc2_bias` summed from the same tiles).
Launch 2: `grad_hidden_state = grad_fc1_output @ fc1_weight` beside
`grad_fc1_weight = grad_fc1_output.T @ hidden_state` (with `grad_fc1_bias`).
The input gradient's contraction (K = I) is split; its partials are summed
after launch 2 or, with `Config.sum_splits_in_kernel`, by the last program of
each tile (counters zeroed in launch 1).
16-bit modes may cast the fp32 activations first (`Config.cast_inputs`), in
XLA or, with `Config.fused_casts`, as Pallas jobs: one launch before launch 1
for `grad_output` and `gelu_output`, and `hidden_state` inside launch 1.
On Hopper, 16-bit modes may run launch 1 as one Mosaic GPU grid instead
(`Config.mosaic_launch_1`, `launch_1_sm90.launch_1`); the casts launch then also
casts `hidden_state` and zeroes the counters, and launch 2 sums `grad_fc2_bias`.
In 32-bit modes the weight gradients may read K-major copies of their right
operands (`Config.k_major_weight_grads`). TF32 may instead run every product on f16 tensor cores with exact
power-of-two scales (`Config.tf32_on_f16`, `_backward_on_f16`: a casts
launch, then the same two launches).

On a CPU the same kernels run in Pallas interpret mode (slow; for tests).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from vision_mlp_bwd.backends.mosaic import launch_1_sm90
from vision_mlp_bwd.backends.shared import in_shard_map
from vision_mlp_bwd.backends.triton.config import (
    Config, TileConfig, default_config, interpret_config, triton_wins)
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.staging import Cast, Scales, Zeros
from vision_mlp_bwd.backends.triton.kernels import Product
from vision_mlp_bwd.precision import DotMode
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
  del fc1_bias, fc2_bias  # not read
  if config is None:
    config = interpret_config(problem) if interpret else default_config(problem)
  operand_dtype = problem.mode.operand_dtype
  out_dtype = problem.dtype  # every input has it, so every gradient does
  def launch(jobs, name):
    """Runs (job, operands) pairs grouped in one launch."""
    return staging.launch(jobs, mode=problem.mode, interpret=interpret, name=name)

  if config.tf32_on_f16 and problem.mode == DotMode.TF32 and problem.dtype == jnp.float32:
    return _backward_on_f16(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                            gelu_output, config, launch)
  acts = dict(grad_output=grad_output, gelu_output=gelu_output, hidden_state=hidden_state)
  # Launch 1 as one Mosaic GPU grid (Config.mosaic_launch_1), where it can run;
  # not yet inside a shard_map (its manual-axis typing is untested there).
  mosaic = (config.launch_1_on_mosaic and operand_dtype is not None and out_dtype == jnp.float32
            and launch_1_sm90.unsupported_reason(problem, interpret) is None
            and not in_shard_map(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                                 gelu_output))
  early, late = [], []   # activations cast by Pallas jobs before launch 1 / inside launch 1
  # 16-bit inputs in the operand dtype are read as they are: nothing to cast.
  if operand_dtype is not None and config.cast_inputs and problem.dtype != operand_dtype:
    if not config.fused_casts:
      acts = {name: x.astype(operand_dtype) for name, x in acts.items()}
    elif mosaic:   # no Triton launch 1 to cast hidden_state
      early = list(acts)
    else:
      early, late = ["grad_output", "gelu_output"], ["hidden_state"]
  if operand_dtype is not None and config.cast_weights:
    fc1_weight, fc2_weight = fc1_weight.astype(operand_dtype), fc2_weight.astype(operand_dtype)
  # The pre-GELU gradient is only ever a matmul operand: 16-bit modes store it
  # in their operand dtype, which halves its traffic and rounds it as the
  # products would anyway.
  pre_dtype = jnp.dtype(operand_dtype or jnp.float32)

  def by_weight(tile, dtype, x, weight, gelu_input=None, counters=None):
    """`x @ weight` (M=S) as a job.

    `x` may be a shape only, for the Product alone; `counters` are its arrival
    counters (`Product.sum_splits_in_kernel`)."""
    (m, k), n = getattr(x, "shape", x), weight.shape[1]
    extra = tuple(e for e in (gelu_input, counters) if e is not None)
    return (Product(m, n, k, tile, dtype, fuse_gelu=gelu_input is not None,
                    sum_splits_in_kernel=config.sum_splits_in_kernel), (x, weight, *extra))

  def weight_grad(g, z, tile):
    """`g.T @ z` over the S rows, with the column sums of `g` (a bias gradient)."""
    (k, m), n = g.shape, z.shape[1]
    if config.k_major_weight_grads:
      return (Product(m, n, k, tile, out_dtype, transpose_a=True, transpose_b=True,
                      row_sums=True, lhs_in_registers=True), (g, z.T))
    return Product(m, n, k, tile, out_dtype, transpose_a=True, row_sums=True), (g, z)

  # Launch 2's split input gradient may count arrivals in counters zeroed before.
  input_grad_product, _ = by_weight(config.input_grad, out_dtype, fc1_output.shape, fc1_weight)
  counters = [(Zeros(input_grad_product.tiles), ())] if input_grad_product.counts_arrivals else []
  if early:
    padded = launch_1_sm90.padded_rows(problem.tokens) if mosaic else 0
    jobs = [(Cast(acts[n].shape, operand_dtype, rows=0 if n == "hidden_state" else padded),
             (acts[n],)) for n in early]
    if mosaic:   # Triton's launch 1 would zero them
      jobs += counters
    outs = launch(jobs, "mlp_backward_casts")
    acts.update(zip(early, outs))
    zeroed = outs[len(early):]   # the counters, if any
  # Launch 1 needs only inputs; launch 2 needs the pre-GELU gradient of launch 1
  # (and the zeroed arrival counters of its split input gradient, if any).
  if mosaic:
    grad_pre, grad_fc2_weight = launch_1_sm90.launch_1(acts["grad_output"], fc2_weight, fc1_output,
                                                    acts["gelu_output"])
  else:
    grad_pre, (grad_fc2_weight, grad_fc2_bias), *rest = launch([
        by_weight(config.pre_activation, pre_dtype, acts["grad_output"], fc2_weight,
                  fc1_output),
        weight_grad(acts["grad_output"], acts["gelu_output"], config.weight_grads),
        *[(Cast(acts[n].shape, operand_dtype), (acts[n],)) for n in late],
        *counters,
    ], "mlp_backward_1")
    acts.update(zip(late, rest))
    zeroed = rest[len(late):]
  # Triton's launch 1 sums grad_output's columns in grad_fc2_weight's programs;
  # with the Mosaic one, a job of launch 2 does.
  fc2_bias_job = [(_over_columns(grad_output.shape, sums=True), (grad_output,))] if mosaic else []
  grad_hidden_state, (grad_fc1_weight, grad_fc1_bias), *column_sums = launch([
      by_weight(config.input_grad, out_dtype, grad_pre, fc1_weight,
                counters=zeroed[0] if counters else None),
      weight_grad(grad_pre, acts["hidden_state"], config.weight_grads),
      *fc2_bias_job,
  ], "mlp_backward_2")
  if mosaic:   # the Scales job's (column maxima, column sums [1, H])
    _, (grad_fc2_bias,) = column_sums[0]
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias.astype(out_dtype),
          grad_fc2_weight, grad_fc2_bias.astype(out_dtype))


def _over_columns(shape, **options):
  """A `Scales` job over the columns of `shape`, all rows in one step up to 256 (a chain of
  steps is slower)."""
  return Scales(shape, axis=0, step=min(pl.next_power_of_2(shape[0]), 256), **options)


def _backward_on_f16(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output, gelu_output,
                     config: Config, launch):
  """The TF32 backward with every product on f16 tensor cores (`Config.tf32_on_f16`).

  Each product's operands are scaled by powers of two per output row and
  column (`precision.f16_scale`), so f16 holds their TF32 roundings. Launch 0
  casts `grad_output` (by columns for grad_fc2_weight and, with
  `Config.cast_inputs`, by rows for the pre-activation product, which
  otherwise converts it itself) and `gelu_output`, each scaled by its
  measured maxima.
  The weights' scales are speculated and checked in the products
  (`Product.speculate_b`). The pre-activation product reports its output's
  row maxima for the input gradient and writes an f16 copy for
  grad_fc1_weight, scaled by a bound it knows (`Product.f16_outputs`).
  """
  (s, h), i = grad_output.shape, gelu_output.shape[1]
  f32 = jnp.dtype(jnp.float32)

  def cast_over(shape, axis):   # the scaled f16 cast, per column (axis 0) or row (axis 1)
    if axis == 0:
      return _over_columns(shape, cast=True)
    return Scales(shape, axis=1, cast=True, block=4,
                  step=min(pl.next_power_of_2(shape[1]), 2048))

  counters = []
  input_grad = Product(s, h, i, config.input_grad, f32, scaled_f16=True, speculate_b=True,
                       sum_splits_in_kernel=config.sum_splits_in_kernel)
  if input_grad.counts_arrivals:
    counters = [(Zeros(input_grad.tiles), ())]
  # grad_output by rows: cast (Config.cast_inputs), or only its maxima, in parts.
  by_rows = (cast_over((s, h), 1) if config.cast_inputs else
             Scales((s, h), axis=1, parts=pl.cdiv(h, 128), step=128))
  (g_col_max, g_by_col, g_sums), (g_row_max, *g_by_row), (gelu_max, gelu16), *zeros = launch([
      (dataclasses.replace(cast_over((s, h), 0), sums=True), (grad_output,)),
      (by_rows, (grad_output,)),
      (cast_over((s, i), 0), (gelu_output,)),
      *counters,
  ], "mlp_backward_casts")
  pre, grad_fc2_weight, (x_max, x16) = launch([
      (Product(s, i, h, config.pre_activation, f32, fuse_gelu=True, scaled_f16=True,
               speculate_b=True, f16_outputs=True),
       ((g_by_row or [grad_output])[0], fc2_weight, g_row_max, g_col_max, fc1_output)),
      (Product(h, i, s, config.weight_grads, f32, transpose_a=True, scaled_f16=True),
       (g_by_col, gelu16, g_col_max, gelu_max)),
      (cast_over((s, h), 0), (hidden_state,)),
  ], "mlp_backward_1")
  grad_pre, pre_row_max, pre_col_sums, pre16, pre16_bound = pre
  grad_hidden_state, grad_fc1_weight, (_, grad_fc1_bias) = launch([
      (input_grad, (grad_pre, fc1_weight, pre_row_max, *zeros)),
      (Product(i, h, s, config.weight_grads, f32, transpose_a=True, scaled_f16=True),
       (pre16, x16, pre16_bound, x_max)),
      (Scales(pre_col_sums.shape, axis=0, sums=True, block=128, step=pl.next_power_of_2(pre_col_sums.shape[0])),
       (pre_col_sums,)),   # the bias gradient: the sum of the partial sums
  ], "mlp_backward_2")
  return grad_hidden_state, grad_fc1_weight, grad_fc1_bias[0], grad_fc2_weight, g_sums[0]


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
    return platform == "gpu" and triton_wins(problem)

  def backward(self, grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
               fc1_output, gelu_output, problem: Problem):
    return backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                    fc1_output, gelu_output, problem, interpret=jax.default_backend() != "gpu")


BACKEND = TritonBackend()
