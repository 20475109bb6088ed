"""`python -m benchmarks.latest`: rebuilds `benchmarks/results/latest/`, the current H200 record.

From the dated benchmark runs in RUNS (oldest first) it takes, for every
(precision, S) measured at H=1280, I=3584, the newest run that measured that
precision at that S (a later run of a case, after the kernels or their tiles
changed, replaces the earlier one), and writes into `benchmarks/results/latest/`:

- `h200.json`: one entry per (precision, S, implementation) of that run, with its
  gate status, median/p10/p90 µs, the backend that ran, the run file it came
  from and that run's commit, date and JAX version (where the run recorded them);
- `README.md`: the same as one table per precision (shown when browsing the folder);
- `h200_suite.md`, `h200_suite.png`: copies of the newest run of the whole suite
  (every seed case at DEFAULT, F16 and HIGHEST).

Adding a run is one line in RUNS, then `python -m benchmarks.latest`;
`tests/test_routing.py` reads `latest/h200.json` and fails while it is stale.
"""

from __future__ import annotations

import json
import pathlib

from benchmarks import cases

REPO_ROOT = pathlib.Path(__file__).resolve().parent.parent
LATEST = REPO_ROOT / "benchmarks" / "results" / "latest"
DEVICE = "NVIDIA H200"

# The dated runs that make up the record, oldest first (paths from the repository root).
RUNS = [
    "benchmarks/results/runs/2026-11-29/h200_20261129-154647.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-154757.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-164332.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-164909.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-173705.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-173951.json",
    "benchmarks/results/runs/2026-11-29/h200_tf32_rounding_20261129-174805.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-185533.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-185704.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-195252.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-195442.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-213131.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-213848.json",
    "benchmarks/results/runs/2026-11-29/h200_bf16_20261129-223832.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-224039.json",
    "benchmarks/results/runs/2026-11-29/h200_20261129-235353.json",
    "benchmarks/results/runs/2026-11-30/h200_20261130-010521.json",
    "benchmarks/results/runs/2026-11-30/h200_20261130-021150.json",
    "benchmarks/results/runs/2026-11-30/h200_20261130-022805.json",
    "benchmarks/results/runs/2026-12-01/h200_20261201-092423.json",
    "benchmarks/results/runs/2026-12-03/h200_20261203-071923.json",
    "benchmarks/results/runs/2026-12-04/h200_20261204-164221.json",
]

FIELDS = ("status", "backend", "same_as", "median_us", "p10_us", "p90_us", "floor_us",
          "max_rel_frobenius", "kernels")
IMPLEMENTATIONS = ("triton", "xla", "auto")   # table order; others follow by name


def _provenance(meta: dict) -> dict:
  out = {"date": meta.get("date"), "jax_version": meta.get("jax_version")}
  if meta.get("git_commit") not in (None, "", "unknown"):
    out["commit"] = meta["git_commit"]
    if meta.get("git_dirty"):
      out["dirty"] = True
  return {k: v for k, v in out.items() if v is not None}


def _order(entry: dict) -> tuple:
  precisions = list(cases.PRECISIONS)
  implementation = entry["implementation"]
  known = IMPLEMENTATIONS.index(implementation) if implementation in IMPLEMENTATIONS else 99
  return (precisions.index(entry["precision"]), entry["seq_len"], known, implementation)


