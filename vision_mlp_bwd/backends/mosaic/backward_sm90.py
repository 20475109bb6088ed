"""The backward on the GEMM engine: four products, the GELU derivative between them.

On 16-bit products (F16 or BF16 on fp32 inputs, any precision on bf16 and
f16 inputs, as `precision.for_inputs` says; TF32 below): one staging launch
(`backends/staging.py`) copies each input not yet in the product dtype (or
with S not a multiple of 8) to it, and sums grad_output's columns on the same
read (grad_fc2_bias); the four products run in the layouts the operands
arrive in. The first, `grad_output @ fc2_weight`,
applies the reference's GELU derivative in its epilogue (`fc1_output` tiles
arrive by TMA while its MMAs run), stores the pre-GELU gradient once, in the
product dtype the other two products read, and sums its columns into the
bias gradient: of the fp32 values on fp32 inputs, of the stored values on
16-bit inputs, as `reference.pre_gelu_operand_and_bias_grad` does. On
16-bit inputs the epilogue first rounds `grad_output @ fc2_weight` to the
input dtype, as `jnp.matmul` returns it. Where its config has copy programs
(fp32 inputs), the staging launch copies only grad_output and fc2_weight, and
the fused product's launch copies hidden_state, gelu_output and fc1_weight on
SMs of its own, while the rest compute its blocks (`engine.matmul`'s side
copies): the same copies, made beside the product instead of before it.
Numerically it is the XLA backward with another fp32 accumulation order. The
three plain products run on the engine or, where the tables say so (`XLA_DOT`:
cuBLAS measured faster on the H200), as XLA's dot of the same staged operands;
so may the first on fp32 inputs, its epilogue's work then one staging pass
over XLA's fp32 product (the same arithmetic, in Triton's exact exp and
division).

TF32 (DEFAULT on fp32 inputs) runs on the same f16 engine through
`precision.py`'s power-of-two scaling: each operand is scaled along the
index its product keeps (a row of A, a column of B) so that its f16 values
are its TF32 roundings, scaled; each product is unscaled afterwards
(exactly: the scales are powers of two), in the engine, which multiplies
the accumulator by the reciprocal scales. One staging launch finds the
maxima of the lines each input is scaled along (and grad_output's column
sums) on the read that writes its f16 copies, scaled by a speculated power
of two (`precision.speculated_scale`, from the input's first rows and
columns); a second reduces the maxima to the scales and the reciprocal
scales, and copies again only the tiles of lines that the speculated scale
does not fit. The pre-GELU product's epilogue then runs on unscaled values,
as on 16-bit products; its fp32 values are not stored. It writes the two f16
copies of them that the products after it read, at grad_output's speculated
scale, the bias gradient (the sums of its fp32 columns) and the largest
|value| of each row and column, from which a third staging launch checks
those copies as the second checks the inputs', computing again (in Triton,
TF32) the few tiles it rewrites. Every partial sum and
maximum is reduced by the launch after the one that leaves it: nothing runs
in XLA between the launches.

HIGHEST (and HIGH) on fp32 inputs is bf16x3, as in the Triton kernels
(`precision.split_bf16`: a b ~ a_lo b_hi + a_hi b_lo + a_hi b_hi), with the
three products of each pair made one: the staging launch writes each input's
pieces side by side (`staging.Cast(terms=...)`, the S-row inputs as
`[S, 3, C]`, the weights as `[3, K, N]`), so that one 16-bit product
contracting over (piece, line) is bf16x3's three, K three times as long, in
one fp32 accumulation. The same copy serves a product over its columns
(`[S, 3C]`) and one over its rows (`[3S, C]`): a free reshape. The products
are XLA's dots (cuBLAS on the H200); the GELU derivative, the pre-GELU
gradient's pieces and its column sums are one staging pass over XLA's fp32
product, as for the 16-bit products' "xla" row.

The engine's TMA copies need rows in whole groups of 8; for other S the
S-row operands it reads are padded with zero rows by the staging launch
(which add nothing to any sum: gelu'(0) times a zero row is zero) and the
input gradient is written with S rows (TMA drops the rest), and so is the
pre-GELU gradient where only XLA's dots read it (with hidden_state's copy
beside it); on 16-bit inputs, grad_fc2_weight as XLA's dot reads the inputs
as given. The split last waves of the three products after the first are
summed and written in one launch at the end (`engine.write_tails`).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from vision_mlp_bwd import reference
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.mosaic import engine
from vision_mlp_bwd.backends.mosaic.tiles import padded_rows
from vision_mlp_bwd.backends.shared import sum_in_order
from vision_mlp_bwd.precision import BF16X3_MODES, DotMode, xla_dot_general
from vision_mlp_bwd.problem import Problem

CONFIG_FILE = pathlib.Path(__file__).parent / "configs" / "h200.json"
# Other GPUs' files, measured on them: each file's routing pairs (input dtype, mode) and
# table entries (inputs, product) replace CONFIG_FILE's; what it leaves out keeps them.
GPU_FILES = (pathlib.Path(__file__).parent / "configs" / "h100.json",)
# Bands of rows of a scaled copy (`staging.Cast.parts`): each band loads the partial
# column maxima once, so fewer bands than a reduction's 64 (benchmarks/NOTES.md, 43).
SCALED_COPY_PARTS = 16
# The tiles of the GELU pass after XLA's pre-GELU product: the fastest of 7 tilings and
# warp counts on the H200 at S = 773, 1423 and 4096 (benchmarks/NOTES.md, 50).
PRE_GELU_PASS_BLOCK = (16, 256)


@dataclasses.dataclass(frozen=True)
class XlaDot:
  """A product as XLA's dot of the staged 16-bit operands, where that measured faster than
  the engine (on the H200 XLA runs it on cuBLAS); the config file writes it "xla". The
  same products, fp32 accumulation; the pre-GELU product's GELU derivative then runs in
  a staging pass (fp32 inputs only)."""


XLA_DOT = XlaDot()
Product = engine.GemmConfig | XlaDot


def config_fields(fields: dict) -> dict:
  """GemmConfig fields as JSON gives them, its lists made tuples."""
  return {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}


def parse_product(fields) -> Product:
  """A product's config as the config files write it: "xla", or GemmConfig's fields."""
  return XLA_DOT if fields == "xla" else engine.GemmConfig(**config_fields(fields))


@dataclasses.dataclass(frozen=True)
class Tables:
  """How each product runs, by S: (largest S or None, GemmConfig or XLA_DOT) rows.

  `pre_gelu`: grad_output @ fc2_weight with the fused epilogue (the engine, or XLA's
  dot and a staging pass on fp32 inputs); `rows`: the input gradient (M = S);
  `weight_grads`: the two products over S."""

  pre_gelu: dict[str, tuple[tuple[int | None, Product], ...]]
  rows: dict[str, tuple[tuple[int | None, Product], ...]]
  weight_grads: dict[str, tuple[tuple[int | None, Product], ...]]
  routing: dict

  @classmethod
  def load(cls, path=CONFIG_FILE, base: "Tables | None" = None) -> "Tables":
    """A config file's tables and routing; with `base`, another GPU's file over `base`:
    each (inputs, product) entry and each (input dtype, mode) routing pair it lists
    replaces base's, and what it leaves out keeps base's."""
    document = json.loads(pathlib.Path(path).read_text())
    parse = lambda rows: tuple((bound, parse_product(fields)) for bound, fields in rows)
    tables = document.get("tables", {})
    products = []
    for product in ("pre_gelu", "rows", "weight_grads"):
      entries = {} if base is None else dict(getattr(base, product))
      entries.update({name: parse(t[product]) for name, t in tables.items() if product in t})
      products.append(entries)
    routing = {} if base is None else {dtype: dict(modes) for dtype, modes in base.routing.items()}
    for dtype, modes in document["routing"].items():
      routing.setdefault(dtype, {}).update(modes)
    return cls(*products, routing)

  @staticmethod
  def rows_for(table, inputs: str):
    """A product's rows for these inputs; 'tf32_on_f16' lists only where it differs from
    'fp32_inputs'."""
    return table.get(inputs) or table["fp32_inputs"]

  @classmethod
  def config_for(cls, table, inputs: str, tokens: int) -> Product:
    """A product's config for these inputs at S = `tokens`: its first row bounding S."""
    return next(c for bound, c in cls.rows_for(table, inputs)
                if bound is None or tokens <= bound)

  def configs(self, problem: Problem) -> tuple[Product, ...]:
    """The (pre-GELU, input gradient, weight gradients) products' configs for this problem."""
    if problem.dtype.itemsize == 2:
      inputs = "sixteen_bit_inputs"
    else:
      inputs = "tf32_on_f16" if problem.mode == DotMode.TF32 else "fp32_inputs"
    configs = tuple(self.config_for(table, inputs, problem.tokens)
                    for table in (self.pre_gelu, self.rows, self.weight_grads))
    if XLA_DOT in configs and (problem.mode == DotMode.TF32 or (
        configs[0] is XLA_DOT and inputs != "fp32_inputs")):
      raise ValueError(f"the {inputs} tables give XLA's dot at S={problem.tokens} where only "
                       f"the engine runs: TF32's unscaled products, and the pre-GELU product "
                       f"on 16-bit inputs")
    return configs


