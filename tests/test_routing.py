"""The automatic choice is built from the H200 measurements committed in the repo.

For every seed case and precision measured in benchmarks/results/, wherever
`implementation=None` picks the Triton kernels they must have measured faster
than XLA at the same precision in that run; everywhere else XLA runs, which is
never slower than XLA.
"""

from __future__ import annotations

import json
import pathlib

import jax.numpy as jnp
import pytest

from benchmarks import cases
from vision_mlp_bwd.backends.triton.config import triton_wins
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import Problem

RESULTS = pathlib.Path(__file__).parent.parent / "benchmarks" / "results"
# Oldest first: a later run of the same case (after the kernels or their tiles
# changed) replaces the earlier one.
RUNS = ["h200_20261129-154647.json", "h200_bf16_20261129-154757.json",
        "h200_20261129-164332.json", "h200_bf16_20261129-164909.json",
        "h200_20261129-173705.json", "h200_bf16_20261129-173951.json",
        "h200_tf32_rounding_20261129-174805.json",
        "h200_20261129-185533.json", "h200_bf16_20261129-185704.json",
        "h200_20261129-195252.json", "h200_bf16_20261129-195442.json",
        "h200_20261129-213131.json", "h200_20261129-213848.json",
        "h200_bf16_20261129-223832.json", "h200_20261129-224039.json",
        "h200_20261129-235353.json", "h200_20261130-010521.json",
        "h200_20261130-021150.json", "h200_20261130-022805.json"]


def measured_pairs():
  """(precision, S, triton µs, xla µs) for every case both timed, newest run first."""
  pairs = {}
  for run in RUNS:
    results = json.loads((RESULTS / run).read_text())["results"]
    times = {(r["precision"], r["seq_len"], r["implementation"]): r.get("median_us")
             for r in results if (r["hidden"], r["intermediate"]) == (1280, 3584)}
    for (precision, seq_len, implementation), us in times.items():
      xla = times.get((precision, seq_len, "xla"))
      if implementation == "triton" and us and xla:
        pairs[precision, seq_len] = (precision, seq_len, us, xla)
  return list(pairs.values())


PAIRS = measured_pairs()


def test_every_seed_case_was_measured():
  measured = {(p, s) for p, s, _, _ in PAIRS}
  for precision in ("default", "f16", "highest"):
    assert {(precision, s) for s in cases.SEQ_LENS} <= measured


@pytest.mark.parametrize("precision,seq_len,triton_us,xla_us", PAIRS,
                         ids=[f"{p}-{s}" for p, s, _, _ in PAIRS])
def test_triton_chosen_only_where_it_measured_faster(precision, seq_len, triton_us, xla_us):
  mode = canonicalize(cases.PRECISIONS[precision])
  problem = Problem(seq_len, 1280, 3584, jnp.dtype(jnp.float32), mode)
  if triton_wins(problem):
    assert triton_us < xla_us, f"routed to Triton at {triton_us:.1f} us vs XLA {xla_us:.1f} us"
