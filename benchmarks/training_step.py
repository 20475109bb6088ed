"""`python -m benchmarks.training_step`: our layer against the MLP a JAX user writes today.

Two tables, for bf16, f16 and fp32 inputs (H=1280, I=3584 unless --size):

1. Forward + backward: one call of `jax.jit(jax.value_and_grad(loss, (0..4)))`
   with `loss = sum(f(x, *params) ** 2)`, where `f` is plain jnp
   (`jax.nn.gelu(x @ w1.T + b1, approximate=True) @ w2.T + b2`) or
   `vision_mlp` with the automatic choice or the Triton kernels, at the
   default precision. CUPTI device time with the L2 flushed before each call,
   median (`benchmarks/timing.py`).
2. A Flax nnx training step (forward, backward, optax AdamW update) of
   `vision_mlp_bwd.flax.VisionMLP` against the same model built from two
   `nnx.Linear`, same parameters and data: the median of the steps' device
   times, measured the same way.

Writes `training_step_<device>_<date>.{json,md,png}` into --out. Without a GPU it
runs tiny shapes with wall-clock times (a demo, not a benchmark).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

import jax
import jax.numpy as jnp

import vision_mlp_bwd
from benchmarks.run import REPO_ROOT, result_stem, todays_runs_dir
from benchmarks import timing

DTYPES = {"bf16": jnp.bfloat16, "f16": jnp.float16, "fp32": jnp.float32}
SEQ_LENS = (256, 1024, 4096, 16384)
IMPLEMENTATIONS = ("auto", "triton")   # vision_mlp's; "plain" is the jnp model


def plain_mlp(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
  """The vision MLP as a JAX user writes it, differentiated by jnp autodiff."""
  return jax.nn.gelu(x @ fc1_weight.T + fc1_bias, approximate=True) @ fc2_weight.T + fc2_bias


def model_fn(name):
  if name == "plain":
    return plain_mlp
  implementation = None if name == "auto" else name
  return lambda *args: vision_mlp_bwd.vision_mlp(*args, implementation=implementation)


def make_params(key, hidden, intermediate, dtype):
  k1, k2, k3, k4 = jax.random.split(key, 4)
  return (jax.random.normal(k1, (intermediate, hidden)) * hidden ** -0.5,
          jax.random.normal(k2, (intermediate,)) * 0.1,
          jax.random.normal(k3, (hidden, intermediate)) * intermediate ** -0.5,
          jax.random.normal(k4, (hidden,)) * 0.1)


def make_inputs(seq_len, hidden, intermediate, dtype):
  """(x `[S, H]`, the four parameters), in `dtype`, seeded by S."""
  key = jax.random.key(seq_len)
  params = tuple(p.astype(dtype) for p in make_params(key, hidden, intermediate, dtype))
  return jax.random.normal(jax.random.fold_in(key, 1), (seq_len, hidden)).astype(dtype), params


def value_and_grad_fn(name):
  f = model_fn(name)
  loss = lambda x, *params: jnp.sum(f(x, *params).astype(jnp.float32) ** 2)
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))


def time_fn(fn, *args, iterations):
  if jax.default_backend() == "gpu":
    return timing.device_times_us(fn, *args, warmup=3, iterations=iterations).median_us
  return timing.wall_times_us(fn, *args, warmup=1, iterations=3).median_us


def forward_backward_rows(seq_lens, dtypes, hidden, intermediate, iterations):
  rows = []
  for dtype_name in dtypes:
    dtype = DTYPES[dtype_name]
    for s in seq_lens:
      x, params = make_inputs(s, hidden, intermediate, dtype)
      row = dict(dtype=dtype_name, seq_len=s)
      for name in ("plain",) + IMPLEMENTATIONS:
        row[name] = time_fn(value_and_grad_fn(name), x, *params, iterations=iterations)
      row["auto_vs_plain"] = row["plain"] / row["auto"]
      row["backend"] = _backend_name(s, hidden, intermediate, dtype)
      rows.append(row)
      print(f"{dtype_name:>5} S={s:6d}  plain {row['plain']:9.1f}  auto {row['auto']:9.1f} "
            f"({row['auto_vs_plain']:.2f}x, {row['backend']})  triton {row['triton']:9.1f} us",
            flush=True)
  return rows


def _backend_name(s, hidden, intermediate, dtype):
  from vision_mlp_bwd.precision import canonicalize
  from vision_mlp_bwd.problem import Problem, platform
  from vision_mlp_bwd.precision import for_inputs
  problem = Problem(s, hidden, intermediate, jnp.dtype(dtype), for_inputs(canonicalize(None), dtype))
  if vision_mlp_bwd.backends.jnp_autodiff_preferred(problem, platform()):
    return "jnp autodiff"
  return vision_mlp_bwd.backends.choose(None, problem, platform()).name


def flax_step_rows(seq_lens, dtypes, hidden, intermediate, iterations):
  """Median device time of one nnx + optax AdamW step: VisionMLP against two nnx.Linear."""
  import optax
  from flax import nnx

  from vision_mlp_bwd.flax import VisionMLP

  class LinearMLP(nnx.Module):
    def __init__(self, rngs, dtype):
      self.fc1 = nnx.Linear(hidden, intermediate, rngs=rngs, dtype=dtype)
      self.fc2 = nnx.Linear(intermediate, hidden, rngs=rngs, dtype=dtype)

    def __call__(self, x):
      return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))

  rows = []
  for dtype_name in dtypes:
    dtype = DTYPES[dtype_name]
    for s in seq_lens:
      x = jax.random.normal(jax.random.key(s), (s, hidden)).astype(dtype)
      y = jax.random.normal(jax.random.key(s + 1), (s, hidden)).astype(dtype)
      row = dict(dtype=dtype_name, seq_len=s)
      for name, model in (("nnx.Linear", LinearMLP(nnx.Rngs(0), dtype)),
                          ("VisionMLP", VisionMLP(hidden, intermediate, rngs=nnx.Rngs(0),
                                                  dtype=dtype))):
        optimizer = nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)
        graph, state = nnx.split((model, optimizer))

        @jax.jit
        def step(state, x, y, graph=graph):
          model, optimizer = nnx.merge(graph, state)
          loss = lambda m: jnp.mean((m(x).astype(jnp.float32) - y.astype(jnp.float32)) ** 2)
          value, grads = nnx.value_and_grad(loss)(model)
          optimizer.update(model, grads)
          return nnx.state((model, optimizer)), value

        row[name] = time_fn(lambda state, x, y: step(state, x, y)[1], state, x, y,
                            iterations=iterations)
      row["ratio"] = row["nnx.Linear"] / row["VisionMLP"]
      rows.append(row)
      print(f"{dtype_name:>5} S={s:6d}  nnx.Linear step {row['nnx.Linear']:9.1f}  VisionMLP step "
            f"{row['VisionMLP']:9.1f} us ({row['ratio']:.2f}x)", flush=True)
  return rows


def breakdown(seq_len, dtype_name, hidden, intermediate, iterations, out_stem):
  """Where the time of one forward + backward goes: each kernel's median, plain jnp and auto.

  Also writes each program's optimized HLO (`<out_stem>_<name>.hlo.txt`), to see which
  fusions and library calls XLA made of it."""
  dtype = DTYPES[dtype_name]
  x, params = make_inputs(seq_len, hidden, intermediate, dtype)
  lines = [f"## {dtype_name} S={seq_len}: kernels of one call (median µs, launch order)", ""]
  for name in ("plain", "auto"):
    fn = value_and_grad_fn(name)
    with open(f"{out_stem}_{dtype_name}_{seq_len}_{name}.hlo.txt", "w") as f:   # paths from the root
      f.write(fn.lower(x, *params).compile().as_text().replace(REPO_ROOT + os.sep, ""))
    t = timing.device_times_us(fn, x, *params, warmup=3, iterations=iterations)
    lines += [f"### {name}: {t.median_us:.1f} µs in {t.kernels} kernels", "",
              "| # | kernel | µs |", "|---|---|---|"]
    lines += [f"| {i} | `{k[:90]}` | {us:.1f} |"
              for i, (k, us) in enumerate(zip(t.kernel_names, t.kernel_median_us))]
    lines.append("")
  return "\n".join(lines) + "\n"


def markdown(meta, fb_rows, flax_rows):
  lines = [f"# Training step: vision_mlp against plain jnp ({meta['device']}, {meta['date']})", "",
           f"jax {meta['jax']}, commit {meta['commit']}; H={meta['hidden']}, "
           f"I={meta['intermediate']}; {meta['method']}.", "",
           "## Forward + backward, `jax.value_and_grad` of sum(f(x)^2) over x and the "
           "four parameters (µs)", "",
           "| inputs | S | plain jnp | vision_mlp, auto | × plain | auto runs | vision_mlp, triton |",
           "|---|---|---|---|---|---|---|"]
  for r in fb_rows:
    lines.append(f"| {r['dtype']} | {r['seq_len']} | {r['plain']:.1f} | {r['auto']:.1f} | "
                 f"{r['auto_vs_plain']:.2f} | {r['backend']} | {r['triton']:.1f} |")
  if flax_rows:
    lines += ["", "## Flax nnx training step with optax AdamW (µs)", "",
              "| inputs | S | two nnx.Linear | VisionMLP | × |", "|---|---|---|---|---|"]
    for r in flax_rows:
      lines.append(f"| {r['dtype']} | {r['seq_len']} | {r['nnx.Linear']:.1f} | "
                   f"{r['VisionMLP']:.1f} | {r['ratio']:.2f} |")
  return "\n".join(lines) + "\n"


def plot(fb_rows, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  dtypes = sorted({r["dtype"] for r in fb_rows}, key=list(DTYPES).index)
  fig, axes = plt.subplots(1, len(dtypes), figsize=(4.5 * len(dtypes), 3.6), squeeze=False)
  for ax, dtype in zip(axes[0], dtypes):
    rows = [r for r in fb_rows if r["dtype"] == dtype]
    s = [r["seq_len"] for r in rows]
    for name, style in (("plain", "k--"), ("auto", "C0o-"), ("triton", "C1s:")):
      ax.plot(s, [r[name] for r in rows], style, label=name if name != "plain" else "plain jnp")
    ax.set(xscale="log", yscale="log", xlabel="S (tokens)", title=f"{dtype} inputs")
    ax.set_ylabel("µs per value_and_grad")
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.training_step", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  on_gpu = jax.default_backend() == "gpu"
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      default=list(SEQ_LENS) if on_gpu else [8, 24])
  parser.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
  parser.add_argument("--size", default="1280x3584" if on_gpu else "64x160", help="HxI")
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--no-flax", action="store_true", help="skip the Flax step table")
  parser.add_argument("--breakdown", action="store_true",
                      help="instead of the tables: each kernel's time, plain and auto, at each "
                           "--seq-lens and --dtypes (GPU only), with the optimized HLO")
  parser.add_argument("--out", default=todays_runs_dir(),
                      help="default: benchmarks/results/runs/<UTC date>/")
  args = parser.parse_args(argv)
  hidden, intermediate = map(int, args.size.split("x"))
  stem, date = result_stem(args.out, "training_step")
  commit = os.environ.get("GIT_COMMIT") or subprocess.run(
      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
  meta = dict(device=jax.devices()[0].device_kind, date=date, jax=jax.__version__,
              commit=commit or "unknown", hidden=hidden, intermediate=intermediate,
              method=("CUPTI device time, L2 flushed before every call, median of "
                      f"{args.iterations}") if on_gpu else "CPU wall clock (demo)")
  if args.breakdown:
    text = "".join(breakdown(s, d, hidden, intermediate, args.iterations, stem)
                   for d in args.dtypes for s in args.seq_lens)
    with open(stem + "_breakdown.md", "w") as f:
      f.write(f"# Kernel breakdown ({meta['device']}, {date}, commit {meta['commit']})\n\n"
              + text)
    print(text)
    return
  fb_rows = forward_backward_rows(args.seq_lens, args.dtypes, hidden, intermediate,
                                  args.iterations)
  flax_rows = [] if args.no_flax else flax_step_rows(args.seq_lens, args.dtypes, hidden,
                                                     intermediate, args.iterations)
  with open(stem + ".json", "w") as f:
    json.dump(dict(meta=meta, forward_backward=fb_rows, flax_step=flax_rows), f, indent=1)
  with open(stem + ".md", "w") as f:
    f.write(markdown(meta, fb_rows, flax_rows))
  plot(fb_rows, stem + ".png")
  print(markdown(meta, fb_rows, flax_rows))
  print(f"wrote {stem}.{{json,md,png}}")


if __name__ == "__main__":
  main()
