"""What the compiler made of the Triton backward: the instructions in each kernel's PTX.

    python -m benchmarks.inspect_kernels --seq-lens 64 256 --modes f16 tf32 --out DIR

Compiles the Triton backward for each S and mode with XLA's dump switched on,
and prints, per kernel, the counts that answer the first questions about a kernel:
which tensor-core instruction the products use (`wgmma` is Hopper's, `mma.sync`
the older path), whether loads are asynchronous copies into shared memory
(`cp.async`, the pipelined path) or plain `ld.global`, and their widths. The
PTX files land in DIR. `--calls N` then runs each backward N times, for
`ncu` to profile (`ncu --clock-control none -k regex:mlp_backward ...`; the
SASS: `ncu --page source --print-source sass --section SourceCounters ...`).
Needs a CUDA GPU. Its first run (JAX 0.11.2, H200) found no kernel PTX among
XLA's `*.ptx` dumps; it now searches every dumped file and says plainly when
none holds the kernels (benchmarks/NOTES.md, section 9).
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import tempfile

PATTERNS = {
    "wgmma": r"\bwgmma\.mma_async",
    "mma.sync": r"\bmma\.sync",
    "cp.async": r"\bcp\.async\.c[ag]",
    "cp.async.bulk": r"\bcp\.async\.bulk",
    "ld.global.v4": r"\bld\.global(\.\w+)*\.v4",
    "ld.global": r"\bld\.global",
    "st.global.v4": r"\bst\.global(\.\w+)*\.v4",
    "st.global": r"\bst\.global",
    "ld.shared": r"\bld\.shared",
    "st.shared": r"\bst\.shared",
    "cvt.f16": r"\bcvt\.rn\.f16",
    "cvt.tf32": r"\bcvt\.rna\.tf32",
}


def kernels_in_ptx(text: str) -> dict[str, str]:
  """{entry name: body} of every `.entry` in a PTX file."""
  starts = [(m.start(), m.group(1)) for m in re.finditer(r"\.entry\s+(\w+)", text)]
  return {name: text[begin:(starts[j + 1][0] if j + 1 < len(starts) else len(text))]
          for j, (begin, name) in enumerate(starts)}


def count_instructions(body: str) -> dict[str, int]:
  """How often each pattern of PATTERNS occurs in one kernel's PTX."""
  return {name: len(re.findall(pattern, body)) for name, pattern in PATTERNS.items()}


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--seq-lens", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--modes", nargs="+", default=["f16", "tf32"])
  parser.add_argument("--calls", type=int, default=0, help="then run each backward N times")
  parser.add_argument("--out", default=os.environ.get("RESULTS_DIR", "."))
  args = parser.parse_args()

  # Under ncu's kernel replay the device memory is backed up before each pass:
  # JAX's default preallocation (75% of the GPU) made that take minutes on
  # the H200, and a run cut off by `timeout` left the GPU held.
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  dump = tempfile.mkdtemp(prefix="xla_dump_")
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}"
  import jax
  import jax.numpy as jnp

  from benchmarks.cases import HIDDEN, INTERMEDIATE, make_inputs
  from vision_mlp_bwd.backends import triton as triton_backend
  from vision_mlp_bwd.precision import DotMode
  from vision_mlp_bwd.problem import Problem

  os.makedirs(args.out, exist_ok=True)
  rows, moved = [], set()   # every dumped file is searched: PTX, LLVM IR, whatever holds them
  for s in args.seq_lens:
    for mode_name in args.modes:
      problem = Problem(s, HIDDEN, INTERMEDIATE, jnp.dtype(jnp.float32), DotMode(mode_name))
      fn = jax.jit(lambda *x, p=problem: triton_backend.backward(*x, problem=p))
      inputs = make_inputs(jax.random.key(s), s)
      compiled = fn.lower(*inputs).compile()
      for _ in range(args.calls):
        jax.block_until_ready(compiled(*inputs))
      for path in sorted(set(glob.glob(os.path.join(dump, "**", "*"), recursive=True)) - moved):
        moved.add(path)
        if os.path.isdir(path):
          continue
        with open(path, errors="replace") as f:
          text = f.read()
        kernels = {n: b for n, b in kernels_in_ptx(text).items() if "mlp_backward" in n}
        if kernels:
          with open(os.path.join(args.out, f"S{s}_{mode_name}.ptx"), "w") as f:
            f.write(text)
        rows += [(f"S={s} {mode_name} {name}", count_instructions(body))
                 for name, body in kernels.items()]
  if not rows:
    suffixes = sorted({os.path.splitext(p)[1] for p in moved})
    raise SystemExit(f"No `.entry mlp_backward*` in XLA's dump ({len(moved)} files, suffixes "
                     f"{suffixes}): this JAX does not dump the Triton kernels' PTX there.")
  print(f"{'kernel':36s} " + " ".join(f"{k:>13s}" for k in PATTERNS))
  for label, counts in rows:
    print(f"{label[:36]:36s} " + " ".join(f"{counts[k]:13d}" for k in PATTERNS))


if __name__ == "__main__":
  main()