def build(runs=RUNS) -> dict:
  """The record: for each (precision, S), every implementation from the newest run measuring it."""
  newest: dict[tuple[str, int], list[dict]] = {}
  suite = None
  for run in runs:
    doc = json.loads((REPO_ROOT / run).read_text())
    meta = doc["meta"]
    assert meta["device"] == DEVICE, (run, meta["device"])
    provenance = _provenance(meta)
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in doc["results"]:
      # Only the precisions the run was asked for: a bf16 run also times XLA at DEFAULT.
      if ((r["hidden"], r["intermediate"]) != (cases.HIDDEN, cases.INTERMEDIATE)
          or r["precision"] not in meta["precisions"]):
        continue
      entry = {"precision": r["precision"], "seq_len": r["seq_len"],
               "implementation": r["implementation"]}
      entry.update({k: r[k] for k in FIELDS if r.get(k) is not None})
      entry.update(run=run, **provenance)
      groups.setdefault((r["precision"], r["seq_len"]), []).append(entry)
    newest.update(groups)
    if (set(cases.SEQ_LENS) <= set(meta["seq_lens"])
        and set(cases.SOL_PRECISIONS) <= set(meta["precisions"])):
      suite = run
  assert suite is not None, "no run of the whole suite in RUNS"
  results = sorted((e for group in newest.values() for e in group), key=_order)
  return {
      "about": ("The newest H200 measurement of every (precision, S) at H=1280, I=3584: "
                "benchmarks/latest.py merges the runs below, oldest first, a later run of a "
                "case replacing the earlier one. Times are CUPTI device time per call, L2 "
                "flushed before each call, medians."),
      "device": DEVICE, "hidden": cases.HIDDEN, "intermediate": cases.INTERMEDIATE,
      "runs": list(runs),
      "suite": {"run": suite, "md": "benchmarks/results/latest/h200_suite.md",
                "png": "benchmarks/results/latest/h200_suite.png"},
      "results": results,
  }


def _us(entry: dict | None) -> str:
  if entry is None:
    return "—"
  if entry.get("median_us") is None:
    return entry.get("status", "—")
  return f"{entry['median_us']:.1f}"


def markdown(record: dict) -> str:
  lines = [f"# The current record on the {record['device']} (H={record['hidden']}, "
           f"I={record['intermediate']})", "",
           "Written by `python -m benchmarks.latest` from the runs it lists (`h200.json` has "
           "every number). Per (precision, S) all columns come from the same run, the newest "
           "that measured it; × is XLA's time at the same precision over the kernels'. The "
           "newest whole suite is `h200_suite.md`.", ""]
  by_case: dict[tuple[str, int], dict[str, dict]] = {}
  for e in record["results"]:
    by_case.setdefault((e["precision"], e["seq_len"]), {})[e["implementation"]] = e
  for precision in cases.PRECISIONS:
    rows = sorted(s for p, s in by_case if p == precision)
    if not rows:
      continue
    lines += [f"## {precision}", "",
              "| S | floor µs | triton µs | × XLA | auto µs (backend) | XLA µs | run | commit |",
              "|---|---|---|---|---|---|---|---|"]
    for s in rows:
      row = by_case[precision, s]
      triton, xla, auto = row.get("triton"), row.get("xla"), row.get("auto")
      ratio = ("—" if not (triton and xla and triton.get("median_us") and xla.get("median_us"))
               else f"{xla['median_us'] / triton['median_us']:.2f}")
      auto_text = _us(auto) + (f" ({auto['backend']})" if auto and auto.get("backend") else "")
      any_entry = next(iter(row.values()))
      run = any_entry["run"].removeprefix("benchmarks/results/")
      floor = any_entry.get("floor_us")
      lines.append(f"| {s} | {'—' if floor is None else f'{floor:.1f}'} | {_us(triton)} | "
                   f"{ratio} | {auto_text} | {_us(xla)} | `{run}` | "
                   f"{any_entry.get('commit', 'unknown')[:7]} |")
    lines.append("")
  return "\n".join(lines)


def _json(record: dict) -> str:
  """Indented, with one line per result entry."""
  head = json.dumps({k: v for k, v in record.items() if k != "results"}, indent=1,
                    ensure_ascii=False)
  entries = ",\n".join("  " + json.dumps(e, ensure_ascii=False) for e in record["results"])
  return head[:-2] + ',\n "results": [\n' + entries + "\n ]\n}\n"


def expected_files(runs=RUNS) -> dict[str, bytes]:
  """File name in latest/ -> its content, as RUNS makes them."""
  record = build(runs)
  suite = REPO_ROOT / record["suite"]["run"]
  return {
      "h200.json": _json(record).encode(),
      "README.md": markdown(record).encode(),
      "h200_suite.md": suite.with_suffix(".md").read_bytes(),
      "h200_suite.png": suite.with_suffix(".png").read_bytes(),
  }


def main() -> None:
  LATEST.mkdir(parents=True, exist_ok=True)
  for name, content in expected_files().items():
    (LATEST / name).write_bytes(content)
    print(f"wrote {(LATEST / name).relative_to(REPO_ROOT)}")


if __name__ == "__main__":
  main()
