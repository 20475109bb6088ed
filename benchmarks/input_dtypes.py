"""`python -m benchmarks.input_dtypes`: `mlp_backward` on 16-bit inputs against fp32 inputs.

On bf16 and f16 inputs the default precision multiplies the 16-bit values as
they are (`precision.for_inputs`), which is what F16_F16_F32 does to fp32
inputs after casting them. So for each seed S this times, with CUPTI and a
cold L2 (`benchmarks/timing.py`): the Mosaic and Triton kernels and XLA on
fp32 inputs under F16_F16_F32, and the same three on bf16 and f16 inputs at
the default precision, each with the automatic choice, and Mosaic, XLA and the
automatic choice on fp32 inputs at the default precision (TF32), and all four on fp32
inputs under HIGHEST and HIGH (bf16x3 in the kernels) and BF16_BF16_F32; an
implementation that cannot
run here (the Mosaic one off Hopper) is left out. Writes
`input_dtypes_<device>_<date>.{json,md}` into --out.
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from jax import lax

import vision_mlp_bwd
from vision_mlp_bwd import backends, precision as precisions
from vision_mlp_bwd.problem import Problem
from benchmarks.run import result_stem, todays_runs_dir
from benchmarks import cases, timing

F16 = lax.DotAlgorithmPreset.F16_F16_F32
# (label, input dtype, precision, implementation)
COLUMNS = (("fp32 in, F16, mosaic", jnp.float32, F16, "mosaic"),
           ("fp32 in, F16, triton", jnp.float32, F16, "triton"),
           ("fp32 in, F16, xla", jnp.float32, F16, "xla"),
           ("fp32 in, F16, auto", jnp.float32, F16, None),
           ("fp32 in, DEFAULT, mosaic", jnp.float32, None, "mosaic"),
           ("fp32 in, DEFAULT, xla", jnp.float32, None, "xla"),
           ("fp32 in, DEFAULT, auto", jnp.float32, None, None),
           ("bf16 in, mosaic", jnp.bfloat16, None, "mosaic"),
           ("bf16 in, triton", jnp.bfloat16, None, "triton"),
           ("bf16 in, xla", jnp.bfloat16, None, "xla"),
           ("bf16 in, auto", jnp.bfloat16, None, None),
           ("f16 in, mosaic", jnp.float16, None, "mosaic"),
           ("f16 in, triton", jnp.float16, None, "triton"),
           ("f16 in, xla", jnp.float16, None, "xla"),
           ("f16 in, auto", jnp.float16, None, None),
           *((f"fp32 in, {name}, {implementation or 'auto'}", jnp.float32, precision,
              implementation)
             for name, precision in (("HIGHEST", lax.Precision.HIGHEST),
                                     ("HIGH", lax.Precision.HIGH),
                                     ("BF16", lax.DotAlgorithmPreset.BF16_BF16_F32))
             for implementation in ("mosaic", "triton", "xla", None)))


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.input_dtypes", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=list(cases.SEQ_LENS))
  parser.add_argument("--iterations", type=int, default=30)
  parser.add_argument("--implementations", nargs="+", choices=["mosaic", "triton", "xla", "auto"],
                      help="only these columns' implementations (default: all)")
  parser.add_argument("--inputs", help="only the columns whose label starts with this, "
                      "e.g. 'fp32 in, DEFAULT'")
  parser.add_argument("--out", default=todays_runs_dir(),
                      help="default: benchmarks/results/runs/<UTC date>/")
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  hidden, intermediate = (cases.HIDDEN, cases.INTERMEDIATE) if on_gpu else cases.CPU_DEMO_SIZE
  stem, date = result_stem(args.out, "input_dtypes")
  columns = [c for c in COLUMNS if _runs(c, hidden, intermediate) and (
      not args.implementations or (c[3] or "auto") in args.implementations) and (
      not args.inputs or c[0].startswith(args.inputs))]
  rows = []
  for s in args.seq_lens:
    inputs = cases.make_inputs(jax.random.key(s), s, hidden, intermediate)
    row = dict(seq_len=s)
    for label, dtype, precision, implementation in columns:
      fn = jax.jit(lambda *a, p=precision, i=implementation: vision_mlp_bwd.mlp_backward(
          *a, precision=p, implementation=i))
      args_ = tuple(x.astype(dtype) for x in inputs)
      if on_gpu:
        timed = timing.device_times_us(fn, *args_, warmup=5, iterations=args.iterations)
        row[label] = timed.median_us
        row.setdefault("kernels", {})[label] = list(zip(timed.kernel_names,
                                                        timed.kernel_median_us))
      else:
        row[label] = timing.wall_times_us(fn, *args_, warmup=1, iterations=2).median_us
    rows.append(row)
    print(f"S={s:5d} " + "  ".join(f"{label} {row[label]:7.1f}" for label, *_ in columns),
          flush=True)
    _write(stem, rows, date, hidden, intermediate, [label for label, *_ in columns])   # after every S: a cut-short run keeps its rows


def _runs(column, hidden, intermediate) -> bool:
  """Whether the column's implementation can run on this platform (None: the automatic choice)."""
  _, dtype, precision, implementation = column
  if implementation is None:
    return True
  dtype = jnp.dtype(dtype)
  problem = Problem(cases.SEQ_LENS[0], hidden, intermediate, dtype,
                    precisions.for_inputs(precisions.canonicalize(precision), dtype))
  return backends.get(implementation).unsupported_reason(problem, jax.default_backend()) is None


def _write(stem, rows, date, hidden, intermediate, labels):
  md = [f"# mlp_backward by input dtype ({jax.devices()[0].device_kind}, {date}, "
        f"jax {jax.__version__}, H={hidden}, I={intermediate}; µs, CUPTI, cold L2, median)", "",
        "| S | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
  md += [f"| {r['seq_len']} | " + " | ".join(f"{r[label]:.1f}" for label in labels) + " |"
         for r in rows]
  with open(stem + ".json", "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, date=date, jax=jax.__version__,
                   commit=os.environ.get("GIT_COMMIT", "unknown"), rows=rows), f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write("\n".join(md) + "\n")


if __name__ == "__main__":
  main()
