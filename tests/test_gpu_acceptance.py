"""GPU acceptance: the SOL-ExecBench correctness rule on all 16 cases, 3 fresh rounds each.

For every implementation (each name in `backends.names()` that can run the
case, and None, the automatic choice) and every precision that claims the SOL tolerance (DEFAULT,
F16_F16_F32, HIGHEST; HIGHEST also within 1e-5 relative Frobenius error, its
contract), against the true-fp32 reference. The rule's atol and rtol are the
benchmark's definition (benchmarks/correctness.py, vendored from the contract),
not tolerances of ours; chex checks every output's shape and dtype beside it.
The elementwise bounds of tests/bounds.py are held on the GPU in test_gpu.py.
Skipped without a CUDA GPU.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import pytest

import vision_mlp_bwd
from benchmarks import cases, correctness
from tests import helpers
from vision_mlp_bwd import backends

ROUNDS = 3


def _runs(implementation, seq_len, precision):
  """Whether the backend can run this case (e.g. mosaic runs 16-bit products only)."""
  from vision_mlp_bwd.precision import canonicalize
  from vision_mlp_bwd.problem import Problem
  problem = Problem(seq_len, cases.HIDDEN, cases.INTERMEDIATE, jnp.dtype(jnp.float32),
                    canonicalize(precision))
  return backends.get(implementation).unsupported_reason(problem, "gpu") is None


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", cases.SEQ_LENS)
def test_sol_rule_on_every_case(seq_len):
  implementations = (*backends.names(), None)
  compiled = {(p, i): jax.jit(functools.partial(vision_mlp_bwd.mlp_backward,
                                                precision=cases.PRECISIONS[p], implementation=i))
              for p in cases.SOL_PRECISIONS for i in implementations
              if i is None or _runs(i, seq_len, cases.PRECISIONS[p])}
  failures = []
  for round_ in range(ROUNDS):
    inputs = cases.make_inputs(helpers.fresh_key(), seq_len)   # fresh inputs every round
    refs = correctness.reference_outputs(inputs)
    for (precision, implementation), fn in compiled.items():
      outs = jax.device_get(fn(*inputs))
      chex.assert_shape(tuple(outs), [r.shape for r in refs])
      chex.assert_type(tuple(outs), jnp.float32)
      result = correctness.gate(outs, refs, seq_len, precision)
      if not result.passed:
        failures.append(f"round {round_} {precision} {implementation}: {result.reason}")
  assert not failures, f"S={seq_len}:\n" + "\n".join(failures)
