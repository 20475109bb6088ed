"""`python -m benchmarks.precision_errors`: what each `precision` computes, per input dtype.

For fp32, bf16 and f16 inputs (drawn as the contract says, then rounded to
the input dtype) and each precision, runs `mlp_backward` with the kernels
and with XLA and prints the worst relative Frobenius error over the five
gradients against a float64 oracle of the same (rounded) inputs: the figures
of README's precision table. Writes `precision_errors_<device>_<date>.json`.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import vision_mlp_bwd
from benchmarks import cases
from benchmarks.run import todays_runs_dir, write_result_json

PRECISIONS = {"default": None, "highest": lax.Precision.HIGHEST,
              "f16": lax.DotAlgorithmPreset.F16_F16_F32,
              "bf16": lax.DotAlgorithmPreset.BF16_BF16_F32}
DTYPES = {"fp32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}


def oracle(inputs):
  """The contract's five formulas in float64 (NumPy)."""
  dy, hs, w1, _, w2, _, x, a = (np.asarray(t, np.float64) for t in inputs)
  c, k = 0.7978845608028654, 0.044715
  t = np.tanh(c * (x + k * x ** 3))
  pre = (dy @ w2) * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * k * x * x))
  return pre @ w1, pre.T @ hs, pre.sum(0), dy.T @ a, dy.sum(0)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.precision_errors",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[211, 1024])
  parser.add_argument("--out", default=todays_runs_dir())
  args = parser.parse_args(argv)
  on_gpu = jax.default_backend() == "gpu"
  hidden, intermediate = (cases.HIDDEN, cases.INTERMEDIATE) if on_gpu else cases.CPU_DEMO_SIZE
  rows = []
  for s in args.seq_lens:
    for dtype_name, dtype in DTYPES.items():
      inputs = tuple(x.astype(dtype) for x in cases.make_inputs(jax.random.key(s), s, hidden,
                                                                 intermediate))
      refs = oracle(inputs)
      for precision_name, precision in PRECISIONS.items():
        for implementation in ("triton", "xla"):
          outs = vision_mlp_bwd.mlp_backward(*inputs, precision=precision,
                                             implementation=implementation)
          errors = [float(np.linalg.norm(np.asarray(o, np.float64) - r) / np.linalg.norm(r))
                    for o, r in zip(outs, refs)]
          rows.append(dict(seq_len=s, dtype=dtype_name, precision=precision_name,
                           implementation=implementation, max_error=max(errors), errors=errors))
          print(f"S={s:5d} {dtype_name:>4} in  {precision_name:>7}  {implementation:>6}  "
                f"worst rel. Frobenius {max(errors):.2e}", flush=True)
  write_result_json(args.out, "precision_errors", rows=rows)


if __name__ == "__main__":
  main()
