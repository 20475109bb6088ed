"""`python -m benchmarks.bf16x3_chunks`: how many S rows bf16x3's weight gradients sum at once.

The Hopper backend's HIGHEST runs each product as one 16-bit product over the
inputs' bf16 pieces side by side (`backends/mosaic/backward_sm90.py`), so a
weight gradient sums K = 3S exact products in a tensor core's fp32 accumulator.
For each S and each chunk (at most that many rows per product, the fp32
partials added in order; `none`: S in one product) this times the whole
backward with CUPTI and a cold L2 and measures the relative Frobenius error of
the two weight gradients against float64 (NumPy) on the seed distribution.
Writes `bf16x3_chunks_<device>_<date>.json` into --out.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from benchmarks import cases, timing
from benchmarks.run import todays_runs_dir, write_result_json
from vision_mlp_bwd.backends.mosaic import backward_sm90
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import check_backward_args


def weight_grads_float64(inputs):
  """(grad_fc1_weight, grad_fc2_weight) in float64 NumPy."""
  dy, hs, w1, _, w2, _, x, a = (np.asarray(t, np.float64) for t in inputs)
  s = np.sqrt(2 / np.pi)
  t = np.tanh(s * (x + 0.044715 * x ** 3))
  pre = (dy @ w2) * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * s * (1 + 3 * 0.044715 * x * x))
  return pre.T @ hs, dy.T @ a


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.bf16x3_chunks",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
  parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1024, 2048, 0],
                      help="rows per product (0: S in one)")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--out", default=todays_runs_dir())
  args = parser.parse_args(argv)
  rows = []
  for tokens in args.seq_lens:
    inputs = cases.make_inputs(jax.random.key(tokens), tokens)
    problem = check_backward_args(*inputs, canonicalize(lax.Precision.HIGHEST))
    exact = weight_grads_float64(inputs)
    for chunk in args.chunks:
      fn = jax.jit(lambda *a, c=chunk or tokens: backward_sm90._bf16x3_backward(
          *a[:3], a[4], a[6], a[7], problem=problem, interpret=False, chunk=c))
      outs = jax.device_get(fn(*inputs))
      errors = [float(np.linalg.norm(np.asarray(o, np.float64) - e) / np.linalg.norm(e))
                for o, e in zip((outs[1], outs[3]), exact)]
      timed = timing.device_times_us(fn, *inputs, warmup=3, iterations=args.iterations)
      rows.append(dict(seq_len=tokens, chunk=chunk or tokens, median_us=timed.median_us,
                       grad_fc1_weight_error=errors[0], grad_fc2_weight_error=errors[1],
                       kernels=list(zip(timed.kernel_names, timed.kernel_median_us))))
      print(f"S={tokens:6d} chunk={chunk or tokens:6d} {timed.median_us:8.1f} us  "
            f"errors {errors[0]:.2e} {errors[1]:.2e}", flush=True)
  write_result_json(args.out, "bf16x3_chunks", rows=rows)


if __name__ == "__main__":
  main()