TABLES = Tables.load()


def load_gpu_tables(paths=GPU_FILES, base: Tables = TABLES) -> dict[str, Tables]:
  """{device kind: tables} for the GPUs of `paths`, each file over `base` (`Tables.load`)."""
  return {json.loads(pathlib.Path(path).read_text())["gpu"]: Tables.load(path, base)
          for path in paths}


GPU_TABLES = load_gpu_tables()


def tables_for(device_kind: str) -> Tables:
  """The tables and routing measured on this GPU (`jax.Device.device_kind`), else the
  H200's."""
  return GPU_TABLES.get(device_kind, TABLES)


def routing_for(device_kind: str) -> dict:
  """Where the automatic choice takes the backend on this GPU (`tables_for`)."""
  return tables_for(device_kind).routing


def backward(grad_output, hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias, fc1_output,
             gelu_output, problem: Problem, tables: Tables | None = None,
             interpret: bool = False):
  """The five gradients for 2-D activations `[S, ·]`, with the engine's products, configured
  by `tables` (by default this GPU's, `tables_for`).

  `interpret` runs the staging launches in Pallas interpret mode (the CPU tests', which
  stand jnp in for the engine)."""
  del fc1_bias, fc2_bias   # only their dtypes matter: every gradient is in the input dtype
  tables = tables or tables_for(jax.devices()[0].device_kind)
  mode, dtype = problem.mode, problem.dtype
  operand = mode.operand_dtype
  if mode in BF16X3_MODES:
    return _bf16x3_backward(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                            gelu_output, problem, interpret)
  configs = tables.configs(problem)
  if mode == DotMode.TF32:
    return _tf32_backward(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                          gelu_output, problem, configs, interpret)
  pre_config, rows_config, weight_config = configs
  # What the engine reads by TMA has its S rows padded to whole groups of 8; XLA's dots
  # read S rows. So where both products after the fused one are XLA's, the pre-GELU
  # gradient is written with S rows (TMA drops the rest) and hidden_state's copy beside
  # it has S rows too; and grad_fc2_weight as XLA's dot of 16-bit inputs reads grad_output
  # and gelu_output as given. No operand is copied only to pad it or to cut it back.
  padded = padded_rows(problem.tokens)
  pre_rows = (problem.tokens if rows_config is XLA_DOT and weight_config is XLA_DOT
              else padded)
  inputs_for_fc2_weight = weight_config is XLA_DOT and grad_output.dtype == operand
  gelu_rows = problem.tokens if inputs_for_fc2_weight else padded
  # With copy programs (or a copy warpgroup), the fused product's launch copies the operands
  # only the products after it read (hidden_state, gelu_output, fc1_weight) beside its
  # blocks.
  side = isinstance(pre_config, engine.GemmConfig) and pre_config.copies_beside
  (grad_out16, fc2_bias_parts), hidden16, gelu16, w1, w2 = _staged_operands(
      grad_output, hidden_state, gelu_output, fc1_weight, fc2_weight, operand, problem,
      interpret, hidden_rows=pre_rows, gelu_rows=gelu_rows, staged=(0, 4) if side else None)
  side_copies = ((hidden_state, pre_rows), (gelu_output, gelu_rows),
                 (fc1_weight, fc1_weight.shape[0])) if side else ()
  (grad_pre16, fc1_bias_parts), copies = _pre_gelu_grad(
      grad_out16, w2, fc1_output, pre_config, problem, pre_rows, interpret, side_copies)
  if side:
    hidden16, gelu16, w1 = copies
  grad_fc2_weight = _weight_grad(grad_output if inputs_for_fc2_weight else grad_out16, gelu16,
                                 weight_config, problem)
  grad_fc1_weight = _weight_grad(grad_pre16, hidden16, weight_config, problem)
  grad_hidden_state = _input_grad(grad_pre16, w1, rows_config, problem)
  (grad_hidden_state, grad_fc1_weight, grad_fc2_weight, grad_fc1_bias,
   grad_fc2_bias) = engine.write_tails(
      grad_hidden_state, grad_fc1_weight, grad_fc2_weight, interpret=interpret,
      also=[(staging.SumRows(x.shape), (x,)) for x in (fc1_bias_parts, fc2_bias_parts)])
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias.astype(dtype),
          grad_fc2_weight, grad_fc2_bias.astype(dtype))


