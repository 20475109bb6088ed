"""`python -m benchmarks.timeline TRACE.json ...`: what overlaps what in one engine launch.

Reads the per-warpgroup timeline that `engine.traced` makes Pallas write (a Chrome trace:
each block's "mainloop" and "epilogue" regions, per warpgroup of each program; see
`benchmarks/epilogue_costs.py --trace-dir`) and prints, per trace: the launch's span; the
mean mainloop and epilogue of a block; how much of the compute warpgroups' epilogues ran
while the other compute warpgroup of the program was in a mainloop (hidden under its
MMAs); and the time no compute warpgroup of a program was in a mainloop (the tensor cores
idle), as a share of the span. Warpgroups 0 and 1 of a program compute; 2 loads.
"""

from __future__ import annotations

import argparse
import collections
import json

WARPGROUPS = 3   # per program: two compute warpgroups and the memory warpgroup


def intervals(trace: dict) -> dict:
  """{(program, warpgroup): {name: [(start, end) µs, ...]}} of a trace's regions."""
  open_at, found = {}, collections.defaultdict(lambda: collections.defaultdict(list))
  for event in trace["traceEvents"]:
    key = divmod(event["tid"] - 1, WARPGROUPS)
    if event["ph"] == "B":
      open_at[key, event["name"]] = event["ts"]
    else:
      found[key][event["name"]].append((open_at.pop((key, event["name"])), event["ts"]))
  return found


def _covered(span, others) -> float:
  """How much of `span` the union of the intervals `others` covers."""
  start, end = span
  covered, reach = 0.0, start
  for a, b in sorted(others):
    a, b = max(a, reach), min(b, end)
    if b > a:
      covered += b - a
      reach = b
  return covered


def summary(trace: dict) -> dict:
  regions = intervals(trace)
  everything = [t for wg in regions.values() for spans in wg.values() for s in spans for t in s]
  span = max(everything) - min(everything)
  programs = sorted({program for program, _ in regions})
  mainloops, epilogues, hidden, idle = [], [], 0.0, 0.0
  for program in programs:
    compute = [regions.get((program, wg), {}) for wg in (0, 1)]
    for wg in (0, 1):
      mainloops += [b - a for a, b in compute[wg].get("mainloop", [])]
      for epilogue in compute[wg].get("epilogue", []):
        epilogues.append(epilogue[1] - epilogue[0])
        hidden += _covered(epilogue, compute[1 - wg].get("mainloop", []))
    loops = compute[0].get("mainloop", []) + compute[1].get("mainloop", [])
    if loops:
      first = min(a for a, _ in loops)
      last = max(b for _, b in compute[0].get("epilogue", []) + compute[1].get("epilogue", [])
                 + loops)
      idle += (last - first) - _covered((first, last), loops)
  mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")
  return dict(span_us=span, programs=len(programs), blocks=len(mainloops),
              mainloop_us=mean(mainloops), epilogue_us=mean(epilogues),
              epilogue_hidden=hidden / sum(epilogues) if epilogues else float("nan"),
              no_mainloop_share=idle / (span * len(programs)) if programs else float("nan"))


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.timeline", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("traces", nargs="+")
  args = parser.parse_args(argv)
  for path in args.traces:
    with open(path) as f:
      s = summary(json.load(f))
    print(f"{path}: span {s['span_us']:.1f} us, {s['programs']} programs, {s['blocks']} "
          f"blocks; a block's mainloop {s['mainloop_us']:.2f} us, epilogue "
          f"{s['epilogue_us']:.2f} us; epilogues hidden under the other warpgroup's "
          f"mainloop {100 * s['epilogue_hidden']:.0f}%; no mainloop running "
          f"{100 * s['no_mainloop_share']:.0f}% of the span", flush=True)


if __name__ == "__main__":
  main()
