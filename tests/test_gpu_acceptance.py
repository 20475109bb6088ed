"""GPU acceptance: the SOL-ExecBench correctness rule on all 16 cases, 3 fresh rounds each.

For every implementation (each name in `backends.names()` and None, the
automatic choice) and every precision that claims the SOL tolerance (DEFAULT,
F16_F16_F32, HIGHEST; HIGHEST also within 1e-5 relative Frobenius error),
against the true-fp32 reference. Skipped without a CUDA GPU.
"""

import functools

import jax
import pytest

import vision_mlp_bwd
from benchmarks import cases, correctness
from vision_mlp_bwd import backends

ROUNDS = 3


@pytest.mark.gpu
@pytest.mark.parametrize("seq_len", cases.SEQ_LENS)
def test_sol_rule_on_every_case(seq_len):
  implementations = (*backends.names(), None)
  compiled = {(p, i): jax.jit(functools.partial(vision_mlp_bwd.mlp_backward,
                                                precision=cases.PRECISIONS[p], implementation=i))
              for p in cases.SOL_PRECISIONS for i in implementations}
  failures = []
  for round_ in range(ROUNDS):
    key = jax.random.fold_in(jax.random.key(2026), seq_len * ROUNDS + round_)
    inputs = cases.make_inputs(key, seq_len)
    refs = correctness.reference_outputs(inputs)
    for (precision, implementation), fn in compiled.items():
      result = correctness.gate(jax.device_get(fn(*inputs)), refs, seq_len, precision)
      if not result.passed:
        failures.append(f"round {round_} {precision} {implementation}: {result.reason}")
  assert not failures, f"S={seq_len}:\n" + "\n".join(failures)
