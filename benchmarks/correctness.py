"""The SOL-ExecBench correctness rule, and the true-fp32 reference it compares against.

Per output tensor: no NaN/Inf; not all-zero when the reference is not; an
element passes when |out - ref| <= atol + 1e-5·|ref|; at least 99% of elements
must pass. HIGHEST additionally needs a relative Frobenius error <= 1e-5.
`atol` is the contract's per-case value, interpolated linearly in S between
cases (clamped outside them).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
from jax import lax

from benchmarks.cases import CASES
from vision_mlp_bwd import reference
from vision_mlp_bwd.problem import GRADIENTS

RTOL = 1e-5
MIN_PASS_FRACTION = 0.99
HIGHEST_MAX_REL_FROBENIUS = 1e-5
OUTPUT_NAMES = GRADIENTS


@dataclasses.dataclass(frozen=True)
class OutputCheck:
  name: str
  passed: bool
  pass_fraction: float     # elements within atol + rtol·|ref|
  max_abs_error: float
  rel_frobenius: float     # ||out - ref||_F / ||ref||_F
  reason: str = ""         # why it failed; empty when it passed


@dataclasses.dataclass(frozen=True)
class GateResult:
  checks: tuple[OutputCheck, ...]

  @property
  def passed(self) -> bool:
    return all(c.passed for c in self.checks)

  @property
  def min_pass_fraction(self) -> float:
    return min(c.pass_fraction for c in self.checks)

  @property
  def max_rel_frobenius(self) -> float:
    return max(c.rel_frobenius for c in self.checks)

  @property
  def reason(self) -> str:
    return "; ".join(f"{c.name}: {c.reason}" for c in self.checks if not c.passed)


def atol_for(seq_len: int) -> float:
  """The contract's atol at `seq_len`: exact on its cases, linear in between."""
  seq_lens, atols = zip(*CASES)
  return float(np.interp(seq_len, seq_lens, atols))


def check_output(name: str, out, ref, atol: float,
                 max_rel_frobenius: float | None = None) -> OutputCheck:
  """Applies the rule to one output tensor (compared in float64 on the host)."""
  out = np.asarray(out, np.float64)
  ref = np.asarray(ref, np.float64)
  if out.shape != ref.shape:
    return OutputCheck(name, False, 0.0, np.inf, np.inf, f"shape {out.shape} != {ref.shape}")
  if not np.isfinite(out).all():
    return OutputCheck(name, False, 0.0, np.inf, np.inf, "NaN or Inf")
  error = np.abs(out - ref)
  pass_fraction = float(np.mean(error <= atol + RTOL * np.abs(ref)))
  ref_norm = float(np.linalg.norm(ref))
  rel_fro = float(np.linalg.norm(error) / ref_norm) if ref_norm else float(np.linalg.norm(error))
  max_err = float(error.max(initial=0.0))
  if not out.any() and ref.any():
    reason = "all zero"
  elif pass_fraction < MIN_PASS_FRACTION:
    reason = f"{100 * (1 - pass_fraction):.2f}% of elements beyond atol={atol:g} + {RTOL:g}|ref|"
  elif max_rel_frobenius is not None and rel_fro > max_rel_frobenius:
    reason = f"relative Frobenius error {rel_fro:.2e} > {max_rel_frobenius:g}"
  else:
    reason = ""
  return OutputCheck(name, not reason, pass_fraction, max_err, rel_fro, reason)


def check_outputs(outs, refs, atol: float, max_rel_frobenius: float | None = None) -> GateResult:
  """Applies the rule to the five outputs of `mlp_backward`."""
  return GateResult(tuple(check_output(name, o, r, atol, max_rel_frobenius)
                          for name, o, r in zip(OUTPUT_NAMES, outs, refs, strict=True)))


def gate(outs, refs, seq_len: int, precision: str) -> GateResult:
  """The rule as it applies to `precision` (HIGHEST adds the Frobenius bound)."""
  bound = HIGHEST_MAX_REL_FROBENIUS if precision == "highest" else None
  return check_outputs(outs, refs, atol_for(seq_len), bound)


@functools.cache
def _fp32_reference():
  # F32_F32_F32 is XLA's Precision.HIGHEST: true fp32 products, no TF32 (on the CPU too).
  return jax.jit(functools.partial(reference.mlp_backward,
                                   precision=lax.DotAlgorithmPreset.F32_F32_F32))


def reference_outputs(inputs) -> tuple[np.ndarray, ...]:
  """The five gradients in true fp32 (XLA, no TF32), on the host."""
  return tuple(np.asarray(x) for x in jax.device_get(_fp32_reference()(*inputs)))