# The pieces each operand contributes, in the order of the contraction: the left operands
# (grad_output, the pre-GELU gradient) lo, hi, hi and the right ones hi, lo, hi, so that
# piece t of one meets piece t of the other (`precision.kernel_dot`'s three products).
LEFT_PIECES, RIGHT_PIECES = ("lo", "hi", "hi"), ("hi", "lo", "hi")
# Tensor cores keep a product's fp32 sum in their accumulator, which rounds toward zero:
# over the weight gradients' K = 3S terms its error grows with S (on the H200, 3.0e-5
# relative Frobenius error at S=8192, against HIGHEST's 1e-5). So those products sum S in
# chunks of at most this many rows, one product each, whose fp32 partials are added in
# order, rounding to nearest (benchmarks/NOTES.md, 54).
WEIGHT_GRAD_CHUNK = 1024


def _bf16x3_backward(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output,
                     gelu_output, problem: Problem, interpret: bool,
                     chunk: int | None = None):
  """HIGHEST's bf16x3 as XLA's dots of the inputs' pieces side by side (see the module
  docstring), fp32 inputs; the weight gradients in `weight_grad_chunks` (`chunk`: at most
  that many rows each, default `WEIGHT_GRAD_CHUNK`)."""
  tokens, bf16, pieces = problem.tokens, jnp.dtype(jnp.bfloat16), len(LEFT_PIECES)
  chunks, chunk_rows = weight_grad_chunks(tokens, chunk or WEIGHT_GRAD_CHUNK)
  rows = chunks * chunk_rows   # S, or zero rows past it to whole chunks

  def launch(jobs, name):
    return staging.launch(jobs, mode=problem.mode, interpret=interpret, name=name)

  def split(x, order, along, **options):
    return staging.Cast(x.shape, bf16, terms=order, terms_along=along, finished=False,
                        **options), (x,)

  def weight_grad(a3, b3):
    """a.T @ b over S from the pieces `[rows, 3C]`: one product per chunk of rows (as
    `[chunks, 3 chunk_rows, C]`), the fp32 partials added first to last."""
    as_chunks = lambda x3: x3.reshape(chunks, pieces * chunk_rows, -1)
    partials = xla_dot_general(as_chunks(a3), as_chunks(b3), (((1,), (1,)), ((0,), (0,))),
                               problem.mode)
    return sum_in_order(partials) if chunks > 1 else partials[0]

  # One pass over every input: its pieces, and grad_output's column sums (grad_fc2_bias) as
  # partial rows. The products wait for it (XLA would otherwise run it beside them).
  (dy3, fc2_bias_parts), x3, gelu3, w1_3, w2_3 = lax.optimization_barrier(tuple(launch(
      [split(grad_output, LEFT_PIECES, "columns", sums=True, rows=rows),
       split(hidden_state, RIGHT_PIECES, "columns", rows=rows),
       split(gelu_output, RIGHT_PIECES, "columns", rows=rows),
       split(fc1_weight, RIGHT_PIECES, "rows"),
       split(fc2_weight, RIGHT_PIECES, "rows")], "mlp_backward_staging")))
  grad_fc2_weight = weight_grad(dy3, gelu3)
  product = reference.input_grad(dy3, w2_3, problem.mode)   # grad_output @ fc2_weight
  # (its rows past S are zero, and so are gelu' times them: fc1_output reads zeros there)
  (pre3, fc1_bias_parts), grad_fc2_bias = launch(
      [(staging.Cast(product.shape, bf16, sums=True, finished=False, terms=LEFT_PIECES,
                     epilogue=reference.gelu_backward, block=PRE_GELU_PASS_BLOCK),
        (product, fc1_output)),
       (staging.SumRows(fc2_bias_parts.shape), (fc2_bias_parts,))], "mlp_backward_pre_gelu")
  grad_fc1_weight = weight_grad(pre3, x3)
  grad_hidden_state = reference.input_grad(pre3, w1_3, problem.mode)[:tokens]
  (grad_fc1_bias,) = launch([(staging.SumRows(fc1_bias_parts.shape), (fc1_bias_parts,))],
                            "mlp_backward_bias_sums")
  return grad_hidden_state, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight, grad_fc2_bias


