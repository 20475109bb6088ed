"""`python -m benchmarks.run`: gate, time and report every implementation against XLA.

For each case (H, I, S) it draws fresh inputs, computes the true-fp32
reference once, then for each precision and implementation: jits
`mlp_backward` once, checks the SOL-ExecBench rule (a FAIL is not timed) and
times it (CUPTI, cold L2; see `benchmarks/timing.py`). Peers: XLA at the same
precision and XLA at DEFAULT. Writes `<device>_<date>.{json,md,png}` and
`<device>_latest.*` into --out (default: the run's dated folder,
`benchmarks/results/runs/<UTC date>/`). Listed in `benchmarks/latest.py`, a
run joins the current record, `benchmarks/results/latest/`. Without a GPU it
runs a small CPU demo (Pallas interpret mode, wall-clock times), which is not
a benchmark.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import platform as host_platform
import re
import subprocess
import sys
import time

import jax
import jaxlib
from tqdm import tqdm

import vision_mlp_bwd
from benchmarks import cases, correctness, floors, report, timing
from vision_mlp_bwd import backends
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import check_backward_args

AUTO = "auto"          # implementation=None: the library's own choice
PEER = "xla"           # what every implementation is compared with
QUICK_SEQ_LENS = (64, 449, 1423, 4096)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS_DIR = os.path.join(REPO_ROOT, "benchmarks", "results", "runs")   # one folder per UTC date


def todays_runs_dir() -> str:
  """`benchmarks/results/runs/<UTC date>/`, where a run of today is recorded."""
  return os.path.join(RUNS_DIR, datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))


@dataclasses.dataclass(frozen=True)
class Plan:
  sizes: tuple[tuple[int, int], ...]
  seq_lens: tuple[int, ...]
  precisions: tuple[str, ...]
  implementations: tuple[str, ...]   # without the XLA peer
  warmup: int
  iterations: int
  machine: floors.Machine
  seed: int
  cpu_demo: bool

  def steps(self) -> list[tuple[str, str]]:
    """(precision, implementation) pairs run per case; auto last, so it can reuse a twin."""
    named = [i for i in self.implementations if i != AUTO]
    tail = [AUTO] if AUTO in self.implementations else []
    pairs = [(p, i) for p in self.precisions for i in named + [PEER] + tail]
    if "default" not in self.precisions:
      pairs.append(("default", PEER))
    return pairs


def _size(text: str) -> tuple[int, int]:
  match = re.fullmatch(r"(\d+)[x,](\d+)", text.strip())
  if not match:
    raise argparse.ArgumentTypeError(f"size {text!r} is not HxI, e.g. 1280x3584")
  return int(match[1]), int(match[2])


def parse_args(argv=None) -> tuple[Plan, str | None]:
  on_gpu = jax.default_backend() == "gpu"
  choices = [n for n in backends.names() if n != PEER] + [AUTO]
  parser = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--seq-lens", type=int, nargs="+",
                      help="S values (default: the 16 cases of the contract)")
  parser.add_argument("--sizes", type=_size, nargs="+",
                      help="HxI pairs, among " + " ".join(f"{h}x{i}" for h, i in cases.SIZES)
                      + " (default: 1280x3584)")
  parser.add_argument("--precisions", nargs="+", choices=list(cases.PRECISIONS),
                      default=list(cases.SOL_PRECISIONS))
  parser.add_argument("--bf16", action="store_true", help="add BF16_BF16_F32 to --precisions")
  parser.add_argument("--implementations", nargs="+", choices=choices, default=choices,
                      help="implementations to time (XLA always runs as the peer)")
  parser.add_argument("--warmup", type=int, help="untimed calls first (default 10)")
  parser.add_argument("--iterations", type=int, help="timed calls (default 50)")
  parser.add_argument("--peak-tf32", type=float, default=floors.PEAK_TF32 / 1e12,
                      help="TFLOP/s")
  parser.add_argument("--peak-f16", type=float, default=floors.PEAK_F16 / 1e12, help="TFLOP/s")
  parser.add_argument("--bandwidth", type=float, default=floors.BANDWIDTH / 1e12, help="TB/s")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--out", help="output folder (default: "
                      "benchmarks/results/runs/<UTC date>/, the date the run ends)")
  parser.add_argument("--quick", action="store_true",
                      help=f"S in {QUICK_SEQ_LENS}, 3 warm-up and 15 timed calls (unless given)")
  args = parser.parse_args(argv)

  seq_lens = args.seq_lens or (QUICK_SEQ_LENS if args.quick else cases.SEQ_LENS)
  sizes = args.sizes or ((cases.HIDDEN, cases.INTERMEDIATE),)
  warmup = args.warmup if args.warmup is not None else (3 if args.quick else 10)
  iterations = args.iterations if args.iterations is not None else (15 if args.quick else 50)
  if not on_gpu:  # CPU demo: tiny shapes and few calls unless asked otherwise
    seq_lens = args.seq_lens or cases.CPU_DEMO_SEQ_LENS
    sizes = args.sizes or (cases.CPU_DEMO_SIZE,)
    warmup, iterations = min(warmup, 2), min(iterations, 5)
  precisions = tuple(dict.fromkeys(args.precisions + (["bf16"] if args.bf16 else [])))
  machine = floors.Machine(args.peak_tf32 * 1e12, args.peak_f16 * 1e12, args.bandwidth * 1e12)
  plan = Plan(tuple(sizes), tuple(seq_lens), precisions, tuple(dict.fromkeys(args.implementations)),
              warmup, iterations, machine, args.seed, not on_gpu)
  return plan, args.out


def _resolved_backend(implementation, precision, inputs) -> str:
  """The backend `mlp_backward` runs for these inputs; raises ValueError if it cannot."""
  problem = check_backward_args(*inputs, canonicalize(cases.PRECISIONS[precision]))
  name = None if implementation == AUTO else implementation
  return backends.choose(name, problem, jax.default_backend()).name


def _measure(plan, precision, implementation, inputs, refs, seq_len, record) -> dict:
  """Gate one (precision, implementation) on one case, then time it if it passed."""
  try:
    record["backend"] = _resolved_backend(implementation, precision, inputs)
  except ValueError as e:
    return {**record, "status": "unsupported", "reason": str(e)}
  fn = jax.jit(functools.partial(vision_mlp_bwd.mlp_backward,
                                 precision=cases.PRECISIONS[precision],
                                 implementation=None if implementation == AUTO else implementation))
  try:
    result = correctness.gate(jax.device_get(fn(*inputs)), refs, seq_len, precision)
  except Exception as e:  # a kernel that fails to compile or run is a result, not a crash
    return {**record, "status": "error", "reason": f"{type(e).__name__}: {e}"[:500]}
  claims = precision in cases.SOL_PRECISIONS
  status = "PASS" if result.passed else ("FAIL" if claims else "no claim")
  record.update(status=status, reason=result.reason, min_pass_fraction=result.min_pass_fraction,
                max_rel_frobenius=result.max_rel_frobenius,
                outputs={c.name: dataclasses.asdict(c) for c in result.checks})
  if status == "FAIL":
    return record
  timer = timing.wall_times_us if plan.cpu_demo else timing.device_times_us
  try:
    t = timer(fn, *inputs, warmup=plan.warmup, iterations=plan.iterations)
  except Exception as e:
    return {**record, "timing_error": f"{type(e).__name__}: {e}"[:500]}
  return {**record, **dataclasses.asdict(t)}


def run_case(plan: Plan, hidden: int, intermediate: int, seq_len: int, progress) -> list[dict]:
  """Every (precision, implementation) of `plan` on one freshly drawn case."""
  key = jax.random.fold_in(jax.random.fold_in(jax.random.key(plan.seed), hidden * 100_003
                                              + intermediate), seq_len)
  inputs = cases.make_inputs(key, seq_len, hidden, intermediate)
  refs = correctness.reference_outputs(inputs)
  done: dict[tuple[str, str], dict] = {}
  for precision, implementation in plan.steps():
    progress.set_postfix_str(f"{hidden}x{intermediate} S={seq_len} {precision} {implementation}",
                             refresh=False)
    started = time.time()
    base = dict(hidden=hidden, intermediate=intermediate, seq_len=seq_len, precision=precision,
                implementation=implementation, atol=correctness.atol_for(seq_len),
                floor_us=floors.floor_us(seq_len, hidden, intermediate, precision, plan.machine),
                flops=floors.flops(seq_len, hidden, intermediate),
                bytes=floors.bytes_moved(seq_len, hidden, intermediate))
    twin = None
    if implementation == AUTO:  # same program as a backend timed already: reuse its numbers
      try:
        twin = done.get((precision, _resolved_backend(AUTO, precision, inputs)))
      except ValueError:
        pass
    if twin is not None:
      done[precision, implementation] = {**twin, **base, "same_as": twin["implementation"]}
    else:
      done[precision, implementation] = _measure(plan, precision, implementation, inputs, refs,
                                                 seq_len, base)
    done[precision, implementation]["wall_s"] = round(time.time() - started, 2)  # compile+gate+time
    progress.update()
  return list(done.values())


def _git(*args) -> str:
  try:
    return subprocess.run(["git", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def _device_slug(device_kind: str, cpu_demo: bool) -> str:
  if cpu_demo:
    return "cpu_demo"
  slug = re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_")
  return re.sub(r"^nvidia_", "", slug) or "gpu"


def result_stem(out_dir: str, prefix: str) -> tuple[str, str]:
  """(`out_dir/<prefix>_<device>_<local date-time>`, that date-time) for a result's files;
  the device is `cpu_demo` off the GPU (ignored by git there). Creates `out_dir`."""
  date = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  device = _device_slug(jax.devices()[0].device_kind, jax.default_backend() != "gpu")
  os.makedirs(out_dir, exist_ok=True)
  return os.path.join(out_dir, f"{prefix}_{device}_{date}"), date


def write_result_json(out_dir: str, prefix: str, **fields) -> tuple[str, str]:
  """Writes `<result_stem>.json`: the device, date, JAX version and commit ($GIT_COMMIT),
  then `fields`. Returns (stem, date), for any other file of the same result."""
  stem, date = result_stem(out_dir, prefix)
  with open(stem + ".json", "w") as f:
    json.dump(dict(device=jax.devices()[0].device_kind, date=date, jax=jax.__version__,
                   commit=os.environ.get("GIT_COMMIT", "unknown"), **fields), f, indent=1)
  return stem, date


def main(argv=None) -> dict:
  plan, out_dir = parse_args(argv)
  started = time.time()
  device = jax.devices()[0]
  if plan.cpu_demo:
    print("No GPU: running the CPU demo (Pallas interpret mode, wall-clock times). "
          "CPU demo, not a GPU benchmark.", file=sys.stderr)
  shapes = [(h, i, s) for h, i in plan.sizes for s in plan.seq_lens]
  records = []
  with tqdm(total=len(shapes) * len(plan.steps()), desc="mlp_backward", unit="run",
            mininterval=0.2 if sys.stderr.isatty() else 15) as progress:
    for hidden, intermediate, seq_len in shapes:
      records += run_case(plan, hidden, intermediate, seq_len, progress)
  now = datetime.datetime.now(datetime.timezone.utc)
  meta = dict(
      title=("CPU demo, not a GPU benchmark" if plan.cpu_demo
             else f"vision_mlp_bwd backward on {device.device_kind}"),
      cpu_demo=plan.cpu_demo, device=device.device_kind, platform=jax.default_backend(),
      host=host_platform.node(), jax_version=jax.__version__,
      jaxlib_version=jaxlib.__version__,
      git_commit=os.environ.get("GIT_COMMIT") or _git("rev-parse", "HEAD") or "unknown",
      git_dirty=bool(_git("status", "--porcelain")) and not os.environ.get("GIT_COMMIT"),
      date=now.isoformat(timespec="seconds"), argv=sys.argv[1:] if argv is None else list(argv),
      sizes=plan.sizes, seq_lens=plan.seq_lens, precisions=plan.precisions,
      implementations=plan.implementations, warmup=plan.warmup, iterations=plan.iterations,
      seed=plan.seed, peak_tf32=plan.machine.peak_tf32, peak_f16=plan.machine.peak_f16,
      bandwidth=plan.machine.bandwidth,
      timing=("host wall clock (CPU demo)" if plan.cpu_demo else
              f"CUPTI kernel time per call (sum over its kernels), a {2 * timing.l2_bytes() >> 20}"
              " MiB buffer rewritten before each call to flush the L2; median, p10, p90"),
      reference="reference.mlp_backward in XLA at F32_F32_F32 (true fp32, no TF32)",
      elapsed_s=round(time.time() - started, 1))
  doc = {"meta": meta, "results": records}
  slug = _device_slug(device.device_kind, plan.cpu_demo)
  out_dir = out_dir or os.path.join(RUNS_DIR, f"{now:%Y-%m-%d}")
  paths = report.write_all(doc, out_dir, f"{slug}_{now:%Y%m%d-%H%M%S}", f"{slug}_latest")
  print(report.summary(doc))
  print("wrote " + " ".join(paths) + f" in {meta['elapsed_s']} s")
  return doc


if __name__ == "__main__":
  main()
