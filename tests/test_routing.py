"""The automatic choice is built from the H200 measurements committed in the repo.

The record is `benchmarks/results/latest/h200.json`: for every (precision, S)
measured, the newest run that measured it (`benchmarks/latest.py` lists the
runs). Wherever `implementation=None` picks the Triton kernels they must have
measured faster than XLA at the same precision in that run; everywhere else
XLA runs, which is never slower than XLA.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest

from benchmarks import cases, latest
from vision_mlp_bwd.backends.triton.config import triton_wins
from vision_mlp_bwd.precision import DotMode, canonicalize, for_inputs
from vision_mlp_bwd.problem import Problem

RECORD = json.loads((latest.LATEST / "h200.json").read_text())


def measured_pairs():
  """(precision, S, triton µs, xla µs) for every case of the record both timed."""
  assert (RECORD["hidden"], RECORD["intermediate"]) == (1280, 3584)
  times = {(e["precision"], e["seq_len"], e["implementation"]): e.get("median_us")
           for e in RECORD["results"]}
  return [(precision, seq_len, us, times.get((precision, seq_len, "xla")))
          for (precision, seq_len, implementation), us in times.items()
          if implementation == "triton" and us and times.get((precision, seq_len, "xla"))]


PAIRS = measured_pairs()


def test_the_record_is_up_to_date_with_its_runs():
  """latest/ is what `python -m benchmarks.latest` makes of the runs it lists."""
  for name, content in latest.expected_files().items():
    path = latest.LATEST / name
    assert path.exists() and path.read_bytes() == content, (
        f"{path} is stale: run python -m benchmarks.latest")


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


INPUT_DTYPES_RUN = (latest.REPO_ROOT
                    / "benchmarks/results/runs/2026-12-01/input_dtypes_h200_20261201-091806.json")
SIXTEEN_BIT = {"bf16": (jnp.bfloat16, DotMode.BF16), "f16": (jnp.float16, DotMode.F16)}


def sixteen_bit_pairs():
  """(input dtype, S, triton µs, xla µs) of mlp_backward on 16-bit inputs, default precision."""
  rows = json.loads(INPUT_DTYPES_RUN.read_text())["rows"]
  return [(name, r["seq_len"], r[f"{name} in, triton"], r[f"{name} in, xla"])
          for r in rows for name in SIXTEEN_BIT]


@pytest.mark.parametrize("dtype_name,seq_len,triton_us,xla_us", sixteen_bit_pairs(),
                         ids=[f"{d}-{s}" for d, s, _, _ in sixteen_bit_pairs()])
def test_16_bit_inputs_take_triton_only_where_it_measured_faster(dtype_name, seq_len, triton_us,
                                                                 xla_us):
  dtype, mode = SIXTEEN_BIT[dtype_name]
  assert for_inputs(canonicalize(None), dtype) is mode
  problem = Problem(seq_len, 1280, 3584, jnp.dtype(dtype), mode)
  if triton_wins(problem):
    assert triton_us < xla_us, f"routed to Triton at {triton_us:.1f} us vs XLA {xla_us:.1f} us"


def test_16_bit_inputs_were_measured_at_every_seed_case():
  assert {s for _, s, _, _ in sixteen_bit_pairs()} == set(cases.SEQ_LENS)