def weight_grad_chunks(tokens: int, chunk: int) -> tuple[int, int]:
  """(chunks, rows of each) over which bf16x3's weight gradients sum S rows: as few chunks
  of at most `chunk` rows as cover S, each a whole number of groups of 8 rows."""
  chunks = pl.cdiv(tokens, chunk)
  if chunks == 1:
    return 1, tokens
  return chunks, padded_rows(pl.cdiv(tokens, chunks))


def _pre_gelu_grad(grad_out16, fc2_weight16, fc1_output, config: Product, problem: Problem,
                   out_rows: int, interpret: bool, side_copies=()):
  """((the pre-GELU gradient in the operand dtype with `out_rows` rows, its bias
  gradient's partial sums), `side_copies` made by the same launch): the engine's product
  with the GELU derivative in its epilogue, or (XLA_DOT, fp32 inputs) XLA's fp32 product
  and one staging pass that applies the derivative, stores the 16-bit copy and sums the
  fp32 columns."""
  dtype, operand = problem.dtype, problem.mode.operand_dtype
  if config is XLA_DOT:
    product = reference.input_grad(grad_out16, fc2_weight16, problem.mode)   # rows x weight
    (pass_out,) = staging.launch(
        [(staging.Cast(product.shape, jnp.dtype(operand), rows=out_rows, sums=True,
                       finished=False, epilogue=reference.gelu_backward,
                       block=PRE_GELU_PASS_BLOCK),
          (product, fc1_output))],
        mode=problem.mode, interpret=interpret, name="mlp_backward_pre_gelu")
    return pass_out, ()
  sixteen_bit = jnp.dtype(dtype).itemsize == 2
  pre_gelu = ((lambda acc, x: reference.gelu_backward(acc.astype(dtype), x)) if sixteen_bit
              else reference.gelu_backward)
  result = engine.matmul(
      grad_out16, fc2_weight16, out_dtype=operand, config=config,
      epilogue=pre_gelu, epilogue_operand=fc1_output,
      column_sums="stored" if sixteen_bit else "unrounded", approx_math=True,
      partial_reductions=True, out_rows=out_rows, side_copies=side_copies)
  return (result, ()) if not side_copies else result


