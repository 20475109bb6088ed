"""Writers for one benchmark run: JSON (every number), a markdown table, a PNG plot.

`doc` is `{"meta": {...}, "results": [record, ...]}` as `benchmarks.run`
builds it; a record is one (H, I, S, precision, implementation) with its gate
outcome and, when timed, `median_us`, `p10_us`, `p90_us`, `kernels`.
Speedups are XLA's time at the same precision over ours; SOL % is
100 · floor / time (100% = at the speed-of-light floor).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

from benchmarks import floors

PEER = "xla"


def _index(records) -> dict:
  return {(r["hidden"], r["intermediate"], r["seq_len"], r["precision"], r["implementation"]): r
          for r in records}


def _time(record) -> float | None:
  return record.get("median_us") if record else None


def _groups(doc):
  """(hidden, intermediate, precision, implementations to show) in run order."""
  meta = doc["meta"]
  shown = [i for i in meta["implementations"] if i != PEER]
  for hidden, intermediate in meta["sizes"]:
    for precision in meta["precisions"]:
      yield hidden, intermediate, precision, shown


def _cell(record) -> str:
  t = _time(record)
  if t is not None:
    return f"{t:.1f}"
  if not record:
    return "—"
  return {"PASS": "untimed"}.get(record.get("status"), record.get("status", "—"))


def _ratio(numerator, denominator, scale=1.0, fmt="{:.2f}") -> str:
  if numerator is None or denominator is None or not denominator:
    return "—"
  return fmt.format(scale * numerator / denominator)


def _mean(values) -> float | None:
  """Mean over cases; None unless every case has a value (the problem's figure needs all)."""
  return None if not values or any(v is None for v in values) else float(np.mean(values))


def _table(doc, hidden, intermediate, precision, shown) -> list[str]:
  index = _index(doc["results"])
  with_default = precision != "default"   # XLA at DEFAULT, what a user gets without asking
  head = ["S", "floor µs"]
  for impl in shown:
    head += [f"{impl} µs", "× XLA", "SOL %"]
  head += ["XLA µs", "SOL %"] + (["XLA default µs"] if with_default else [])
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  columns = {name: [] for name in ["floor", *shown, PEER, "default"]}
  for s in doc["meta"]["seq_lens"]:
    get = lambda impl, p=precision: index.get((hidden, intermediate, s, p, impl))
    peer = get(PEER)
    floor = next((r["floor_us"] for r in map(get, [PEER, *shown]) if r), None)
    row = [str(s), "—" if floor is None else f"{floor:.1f}"]
    for impl in shown:
      record = get(impl)
      twin = f" (={record['same_as']})" if record and "same_as" in record else ""
      row += [_cell(record) + twin, _ratio(_time(peer), _time(record)),
              _ratio(floor, _time(record), 100, "{:.0f}")]
      columns[impl].append(_time(record))
    row += [_cell(peer), _ratio(floor, _time(peer), 100, "{:.0f}")]
    row += [_cell(get(PEER, "default"))] if with_default else []
    columns["floor"].append(floor)
    columns[PEER].append(_time(peer))
    columns["default"].append(_time(get(PEER, "default")))
    lines.append("| " + " | ".join(row) + " |")
  means = {name: _mean(values) for name, values in columns.items()}
  fmt = lambda v: "—" if v is None else f"{v:.1f}"
  row = ["**mean**", fmt(means["floor"])]
  for impl in shown:
    row += [f"**{fmt(means[impl])}**", _ratio(means[PEER], means[impl]),
            _ratio(means["floor"], means[impl], 100, "{:.0f}")]
  row += [fmt(means[PEER]), _ratio(means["floor"], means[PEER], 100, "{:.0f}")]
  row += [fmt(means["default"])] if with_default else []
  lines.append("| " + " | ".join(row) + " |")
  return lines


def _gate_table(doc) -> list[str]:
  """One line per (size, precision, implementation): gate outcome over all cases."""
  lines = ["| size | precision | implementation | gate | worst pass % | max rel. Frobenius |"
           " kernels/call |", "|---|---|---|---|---|---|---|"]
  groups: dict[tuple, list] = {}
  for r in doc["results"]:
    groups.setdefault((r["hidden"], r["intermediate"], r["precision"], r["implementation"]),
                      []).append(r)
  for (h, i, precision, impl), records in groups.items():
    statuses = [r.get("status", "?") for r in records]
    passed = sum(s == "PASS" for s in statuses)
    gate = (f"PASS {passed}/{len(records)}" if passed else "") + "".join(
        f" {s} {statuses.count(s)}" for s in dict.fromkeys(statuses) if s != "PASS")
    fractions = [r["min_pass_fraction"] for r in records if "min_pass_fraction" in r]
    errors = [r["max_rel_frobenius"] for r in records if "max_rel_frobenius" in r]
    kernels = sorted({r["kernels"] for r in records if r.get("kernels")})
    lines.append(f"| {h}x{i} | {precision} | {impl} | {gate.strip()} | "
                 + (f"{100 * min(fractions):.2f}" if fractions else "—") + " | "
                 + (f"{max(errors):.1e}" if errors else "—") + " | "
                 + ("/".join(map(str, kernels)) or "—") + " |")
  return lines


def markdown(doc) -> str:
  meta = doc["meta"]
  lines = [f"# {meta['title']}", ""]
  if meta["cpu_demo"]:
    lines += ["**CPU demo, not a GPU benchmark**: tiny shapes, Pallas interpret mode, host "
              "wall-clock times; floors are H200 numbers and mean nothing here.", ""]
  lines += [f"{meta['date']} · {meta['device']} · JAX {meta['jax_version']} · commit "
            f"`{meta['git_commit'][:12]}`{' (dirty)' if meta['git_dirty'] else ''} · "
            f"{meta['warmup']} warm-up + {meta['iterations']} timed calls · {meta['timing']}.",
            "",
            f"Times are medians in µs. × XLA = XLA's time at the same precision / ours. "
            f"SOL % = 100 · floor / time, floor = max(8·S·H·I / peak, bytes / "
            f"{meta['bandwidth'] / 1e12:g} TB/s) with peak {meta['peak_tf32'] / 1e12:g} TFLOP/s "
            f"(TF32; default, highest) or {meta['peak_f16'] / 1e12:g} TFLOP/s (f16, bf16). "
            "A FAIL is not timed; `(=xla)` marks auto running the same program as xla. "
            "Means are over all cases and shown only when every case has a time.", ""]
  for hidden, intermediate, precision, shown in _groups(doc):
    lines += [f"## H={hidden}, I={intermediate}, precision {precision}", ""]
    lines += _table(doc, hidden, intermediate, precision, shown) + [""]
  lines += ["## Correctness gate (SOL-ExecBench rule vs true fp32; highest also rel. Frobenius "
            "<= 1e-5)", ""] + _gate_table(doc) + [""]
  failures = [r for r in doc["results"] if r.get("reason") or r.get("timing_error")]
  if failures:
    lines += ["## Failures", ""]
    lines += [f"- {r['hidden']}x{r['intermediate']} S={r['seq_len']} {r['precision']} "
              f"{r['implementation']}: {r.get('status', '')} {r.get('reason', '')} "
              f"{r.get('timing_error', '')}".rstrip() for r in failures] + [""]
  return "\n".join(lines)


def summary(doc) -> str:
  """The mean rows of every table, for the console."""
  out = [doc["meta"]["title"]]
  for hidden, intermediate, precision, shown in _groups(doc):
    table = _table(doc, hidden, intermediate, precision, shown)
    out += [f"H={hidden} I={intermediate} precision {precision}, mean over cases:", table[0],
            table[-1]]
  return "\n".join(out)


def plot(doc, path: str) -> None:
  """Time vs S per implementation and precision with the floors; speedup vs XLA beside it."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  meta, index = doc["meta"], _index(doc["results"])
  sizes, seq_lens = meta["sizes"], meta["seq_lens"]
  colors = dict(zip(meta["precisions"], plt.rcParams["axes.prop_cycle"].by_key()["color"]))
  styles = {PEER: ":", "auto": "-."}
  fig, axes = plt.subplots(len(sizes), 2, figsize=(13, 4.8 * len(sizes)), squeeze=False)
  for (hidden, intermediate), (ax_time, ax_speed) in zip(sizes, axes):
    def series(precision, impl, key=_time):
      points = [(s, key(index.get((hidden, intermediate, s, precision, impl)))) for s in seq_lens]
      return [p for p in points if p[1] is not None]
    for precision in meta["precisions"]:
      for impl in [i for i in meta["implementations"] if i != PEER] + [PEER]:
        points = series(precision, impl)
        if points:
          ax_time.plot(*zip(*points), styles.get(impl, "-"), marker="o", ms=3,
                       color=colors[precision], label=f"{impl} {precision}")
        if impl == PEER:
          continue
        peer = dict(series(precision, PEER))
        speed = [(s, peer[s] / t) for s, t in points if s in peer]
        if speed:
          ax_speed.plot(*zip(*speed), styles.get(impl, "-"), marker="o", ms=3,
                        color=colors[precision], label=f"{impl} {precision}")
    machine = floors.Machine(meta["peak_tf32"], meta["peak_f16"], meta["bandwidth"])
    for precision, style, label in (("default", "-", "floor TF32"), ("f16", "--", "floor f16")):
      floor = [floors.floor_us(s, hidden, intermediate, precision, machine) for s in seq_lens]
      ax_time.plot(seq_lens, floor, style, color="black", lw=1.5, label=label)
    ax_time.set(xscale="log", yscale="log", xlabel="S (tokens)", ylabel="time per call (µs)",
                title=f"H={hidden}, I={intermediate}: median time")
    ax_speed.axhline(1.0, color="gray", lw=1)
    ax_speed.set(xscale="log", xlabel="S (tokens)", ylabel="× XLA (same precision)",
                 title="speedup vs XLA at the same precision")
    for ax in (ax_time, ax_speed):
      ax.grid(True, which="both", alpha=0.3)
      if ax.lines:
        ax.legend(fontsize=7)
  fig.suptitle(meta["title"] + f" ({meta['date']})")
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_all(doc, out_dir: str, stem: str, latest_stem: str | None = None) -> list[str]:
  """Writes stem.{json,md,png} (and copies as latest_stem.*) into out_dir; returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  paths = [os.path.join(out_dir, f"{stem}.{ext}") for ext in ("json", "md", "png")]
  with open(paths[0], "w") as f:
    json.dump(doc, f, indent=1, default=_jsonable)
  with open(paths[1], "w") as f:
    f.write(markdown(doc))
  plot(doc, paths[2])
  if latest_stem:
    for path in list(paths):
      paths.append(shutil.copyfile(path, os.path.join(out_dir, latest_stem + path[path.rfind("."):])))
  return paths


def _jsonable(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  raise TypeError(f"cannot write {type(x).__name__} to JSON")
