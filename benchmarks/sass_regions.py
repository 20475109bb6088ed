"""`python -m benchmarks.sass_regions SOURCE.csv[.gz] --regions NAME=FIRST:END ...`: where a
kernel's instructions and stalls go, by region of its SASS.

Reads ncu's source page of one kernel (`ncu --set full -o REPORT ...`, then `ncu -i
REPORT.ncu-rep --page source --csv --print-source sass > SOURCE.csv`) and prints, for the
whole kernel and for each region (a range of SASS instruction indices, 0 the first
instruction, END excluded): the instructions executed (warp instructions) and, with
`--elements`, per 32 of them (per output element of an elementwise epilogue), the warp
stall samples by reason, and the opcodes by how often they ran; then the `--hottest`
instructions of each region by stall samples. Regions are read off the listing (the loop
that issues the TMA loads, the one around HGMMA, the straight-line epilogue).

  python -m benchmarks.sass_regions ncu_sass.csv.gz --elements 14680064 \\
      --regions memory=236:372 mainloop=600:720 epilogue=720:4500
"""

from __future__ import annotations

import argparse
import collections
import csv
import dataclasses
import gzip

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"
STALL_PREFIX = "stall_"


@dataclasses.dataclass(frozen=True)
class Instruction:
  source: str
  opcode: str            # without modifiers or predicate: "FMUL", "SYNCS", ...
  executed: float        # warp instructions
  samples: float
  stalls: dict           # reason -> samples


def _number(text: str) -> float:
  try:
    return float(text.replace(",", ""))
  except ValueError:
    return 0.0


def read(path: str) -> list[Instruction]:
  """The instructions of ncu's source-page CSV (plain or gzipped), in SASS order."""
  opener = gzip.open if path.endswith(".gz") else open
  with opener(path, "rt", newline="") as f:
    rows = list(csv.reader(f))
  header_at = next(i for i, row in enumerate(rows) if "Source" in row and EXECUTED in row)
  header = rows[header_at]
  column = {name: i for i, name in enumerate(header)}
  reasons = [name for name in header if name.startswith(STALL_PREFIX)
             and "Not Issued" not in name]
  found = []
  for row in rows[header_at + 1:]:
    if len(row) < len(header):
      continue
    source = row[column["Source"]].strip()
    words = [w for w in source.split() if not w.startswith("@")]   # (no predicate)
    opcode = words[0] if words else ""
    found.append(Instruction(
        source, opcode.split(".")[0], _number(row[column[EXECUTED]]),
        _number(row[column[SAMPLES]]),
        {name[len(STALL_PREFIX):]: _number(row[column[name]]) for name in reasons}))
  return found


def summary(instructions, name: str, elements: int | None = None, opcodes: int = 16,
            reasons: int = 9) -> str:
  """One region's lines: executed, per element, samples by reason, opcodes by count."""
  executed = sum(i.executed for i in instructions)
  per = (lambda n: f" ({n / (elements / 32):.2f} per element)") if elements else (lambda n: "")
  stalls, counts = collections.Counter(), collections.Counter()
  for i in instructions:
    stalls.update(i.stalls)
    counts[i.opcode] += i.executed
  lines = [f"{name}: {len(instructions)} static, {executed:.0f} executed{per(executed)}, "
           f"{sum(i.samples for i in instructions):.0f} stall samples",
           "  stall samples: " + ", ".join(f"{k} {v:.0f}" for k, v in
                                           stalls.most_common(reasons) if v),
           "  opcodes: " + ", ".join(f"{k} {v / (elements / 32) if elements else v:.2f}"
                                     for k, v in counts.most_common(opcodes))]
  return "\n".join(lines)


def hottest(instructions, first: int, count: int) -> str:
  """The `count` instructions with the most stall samples, with their index."""
  ranked = sorted(enumerate(instructions, first), key=lambda item: -item[1].samples)[:count]
  return "\n".join(
      f"  {index:5d} {i.samples:5.0f} {i.source[:60]:60s} "
      + ", ".join(f"{k} {v:.0f}" for k, v in sorted(i.stalls.items(), key=lambda kv: -kv[1])
                  if v)
      for index, i in ranked)


def main(argv=None):
  parser = argparse.ArgumentParser(prog="python -m benchmarks.sass_regions",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", help="ncu's source page as CSV (optionally .gz)")
  parser.add_argument("--regions", nargs="*", default=[], help="NAME=FIRST:END, SASS indices")
  parser.add_argument("--elements", type=int, default=None,
                      help="output elements, for counts per 32 of them")
  parser.add_argument("--hottest", type=int, default=6)
  args = parser.parse_args(argv)
  instructions = read(args.source)
  print(summary(instructions, "all", args.elements))
  for region in args.regions:
    name, span = region.split("=")
    first, end = (int(v) for v in span.split(":"))
    print()
    print(summary(instructions[first:end], f"{name} [{first}, {end})", args.elements))
    if args.hottest:
      print(hottest(instructions[first:end], first, args.hottest))


if __name__ == "__main__":
  main()
