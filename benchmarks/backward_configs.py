"""`python -m benchmarks.backward_configs`: one Mosaic table entry's variants, in the whole backward.

An engine config measured alone (`benchmarks/engine.py`) misses what its
product shares with the rest of the backward (the fused epilogue's reductions,
the L2). This replaces one product's config of one table (this GPU's:
`backends/mosaic/configs/h200.json`, on an H100 with `h100.json`'s entries over it) by
each variant, times the whole backward on the seed-distribution inputs with CUPTI and a
cold L2, and lists which of each variant's five gradients differ bitwise from the first's
(a config changes how the work is scheduled, not the products; it may change the order in
which the bias gradients' fp32 column sums are added). Writes
`backward_configs_<device>_<date>.json` into --out, each row with the variant and the
whole config it ran (`config`: GemmConfig's fields, or "xla").

  python -m benchmarks.backward_configs --table tf32_on_f16 --product pre_gelu \\
      --variants '{}' '{"stages": 3, "epilogue_buffers": 2}' '{"mma_in_flight": 0}'

`{"xla_dot": true}` runs the product as XLA's dot instead (rows and weight_grads);
`"gelu_form"` in a variant traces the backward with that form of the GELU derivative
(`benchmarks/gelu_forms.py`; its gradients then differ in the last bits).
`--product staging` varies the staging launches instead (`backends/staging.py`): each
variant's `block` and `parts` replace every `Cast` job's, `num_warps` and `num_stages`
the launches', and `"sum_rows"` every `SumRows` job's fields (the table's products
unchanged):

  python -m benchmarks.backward_configs --table fp32_inputs --product staging \\
      --variants '{}' '{"block": [64, 256], "num_warps": 8}' '{"sum_rows": {"group": 8}}'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json

import jax
import jax.numpy as jnp

from benchmarks import cases, gelu_forms, timing
from benchmarks.run import todays_runs_dir, write_result_json
from vision_mlp_bwd import precision as precisions
from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.mosaic import backward_sm90, engine
from vision_mlp_bwd.problem import GRADIENTS, Problem

INPUTS = {"tf32_on_f16": (jnp.float32, None),
          "fp32_inputs": (jnp.float32, jax.lax.DotAlgorithmPreset.F16_F16_F32),
          "sixteen_bit_inputs": (jnp.bfloat16, None)}


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.backward_configs",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--table", choices=tuple(INPUTS), required=True)
  parser.add_argument("--product", choices=("pre_gelu", "rows", "weight_grads", "staging"),
                      required=True)
  parser.add_argument("--variants", nargs="+", required=True,
                      help="JSON objects of GemmConfig fields over the table's config at each S")
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[1024, 4096, 16384])
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--size", default=f"{cases.HIDDEN}x{cases.INTERMEDIATE}",
                      help="HxI (multiples of 64)")
  parser.add_argument("--grad-output-scale", type=float, default=1.0,
                      help="multiplies grad_output (e.g. 2**-20, a loss gradient's magnitude: "
                           "under DEFAULT, outside the speculated scale's window)")
  parser.add_argument("--out", default=todays_runs_dir())
  args = parser.parse_args(argv)

  tables = backward_sm90.tables_for(jax.devices()[0].device_kind)   # this GPU's
  dtype, precision = INPUTS[args.table]
  mode = precisions.for_inputs(precisions.canonicalize(precision), dtype)
  hidden, intermediate = (int(v) for v in args.size.split("x"))
  entries = None if args.product == "staging" else getattr(tables, args.product)
  variants = [json.loads(text) for text in args.variants]
  interpret = jax.default_backend() != "gpu"   # the staging launches off a GPU (the tests)
  rows = []
  for tokens in args.seq_lens:
    inputs = tuple(x.astype(dtype) for x in cases.make_inputs(jax.random.key(tokens), tokens,
                                                              hidden, intermediate))
    inputs = (inputs[0] * jnp.asarray(args.grad_output_scale, dtype), *inputs[1:])
    problem = Problem(tokens, hidden, intermediate, jnp.dtype(dtype), mode)
    first = None
    for variant in variants:
      fields, form = variant_parts(variant)
      ran = None
      if entries is None:
        replaced, launch = tables, _staging_launch(fields)
      else:
        # The variant replaces the config this S runs (one row for every S).
        config = backward_sm90.Tables.config_for(entries, args.table, tokens)
        try:
          varied = ((None, variant_config(config, fields)),)
        except ValueError as refused:   # fields that do not combine with this S's row
          print(f"S={tokens} {variant}: {refused}", flush=True)
          continue
        replaced = dataclasses.replace(tables, **{args.product: {**entries, args.table: varied}})
        launch = staging.launch
        ran = varied[0][1]
      fn = jax.jit(lambda *a, t=replaced: backward_sm90.backward(
          *a, problem=problem, tables=t, interpret=interpret))
      try:
        with _launching(launch), gelu_forms.using(form):
          out = jax.block_until_ready(fn(*inputs))
      except ValueError as refused:   # e.g. over the shared memory of a block
        print(f"S={tokens} {variant}: {refused}", flush=True)
        continue
      differing = [] if first is None else [
          name for name, a, b in zip(GRADIENTS, out, first)
          if not bool(jnp.array_equal(a, b, equal_nan=True))]
      first = out if first is None else first
      t = timing.device_times_us(fn, *inputs, warmup=3, iterations=args.iterations)
      rows.append(dict(seq_len=tokens, variant=variant, median_us=t.median_us,
                       kernels=list(zip(t.kernel_names, t.kernel_median_us)),
                       bitwise_same_as_first=not differing,
                       differing_from_first=differing,
                       **({} if ran is None else dict(config=recorded_fields(ran)))))
      print(f"S={tokens:6d} {json.dumps(variant):50s} {t.median_us:8.1f} us  largest kernel "
            f"{max(t.kernel_median_us, default=float('nan')):6.1f}  same={not differing}"
            + (f" ({', '.join(differing)} differ)" if differing else ""), flush=True)
  write_result_json(args.out, "backward_configs", table=args.table, product=args.product,
                    grad_output_scale=args.grad_output_scale, rows=rows)


def recorded_fields(config):
  """A product's config as a run file records it (`backward_sm90.parse_product` reads it
  back): GemmConfig's fields, or "xla"."""
  return "xla" if config is backward_sm90.XLA_DOT else dataclasses.asdict(config)


