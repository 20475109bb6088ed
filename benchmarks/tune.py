"""Searches tile configurations of the Triton backward on the GPU.

    python -m benchmarks.tune --seq-lens 64 256 1024 --modes tf32 f16 --out DIR
    python -m benchmarks.tune --search-configs --seq-lens 64 128 --modes f16 --rounds 5
    python -m benchmarks.tune --variants default cast_inputs weight_grads.block_k=32

Without a flag, for each S, mode and role (pre_activation, weight_grads,
input_grad) it compiles every candidate `TileConfig` in parallel, then times
each launch alone with CUPTI on a cold L2 (benchmarks/timing.py) and prints
the best; `--start` searches around an earlier sweep's winners instead.
Each launch is timed on fp32 activations (16-bit modes cast inside the
kernel). `--search-configs` searches whole-backward `Config`s (the grouped
launches share warps and pipeline depth, so products tuned alone are not the
best pair); `--variants` times named or overridden Configs beside XLA. The
winners feed the tables in `vision_mlp_bwd/backends/triton/configs/h200.json`
(with the result file and commit they came from); the log goes to
`benchmarks/NOTES.md`.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import os

import jax
import jax.numpy as jnp

from benchmarks import gelu_forms
from benchmarks.timing import Timing, device_times_us
from vision_mlp_bwd.backends.triton.config import TileConfig, default_config
from vision_mlp_bwd.backends.triton.kernels import tiled_matmul
from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem

ROLES = ("pre_activation", "weight_grads", "input_grad")


def _pow2_at_least(x):
  p = 16
  while p < x:
    p *= 2
  return p


def candidates(role, s, mode):
  """Tiles worth timing for one launch; rows over S are capped at S rounded up."""
  cap = _pow2_at_least(s)
  steps = (64,) if mode.operand_dtype is not None else (32,)
  out = []
  if role == "weight_grads":
    for bm, bn, bk in itertools.product((64, 128), (64, 128), (32, 64)):
      out.append(TileConfig(bm, bn, bk, num_warps=8 if bm * bn >= 128 * 128 else 4))
    return out
  widths = (32, 64, 128) if role == "pre_activation" else (64, 128)
  splits = (1,) if role == "pre_activation" else (1, 2, 4, 8) if s <= 256 else (1, 2)
  for bm, bn, bk, split in itertools.product((16, 32, 64, 128), widths, steps, splits):
    if bm <= cap:
      out.append(TileConfig(bm, bn, bk, split_k=split,
                            num_warps=8 if bm * bn >= 128 * 128 else 4))
  return out


_AXES = {
    "block_m": (16, 32, 64, 128, 256),
    "block_n": (16, 32, 64, 128, 256),
    "block_k": (16, 32, 64, 128),
    "split_k": (1, 2, 4, 8, 16),
    "num_warps": (2, 4, 8),
    "num_stages": (2, 3, 4, 5, 6),
}


def neighbours(role, tile, s):
  """Tiles one step away from `tile` along one axis (coordinate search).

  The S side of a product with a weight (block_m) stays <= S.
  """
  out = []
  s_axis = None if role == "weight_grads" else "block_m"
  for axis, values in _AXES.items():
    if axis == "split_k" and role == "pre_activation":
      continue
    if axis == s_axis:
      values = tuple(v for v in values if v <= _pow2_at_least(s))
    j = values.index(getattr(tile, axis)) if getattr(tile, axis) in values else None
    if j is None:
      continue
    for k in (j - 1, j + 1):
      if 0 <= k < len(values):
        out.append(dataclasses.replace(tile, **{axis: values[k]}))
  return out


def launch(role, tile, mode, s, h, i):
  """A jitted function running one launch of the backward, and its inputs."""
  keys = jax.random.split(jax.random.key(s), 3)
  pre_dtype = mode.operand_dtype or jnp.float32
  if role == "pre_activation":
    args = (jax.random.normal(keys[0], (s, h)), jax.random.normal(keys[1], (h, i)) / 60.0,
            jax.random.normal(keys[2], (s, i)))
    fn = lambda dy, w2, x: tiled_matmul(dy, w2, gelu_input=x, tile=tile, mode=mode,
                                        out_dtype=pre_dtype)
  elif role == "weight_grads":
    args = (jax.random.normal(keys[0], (s, i)).astype(pre_dtype),
            jax.random.normal(keys[1], (s, h)))
    fn = lambda g, hs: tiled_matmul(g, hs, transpose_a=True, row_sums=True, tile=tile,
                                    mode=mode, out_dtype=jnp.float32)
  else:
    args = (jax.random.normal(keys[0], (s, i)).astype(pre_dtype),
            jax.random.normal(keys[1], (i, h)) / 36.0)
    fn = lambda g, w1: tiled_matmul(g, w1, tile=tile, mode=mode, out_dtype=jnp.float32)
  return jax.jit(fn), args


# Whole-backward variants of the default Config, by name (see Config's fields).
VARIANTS = {
    "default": {},
    "cast_inputs": dict(cast_inputs=True),
    "cast_all": dict(cast_inputs=True, cast_weights=True),
    "k_major": dict(k_major_weight_grads=True),
}


def variant_config(config, name):
  """`config` changed as the variant `name` says: a name of VARIANTS, or overrides
  such as `weight_grads.block_k=32,cast_inputs=1` (comma-separated;
  `role.field` reaches into that role's TileConfig)."""
  if name in VARIANTS:
    return dataclasses.replace(config, **VARIANTS[name])
  changes = {}   # applied at once
  for item in name.split(","):
    path, _, value = item.partition("=")
    role, _, field = path.rpartition(".")
    if not value or not hasattr(config if not role else _role_tile(config, role), field):
      raise SystemExit(f"--variants: {item!r} is neither a name of {sorted(VARIANTS)} "
                       "nor FIELD=VALUE / ROLE.FIELD=VALUE of Config and TileConfig")
    if role:
      changes[role] = dataclasses.replace(changes.get(role, _role_tile(config, role)),
                                          **{field: int(value)})
    else:
      changes[field] = bool(int(value))
  return dataclasses.replace(config, **changes)


def _role_tile(config, role):
  """The TileConfig serving `role`, or None if `config` has no such role."""
  return getattr(config, role, None)


def compare_variants(seq_lens, modes, names, h, i, iterations):
  """Times the whole backward for each Config variant in `names`, and XLA, per S and mode."""
  from benchmarks.cases import make_inputs
  from vision_mlp_bwd import reference
  from vision_mlp_bwd.backends import triton as triton_backend
  rows = []
  for s, mode_name in itertools.product(seq_lens, modes):
    mode = DotMode(mode_name)
    problem = Problem(s, h, i, jnp.dtype(jnp.float32), mode)
    config = default_config(problem)
    inputs = make_inputs(jax.random.key(s), s, h, i)
    fns = {name: functools.partial(triton_backend.backward, problem=problem,
                                   config=variant_config(config, name))
           for name in names}
    fns["xla"] = functools.partial(reference.mlp_backward, precision=mode)
    times = {}
    for name, fn in fns.items():
      try:
        times[name] = device_times_us(jax.jit(fn), *inputs, iterations=iterations)
      except Exception as e:  # noqa: BLE001 - e.g. shared memory limits: report, go on
        print(f"S={s} {mode_name} {name}: {type(e).__name__}: {str(e).splitlines()[0][:160]}")
        times[name] = Timing(float("nan"), float("nan"), float("nan"), 0)
    print(f"S={s:5d} {mode_name:5s} " + " ".join(
        f"{name} {t.median_us:6.1f} ({t.kernels})" for name, t in times.items()), flush=True)
    for name, t in times.items():
      print(f"    {name}: " + ", ".join(f"{k[:40]} {us:.1f}" for k, us in
                                       zip(t.kernel_names, t.kernel_median_us)), flush=True)
    rows.append(dict(seq_len=s, mode=mode_name, **{n: t.median_us for n, t in times.items()},
                     kernels={n: list(zip(t.kernel_names, t.kernel_median_us))
                              for n, t in times.items()}))
  return rows


# The grouped launches take warps and pipeline depth from their first product
# (pre_activation, input_grad), so the weight-gradient tiles (one for both
# weight gradients) search neither.
_LAUNCH_AXES = {
    "pre_activation": ("block_m", "block_n", "block_k", "num_warps", "num_stages"),
    "weight_grads": ("block_m", "block_n", "block_k"),
    "input_grad": ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages"),
}


def config_neighbours(config, s, sixteen_bit):
  """Configs one step from `config` along one axis of one role, or one layout flag flipped."""
  out = []
  for role, axes in _LAUNCH_AXES.items():
    for tile in neighbours(role, _role_tile(config, role), s):
      changed = [a for a in axes if getattr(tile, a) != getattr(_role_tile(config, role), a)]
      if changed:
        out.append(dataclasses.replace(config, **{role: tile}))
  # 16-bit tiles transpose for free, so K-major copies are a 32-bit question.
  flags = ("cast_inputs", "cast_weights") if sixteen_bit else ("k_major_weight_grads",)
  flags += ("sum_splits_in_kernel",)
  if sixteen_bit and config.cast_inputs:   # fused_casts changes nothing without cast_inputs
    flags += ("fused_casts",)
  out += [dataclasses.replace(config, **{flag: not getattr(config, flag)}) for flag in flags]
  return out


def search_configs(seq_lens, modes, h, i, rounds, iterations, out_path, seeds=()):
  """Coordinate search over whole-backward Configs, starting at the table's.

  The first round times the table's Config and the `seeds` (variants of it,
  see `variant_config`); each later round times every neighbour of the best
  Config so far (compiled in parallel, timed in turn). The winner is then
  re-timed beside the table's Config and XLA with more calls, and checked
  against the SOL gate.
  """
  from benchmarks import correctness
  from benchmarks.cases import make_inputs
  from vision_mlp_bwd import reference
  from vision_mlp_bwd.backends import triton as triton_backend
  rows = []
  for s, mode_name in itertools.product(seq_lens, modes):
    mode = DotMode(mode_name)
    problem = Problem(s, h, i, jnp.dtype(jnp.float32), mode)
    inputs = make_inputs(jax.random.key(s), s, h, i)
    run = lambda c: jax.jit(functools.partial(triton_backend.backward, problem=problem, config=c))
    table = default_config(problem)
    timed, executables = {}, {}
    frontier = [table, *(variant_config(table, seed) for seed in seeds)]
    for _ in range(rounds + bool(seeds)):
      frontier = [c for c in dict.fromkeys(frontier) if c not in timed]
      with concurrent.futures.ThreadPoolExecutor(12) as pool:
        compiled = list(pool.map(lambda c: _compile(run(c), inputs)[0], frontier))
      for config, fn in zip(frontier, compiled):
        executables[config] = fn
        timed[config] = (None if fn is None else
                         device_times_us(fn, *inputs, warmup=3, iterations=iterations).median_us)
      ok = {c: t for c, t in timed.items() if t is not None}
      best = min(ok, key=ok.get)
      frontier = config_neighbours(best, s, mode.operand_dtype is not None)
    xla = jax.jit(functools.partial(reference.mlp_backward, precision=mode))
    timings = {name: device_times_us(fn, *inputs, iterations=3 * iterations)
               for name, fn in (("table", executables[table]), ("best", executables[best]),
                                ("xla", xla))}
    final = {name: t.median_us for name, t in timings.items()}
    per_kernel = {name: list(zip(t.kernel_names, t.kernel_median_us)) for name, t in timings.items()}
    verdict = correctness.gate(executables[best](*inputs), correctness.reference_outputs(inputs),
                               s, "default" if mode == DotMode.TF32 else mode_name)
    print(f"S={s:5d} {mode_name:5s} table {final['table']:6.1f} best {final['best']:6.1f} "
          f"xla {final['xla']:6.1f} ({final['xla'] / final['best']:.2f}x, {len(timed)} timed, "
          f"gate {'PASS' if verdict.passed else 'FAIL ' + verdict.reason}) {best}", flush=True)
    print("  best, per kernel: " + ", ".join(f"{n} {us:.1f}" for n, us in per_kernel["best"]))
    rows.append(dict(seq_len=s, mode=mode_name, us=final, per_kernel_us=per_kernel,
                     passed=verdict.passed,
                     best=dataclasses.asdict(best), table=dataclasses.asdict(table),
                     timed=[dict(config=dataclasses.asdict(c), us=t) for c, t in timed.items()]))
    with open(out_path, "w") as f:   # after every case, so a cut-off run keeps what it has
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f)
  return rows


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 256, 768])
  parser.add_argument("--modes", nargs="+", default=["tf32", "f16"])
  parser.add_argument("--roles", nargs="+", default=list(ROLES))
  parser.add_argument("--hidden", type=int, default=1280)
  parser.add_argument("--intermediate", type=int, default=3584)
  parser.add_argument("--iterations", type=int, default=20)
  parser.add_argument("--out", default=os.environ.get("RESULTS_DIR", "."))
  parser.add_argument("--start", type=_best_of, default=None,
                      help="tune.json of an earlier sweep: search around its winners")
  parser.add_argument("--rounds", type=int, default=3, help="coordinate-search rounds")
  parser.add_argument("--variants", nargs="+",
                      help="time these whole-backward Config variants (and XLA) instead: "
                           f"names of {sorted(VARIANTS)} or overrides, see variant_config")
  parser.add_argument("--search-configs", action="store_true",
                      help="coordinate search over whole-backward Configs instead (search.json)")
  parser.add_argument("--seeds", nargs="+", default=(),
                      help="with --search-configs: variants (as --variants takes them) timed "
                           "beside the table's Config in a first round")
  parser.add_argument("--gelu-form", default=None,
                      help="the GELU derivative's form in every kernel (benchmarks/gelu_forms.py; "
                           "default: the package's)")
  args = parser.parse_args()

  gelu_forms.use(args.gelu_form)
  h, i = args.hidden, args.intermediate
  os.makedirs(args.out, exist_ok=True)
  if args.search_configs:
    search_configs(args.seq_lens, args.modes, h, i, args.rounds, args.iterations,
                   os.path.join(args.out, "search.json"), args.seeds)
    return
  if args.variants:
    rows = compare_variants(args.seq_lens, args.modes, args.variants, h, i, args.iterations)
    with open(os.path.join(args.out, "variants.json"), "w") as f:
      json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f)
    return
  results = []
  for s, mode_name, role in itertools.product(args.seq_lens, args.modes, args.roles):
    mode = DotMode(mode_name)
    default = getattr(default_config(Problem(s, h, i, jnp.dtype(jnp.float32), mode)), role)
    if args.start:
      start = [TileConfig(**r["tile"]) for r in args.start
               if (r["seq_len"], r["mode"], r["role"]) == (s, mode_name, role)]
      timed = {}
      frontier = [default] + start[:1]
      for _ in range(args.rounds):
        frontier = [t for t in dict.fromkeys(frontier) if t not in timed]
        timed.update(_time_all(frontier, role, mode, s, h, i, args.iterations))
        ok = [t for t in timed if timed[t][0] is not None]
        if not ok:
          break
        frontier = neighbours(role, min(ok, key=lambda t: timed[t][0]), s)
    else:
      tiles = list(dict.fromkeys([default, *candidates(role, s, mode)]))
      timed = _time_all(tiles, role, mode, s, h, i, args.iterations)
    rows = [(tile, us, err) for tile, (us, err) in timed.items()]
    ok = sorted((r for r in rows if r[1] is not None), key=lambda r: r[1])
    default_us = timed.get(default, (None, None))[0]
    best = ok[0] if ok else (None, None, None)
    print(f"S={s:5d} {mode_name:5s} {role:15s} default {default_us or float('nan'):8.1f} us "
          f"best {best[1] or float('nan'):8.1f} us {best[0]}", flush=True)
    for tile, us, err in rows:
      results.append(dict(seq_len=s, mode=mode_name, role=role, tile=tile.__dict__, us=us,
                          error=err, default=tile == default))
  with open(os.path.join(args.out, "tune.json"), "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, results=results),
              f, indent=1)


def _time_all(tiles, role, mode, s, h, i, iterations):
  """{tile: (median us or None, error or None)}, compiling in parallel, timing in turn."""
  jobs = [launch(role, t, mode, s, h, i) for t in tiles]
  with concurrent.futures.ThreadPoolExecutor(8) as pool:
    compiled = list(pool.map(lambda job: _compile(*job), jobs))
  out = {}
  for tile, (fn, call_args) in zip(tiles, compiled):
    if fn is None:
      out[tile] = (None, call_args)
    else:
      out[tile] = (device_times_us(fn, *call_args, warmup=3, iterations=iterations).median_us, None)
  return out


def _best_of(path):
  """The fastest tile per (S, mode, role) of an earlier tune.json."""
  with open(path) as f:
    results = [r for r in json.load(f)["results"] if r["us"] is not None]
  results.sort(key=lambda r: r["us"])
  return results


def _compile(fn, args):
  try:
    return fn.lower(*args).compile(), args
  except Exception as e:  # a tile Triton rejects (e.g. out of shared memory)
    return None, f"{type(e).__name__}: {str(e)[:200]}"


if __name__ == "__main__":
  main()
