"""The backward on the GEMM engine: four engine products, the GELU derivative between them.

On 16-bit products only (F16 or BF16 on fp32 inputs, any precision on bf16
and f16 inputs, as `precision.for_inputs` says): the operands are cast to the
product dtype (nothing to do on 16-bit inputs), the four products run in the
layouts the operands arrive in. The first, `grad_output @ fc2_weight`,
applies the reference's GELU derivative in its epilogue (`fc1_output` tiles
arrive by TMA while its MMAs run), stores the pre-GELU gradient once, in the
product dtype the other two products read, and sums its columns into the
bias gradient: of the fp32 values on fp32 inputs, of the stored values on
16-bit inputs, as `reference.pre_gelu_operand_and_bias_grad` does. On
16-bit inputs the epilogue first rounds `grad_output @ fc2_weight` to the
input dtype, as `jnp.matmul` returns it. Numerically it is the XLA backward
with another fp32 accumulation order.

The engine's TMA copies need rows in whole groups of 8; for other S the
S-row operands are padded with zero rows (which add nothing to any sum:
gelu'(0) times a zero row is zero) and the input gradient is cut back.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax.numpy as jnp

from vision_mlp_bwd import reference
from vision_mlp_bwd.backends.mosaic import engine
from vision_mlp_bwd.backends.mosaic.tiles import padded_rows
from vision_mlp_bwd.problem import Problem

CONFIG_FILE = pathlib.Path(__file__).parent / "configs" / "h200.json"


@dataclasses.dataclass(frozen=True)
class Tables:
  """The engine configuration of each product by S: (largest S or None, GemmConfig) rows.

  `pre_gelu`: grad_output @ fc2_weight with the fused epilogue; `rows`: the
  input gradient (M = S); `weight_grads`: the two products over S."""

  pre_gelu: dict[str, tuple[tuple[int | None, engine.GemmConfig], ...]]
  rows: dict[str, tuple[tuple[int | None, engine.GemmConfig], ...]]
  weight_grads: dict[str, tuple[tuple[int | None, engine.GemmConfig], ...]]
  routing: dict

  @classmethod
  def load(cls, path=CONFIG_FILE) -> "Tables":
    document = json.loads(pathlib.Path(path).read_text())
    parse = lambda rows: tuple((bound, engine.GemmConfig(**{
        k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}))
        for bound, fields in rows)
    tables = document["tables"]
    return cls(*({name: parse(t[product]) for name, t in tables.items()}
                  for product in ("pre_gelu", "rows", "weight_grads")), document["routing"])

  def configs(self, problem: Problem) -> tuple[engine.GemmConfig, ...]:
    """The (pre-GELU, input gradient, weight gradients) products' configs for this problem."""
    inputs = "sixteen_bit_inputs" if problem.dtype.itemsize == 2 else "fp32_inputs"
    pick = lambda rows: next(c for bound, c in rows if bound is None or problem.tokens <= bound)
    return tuple(pick(table[inputs]) for table in (self.pre_gelu, self.rows, self.weight_grads))


TABLES = Tables.load()


def backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output,
             gelu_output, problem: Problem, tables: Tables = TABLES):
  """The five gradients for 2-D activations `[S, ·]`, with the engine's products."""
  del fc1_bias, fc2_bias   # only their dtypes matter: every gradient is in the input dtype
  mode, dtype, tokens = problem.mode, problem.dtype, problem.tokens
  operand = mode.operand_dtype
  pre_config, rows_config, weight_config = tables.configs(problem)
  padded = padded_rows(tokens)

  def rows_operand(x):
    x = x.astype(operand)
    return x if padded == tokens else jnp.pad(x, ((0, padded - tokens), (0, 0)))

  grad_out16, hidden16, gelu16 = map(rows_operand, (grad_output, hidden_state, gelu_output))
  grad_fc2_bias = jnp.sum(grad_output.astype(jnp.float32), axis=0)
  grad_fc2_weight = engine.matmul(grad_out16, gelu16, transpose_a=True, out_dtype=dtype,
                                  config=weight_config)
  sixteen_bit = jnp.dtype(dtype).itemsize == 2
  pre_gelu = ((lambda acc, x: reference.gelu_backward(acc.astype(dtype), x)) if sixteen_bit
              else reference.gelu_backward)
  grad_pre16, grad_fc1_bias = engine.matmul(
      grad_out16, fc2_weight.astype(operand), out_dtype=operand, config=pre_config,
      epilogue=pre_gelu, epilogue_operand=fc1_output,
      column_sums="stored" if sixteen_bit else "unrounded", approx_math=True)
  grad_fc1_weight = engine.matmul(grad_pre16, hidden16, transpose_a=True, out_dtype=dtype,
                                  config=weight_config)
  grad_hidden_state = engine.matmul(grad_pre16, fc1_weight.astype(operand), out_dtype=dtype,
                                    config=rows_config)[:tokens]
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias.astype(dtype), grad_fc2_weight,
          grad_fc2_bias.astype(dtype))