def recorded_config(row, base):
  """The config a `backward_configs` row ran: its `config`, or for files written before
  rows recorded it, its variant over `base` (the table's config at that S then)."""
  if "config" in row:
    return backward_sm90.parse_product(row["config"])
  return variant_config(base, variant_parts(row["variant"])[0])


def variant_parts(variant: dict):
  """A variant's (GemmConfig or staging fields, GELU form name or None)."""
  fields = dict(variant)
  form = fields.pop("gelu_form", None)
  return backward_sm90.config_fields(fields), form


def variant_config(config, fields):
  """`fields` over a table row's config; {"xla_dot": true} is XLA's dot instead, `{}` the
  row as it is, and other fields over an XLA_DOT row start from GemmConfig's defaults."""
  if fields.get("xla_dot"):
    return backward_sm90.XLA_DOT
  if not fields:
    return config
  if config is backward_sm90.XLA_DOT:
    config = engine.GemmConfig()
  return dataclasses.replace(config, **fields)


def _staging_launch(fields):
  """`staging.launch` with every Cast job's `block`/`parts`, every SumRows job's fields
  `sum_rows` (`{"block": 256, "group": 8}`) and the launch parameters (`num_warps`,
  `num_stages`) of `fields`."""
  fields = dict(fields)
  sum_fields = fields.pop("sum_rows", {})
  job_fields = {k: v for k, v in fields.items() if k in ("block", "parts")}
  params = {k: v for k, v in fields.items() if k not in job_fields}
  original = staging.launch

  def varied(job):
    if isinstance(job, staging.Cast):
      return dataclasses.replace(job, **job_fields)
    if isinstance(job, staging.SumRows):
      return dataclasses.replace(job, **sum_fields)
    return job

  def launch(pairs, **kwargs):
    return original([(varied(job), ops) for job, ops in pairs], **kwargs, **params)
  return launch


@contextlib.contextmanager
def _launching(launch):
  """The backward traced with `launch` as its staging launches (the trace is cached)."""
  original, staging.launch = staging.launch, launch
  try:
    yield
  finally:
    staging.launch = original


if __name__ == "__main__":
  main()