def _weight_grad(rows_a, rows_b, config: Product, problem: Problem):
  """`rows_a.T @ rows_b` in the input dtype: the engine's (its split tail deferred to
  `engine.write_tails`) or XLA's dot."""
  if config is XLA_DOT:
    return reference.weight_grad(rows_a, rows_b, problem.mode, problem.dtype)
  return engine.matmul(rows_a, rows_b, transpose_a=True, out_dtype=problem.dtype,
                       config=config, defer_tail=True)


def _input_grad(grad_pre, fc1_weight, config: Product, problem: Problem):
  """`grad_pre @ fc1_weight` with S rows (of grad_pre's, S or padded) in the input dtype: the
  engine's (its split tail deferred to `engine.write_tails`) or XLA's dot."""
  if config is XLA_DOT:
    return reference.input_grad(grad_pre[:problem.tokens], fc1_weight, problem.mode,
                                problem.dtype)
  return engine.matmul(grad_pre, fc1_weight, out_dtype=problem.dtype, config=config,
                       defer_tail=True, out_rows=problem.tokens)


def _staged_operands(grad_output, hidden_state, gelu_output, fc1_weight, fc2_weight, operand,
                     problem: Problem, interpret: bool, hidden_rows: int, gelu_rows: int,
                     staged=None):
  """The products' 16-bit operands and grad_fc2_bias's partial sums, from one staging launch.

  Each input that is not yet in the operand dtype with its rows (grad_output's padded to
  whole groups of 8, hidden_state's `hidden_rows` and gelu_output's `gelu_rows`: S or
  padded) is copied
  so (`staging.Cast`, zero rows past S), read once; grad_output's column sums (the bias
  gradient, of its values as given) come from the same read, as partial rows. Returns
  `((grad_output, its partial column sums), hidden_state, gelu_output, fc1_weight,
  fc2_weight)`; with `staged`, only the inputs of those indices are staged, the others
  returned as given."""
  arrays = (grad_output, hidden_state, gelu_output, fc1_weight, fc2_weight)
  padded = padded_rows(problem.tokens)
  rows = (padded, hidden_rows, gelu_rows, fc1_weight.shape[0], fc2_weight.shape[0])
  jobs = {}
  for i, (x, x_rows) in enumerate(zip(arrays, rows)):
    copy = (x.dtype != operand or x_rows != x.shape[0]) and (staged is None or i in staged)
    if copy or i == 0:   # grad_output's column sums, always
      jobs[i] = staging.Cast(x.shape, jnp.dtype(operand) if copy else None, rows=x_rows,
                             sums=i == 0, finished=False)
  outs = dict(zip(jobs, staging.launch(
      [(job, (arrays[i],)) for i, job in jobs.items()], mode=problem.mode,
      interpret=interpret, name="mlp_backward_staging")))
  staged = [outs.get(i, x) for i, x in enumerate(arrays)]
  if not jobs[0].out_dtype:   # grad_output was only summed
    staged[0] = (grad_output, staged[0])
  # The products wait for the launch (XLA would otherwise run it beside them, slower).
  return lax.optimization_barrier(tuple(staged))


