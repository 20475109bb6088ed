"""`python -m benchmarks.epilogue_costs`: where the fused pre-GELU product's time goes.

Times `grad_output @ fc2_weight` alone on the engine (f16 operands in HBM, the
`fc1_output` operand in fp32, S x H x I of the seed distribution) with its
epilogue built up one piece at a time, each step in the config the backward's
table uses for it: the plain product, then the operand read (`acc * x`), the GELU
derivative, the bias sums, the line maxima and the TF32 unscaling. The
difference between two rows is what that piece costs the kernel. Two steps read an
8-row operand instead (TMA reads zeros past it): the epilogue's work without
fc1_output's traffic from HBM. With `--variants`
(JSON objects of GemmConfig fields over the table's config, as in
`benchmarks/backward_configs.py`), every step runs in each variant's config. CUPTI
device time, cold L2, median. Writes `epilogue_costs_<device>_<date>.json` into --out.
With `--profile-calls N` nothing is timed: each step runs N times, for a profiler outside
the process (`ncu -k regex:mosaic ...`; CUPTI serves one client at a time), and with
`--trace-dir DIR` each call writes the engine's per-warpgroup timeline of its blocks'
"mainloop" and "epilogue" there (`engine.traced`; `benchmarks/timeline.py` reads it).

  python -m benchmarks.epilogue_costs --seq-lens 4096 --steps "f16: plain product" \\
      --variants '{}' '{"ping_pong": true, "tile_n": 128, "stages": 5, "chained": false}'
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import cases, gelu_forms, timing
from benchmarks.backward_configs import variant_config, variant_parts
from benchmarks.run import write_result_json
from vision_mlp_bwd import reference
from vision_mlp_bwd.backends.mosaic import backward_sm90, engine

TABLES = {"f16": ("fp32_inputs", jnp.float16), "tf32": ("tf32_on_f16", jnp.float32)}
STEPS = {   # name -> (table, epilogue, matmul options)
    "f16: plain product": ("f16", None, {}),
    "f16: + operand read (acc * x)": ("f16", "multiply", {}),
    "f16: + GELU derivative": ("f16", "gelu", {}),
    "f16: + bias sums (the table's product)": ("f16", "gelu", dict(column_sums="unrounded")),
    # fc1_output cut to its first 8 rows: TMA reads zeros past them, so the epilogue does
    # the same work without fc1_output's traffic from HBM
    "f16: + operand read, 8-row operand": ("f16", "multiply", dict(operand_rows=8)),
    "f16: + GELU derivative, 8-row operand": ("f16", "gelu", dict(operand_rows=8)),
    "tf32: plain product, fp32 out": ("tf32", None, {}),
    "tf32: + GELU derivative": ("tf32", "gelu", {}),
    "tf32: + bias sums": ("tf32", "gelu", dict(column_sums="unrounded")),
    "tf32: + line maxima": ("tf32", "gelu", dict(column_sums="unrounded", line_maxima=True)),
    "tf32: + unscaling (the table's product)": ("tf32", "gelu", dict(
        column_sums="unrounded", line_maxima=True, scaled=True)),
}
EPILOGUES = {"multiply": lambda acc, x: acc * x, "gelu": reference.gelu_backward}


def step_fn(step: str, tokens: int, variant=None):
  """The jitted product of one step, `f(a, b, fc1_output, row_scale, col_scale)`, in the
  table's config at S = `tokens` with `variant`'s fields over it."""
  table, epilogue, options = STEPS[step]
  inputs, out_dtype = TABLES[table]
  tables = backward_sm90.tables_for(jax.devices()[0].device_kind)   # this GPU's
  config = tables.config_for(tables.pre_gelu, inputs, tokens)
  if config is backward_sm90.XLA_DOT:
    raise SystemExit(f"S={tokens}: the {inputs} table runs the pre-GELU product as XLA's dot, "
                     "with no engine epilogue to time")
  # The product alone, on every SM: the table's copy programs (or warpgroup) copy the
  # backward's inputs.
  config = dataclasses.replace(
      variant_config(config, variant_parts(variant or {})[0]), copy_programs=0,
      copy_warpgroup=False)
  options = dict(options)
  scaled = options.pop("scaled", False)
  operand_rows = options.pop("operand_rows", None)

  def f(a, b, x, row_scale, col_scale):
    extra = dict(row_scale=row_scale, col_scale=col_scale) if scaled else {}
    if epilogue is not None:
      extra.update(epilogue=EPILOGUES[epilogue], epilogue_operand=x[:operand_rows],
                   approx_math=True)
    return engine.matmul(a, b, out_dtype=out_dtype, config=config, **options, **extra)
  return jax.jit(f), config


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.epilogue_costs",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[4096])
  parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS))
  parser.add_argument("--size", default=f"{cases.HIDDEN}x{cases.INTERMEDIATE}",
                      help="HxI (multiples of 64)")
  parser.add_argument("--variants", nargs="+", default=["{}"],
                      help="JSON objects of GemmConfig fields over the table's config "
                           "(\"gelu_form\": a form of benchmarks/gelu_forms.py instead of "
                           "the package's)")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--profile-calls", type=int, default=0,
                      help="run each step this many times untimed, for an outside profiler")
  parser.add_argument("--trace-dir", default=None,
                      help="with --profile-calls: write each call's warpgroup timeline here")
  parser.add_argument("--out", default=os.path.join("benchmarks", "results", "probes", "engine"))
  args = parser.parse_args(argv)
  hidden, intermediate = (int(v) for v in args.size.split("x"))
  rows = []
  for tokens in args.seq_lens:
    grad_output, _, _, _, fc2_weight, _, fc1_output, _ = cases.make_inputs(
        jax.random.key(tokens), tokens, hidden, intermediate)
    a, b, x = grad_output.astype(jnp.float16), fc2_weight.astype(jnp.float16), fc1_output
    row_scale = jnp.exp2(jnp.arange(tokens, dtype=jnp.float32) % 7 - 3)
    col_scale = jnp.ones((intermediate,), jnp.float32)
    for variant in map(json.loads, args.variants):
      for step in args.steps:
        try:
          with (engine.traced(args.trace_dir) if args.trace_dir and args.profile_calls
                else contextlib.nullcontext()), gelu_forms.using(variant_parts(variant)[1]):
            fn, config = step_fn(step, tokens, variant)
            # the first call traces, inside both contexts; the timed calls reuse its kernels
            jax.block_until_ready(fn(a, b, x, row_scale, col_scale))
            for _ in range(args.profile_calls - 1):
              jax.block_until_ready(fn(a, b, x, row_scale, col_scale))
          if args.profile_calls:
            print(f"S={tokens:6d} {json.dumps(variant)} {step}: {args.profile_calls} calls",
                  flush=True)
            continue
          t = timing.device_times_us(fn, a, b, x, row_scale, col_scale,
                                     iterations=args.iterations)
        except ValueError as refused:   # a step this config does not run
          print(f"S={tokens:6d} {json.dumps(variant)} {step}: {refused}", flush=True)
          continue
        rows.append(dict(seq_len=tokens, step=step, variant=variant, median_us=t.median_us,
                         config=dataclasses.asdict(config),
                         kernels=list(zip(t.kernel_names, t.kernel_median_us))))
        print(f"S={tokens:6d} {json.dumps(variant):60s} {step:42s} {t.median_us:8.1f} us",
              flush=True)
  if not args.profile_calls:
    write_result_json(args.out, "epilogue_costs", rows=rows)


if __name__ == "__main__":
  main()