def _tf32_backward(grad_output, hidden_state, fc1_weight, fc2_weight, fc1_output, gelu_output,
                   problem: Problem, configs, interpret: bool):
  """The backward's TF32 products on the f16 engine (see the module docstring), fp32 inputs."""
  pre_config, rows_config, weight_config = configs
  padded, f16 = padded_rows(problem.tokens), jnp.dtype(jnp.float16)
  Cast = staging.Cast

  def launch(jobs, name):
    return staging.launch(jobs, mode=problem.mode, interpret=interpret, name=name)

  def product(a, a_unscale, b, b_unscale, config, transpose_a=False, out_dtype=jnp.float32,
              **options):
    """op(a) @ b on the scaled f16 operands, unscaled in the engine (by a's reciprocal
    scales per row of op(a), b's per column), in fp32."""
    return engine.matmul(a, b, transpose_a=transpose_a, out_dtype=out_dtype, config=config,
                         row_scale=a_unscale, col_scale=b_unscale,
                         defer_tail="epilogue" not in options, **options)

  # One pass over every input: its f16 copies scaled by a speculated power of two (from
  # the input's first rows and columns, `precision.speculated_scale`), the maxima of the
  # lines they are scaled along (grad_output's columns and rows, the others' columns) and
  # grad_output's column sums (the bias gradient), as partial rows, and each speculated
  # scale as a vector. Then one that reduces the maxima to the scales and their
  # reciprocals, and copies again only the tiles of the lines whose maxima the speculated
  # scale does not fit (`precision.fits_speculated`). The first product's operands, the
  # copies of grad_output and gelu_output, are written last. With copy programs (or a
  # copy warpgroup), the fused product's launch makes the copies only the later products
  # read (fc1_weight's, hidden_state's, gelu_output's) and their maxima, and they are
  # checked after it.
  side = pre_config.copies_beside
  inputs = {"fc2_weight": (fc2_weight, 0, ("columns",)),   # (input, rows, the lines it is
            "fc1_weight": (fc1_weight, 0, ("columns",)),   #  scaled along)
            "hidden_state": (hidden_state, padded, ("columns",)),
            "gelu_output": (gelu_output, padded, ("columns",)),
            "grad_output": (grad_output, padded, ("columns", "rows"))}
  later = ("fc1_weight", "hidden_state", "gelu_output")
  staged = [name for name in inputs if not (side and name in later)]
  copy = lambda x, rows, lines, **options: Cast(x.shape, f16, rows=rows, scales=lines,
                                                parts=SCALED_COPY_PARTS, **options)
  # The pre-GELU gradient's copies speculate grad_output's scale: it is linear in
  # grad_output, and the weights and gelu' keep it within the window of that scale.
  pre_copy_scale = staging.SpeculatedScale(grad_output.shape, fc1_weight.shape[0])
  *speculated, copy_scale = launch(
      [(copy(x, rows, lines, scales_from="speculated", maxima=lines,
             sums=name == "grad_output", finished=False), (x, x))
       for name, (x, rows, lines) in ((name, inputs[name]) for name in staged)]
      + [(staging.SpeculatedScale(inputs[name][0].shape, 16), (inputs[name][0],))
         for name in inputs]
      + [(pre_copy_scale, (grad_output,))], "mlp_backward_staging")
  copies = dict(zip(staged, speculated[:len(staged)]))   # (copies..., [sums,] maxima...)
  speculated_scales = dict(zip(inputs, speculated[len(staged):]))
  *_, fc2_bias_parts, _, _ = copies["grad_output"]

  def checks(x, rows, lines, line_copies, maxima, speculated_scale, sources=None,
             operand=(), **options):
    """One checked job per copy of x: a column-scaled one in bands of tiles (its columns'
    partial maxima loaded once a band), a row-scaled one a tile per program (only its
    rows' maxima loaded). x is an input, or (with `sources` and the `Cast` options for
    them) the shape of what they compute."""
    return [(copy(x, rows, (kind,), scales_from="checked", **options),
             (*(sources or (x,)), line_maxima, line_copy, *operand, speculated_scale))
            for kind, line_copy, line_maxima in zip(lines, line_copies, maxima)]

  def input_checks(name, line_copies, maxima):
    return checks(*inputs[name], line_copies, maxima, speculated_scales[name])

  def staged_checks(name):
    outs, lines = copies[name], inputs[name][2]
    return input_checks(name, outs[:len(lines)], outs[-len(lines):])

  *results, grad_fc2_bias = launch(
      [job for name in staged for job in staged_checks(name)]
      + [(staging.SumRows(fc2_bias_parts.shape), (fc2_bias_parts,))], "mlp_backward_scales")
  checked = {}   # name: ((copy, reciprocal scales) per line kind)
  for name in staged:
    checked[name], results = results[:len(inputs[name][2])], results[len(inputs[name][2]):]
  (dy_by_column, dy_column_unscale), (dy_by_row, dy_row_unscale) = checked["grad_output"]
  # The pre-GELU gradient keeps the padded rows, zero: their accumulators are, and so is
  # gelu'(0) times them. The epilogue stores only its two f16 copies, at grad_output's
  # speculated scale, sums the fp32 columns (the bias gradient) and finds the largest
  # |value| of each column and row, from which the launch after it checks the copies'
  # scales, as the inputs' are checked (and computes again the tiles it rewrites).
  side_copies = [(inputs[name][0], inputs[name][1] or inputs[name][0].shape[0],
                  speculated_scales[name]) for name in later] if side else ()
  pre = product(
      dy_by_row, dy_row_unscale, *checked["fc2_weight"][0], pre_config,
      epilogue=reference.gelu_backward, epilogue_operand=fc1_output, column_sums="unrounded",
      line_maxima=True, approx_math=True, partial_reductions=True, speculated_copies=2,
      copy_scale=copy_scale, side_copies=side_copies, out_dtype=None)
  pre, side_outs = pre if side else (pre, ())
  checks_after = [job for name, (line_copy, maxima) in zip(later, side_outs)
                  for job in input_checks(name, (line_copy,), (maxima,))]
  *pre_copies, fc1_bias_parts, pre_column_max, pre_row_max = pre
  ((pre_by_column, pre_column_unscale), (pre_by_row, pre_row_unscale), *checked_after,
   grad_fc1_bias) = launch(
      # (the pre-GELU gradient was not stored: a tile rewritten is computed again,
      # gelu'(fc1_output) times grad_output @ fc2_weight in TF32, `Cast(product=True)`)
      checks(jax.ShapeDtypeStruct((padded, fc2_weight.shape[1]), jnp.float32), 0,
             ("columns", "rows"), pre_copies, (pre_column_max, pre_row_max), copy_scale,
             sources=(grad_output, fc2_weight), operand=(fc1_output,), product=True,
             epilogue=reference.gelu_backward)
      + checks_after
      + [(staging.SumRows(fc1_bias_parts.shape), (fc1_bias_parts,))],
      "mlp_backward_pre_gelu_scales")
  checked.update((name, (copy_and_unscale,)) for name, copy_and_unscale
                 in zip(later, checked_after))
  grad_fc2_weight = product(dy_by_column, dy_column_unscale, *checked["gelu_output"][0],
                            weight_config, transpose_a=True)
  (w1, w1_unscale), (x16, x_unscale) = checked["fc1_weight"][0], checked["hidden_state"][0]
  grad_fc1_weight = product(pre_by_column, pre_column_unscale, x16, x_unscale, weight_config,
                            transpose_a=True)
  grad_hidden_state = product(pre_by_row, pre_row_unscale, w1, w1_unscale, rows_config,
                              out_rows=problem.tokens)
  grad_hidden_state, grad_fc1_weight, grad_fc2_weight = engine.write_tails(
      grad_hidden_state, grad_fc1_weight, grad_fc2_weight, interpret=interpret)
  return (grad_hidden_state, grad_fc1_weight, grad_fc1_bias, grad_fc2_weight,
          grad_fc2_bias)
