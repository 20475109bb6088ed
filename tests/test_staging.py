"""The staging jobs (backends/staging.py), run in Pallas interpret mode on the CPU.

Interpret mode fills every output with NaN before the kernel runs and reads NaN
out of bounds, so a missing store or mask shows as a non-finite value; the
first job's copy also goes into a NaN-filled buffer of the test's own.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.precision import DotMode
from tests import bounds, helpers


def _assert_column_sums(sums, x):
  """fp32 sums of R terms in any order, against float64: within gamma_R sum |x| (Higham,
  eq. 4.4), and NaN or Inf exactly where the float64 sum has them."""
  v = np.asarray(x, np.float64)
  chex.assert_shape(sums, (x.shape[1],))
  assert sums.dtype == jnp.float32
  ours, ref = np.asarray(sums, np.float64), v.sum(axis=0)
  ok = np.isfinite(ref)
  bound = bounds.gamma(x.shape[0]) * np.abs(v).sum(axis=0)
  assert np.all(np.abs(ours[ok] - ref[ok]) <= bound[ok])
  np.testing.assert_array_equal(ours[~ok], ref[~ok])


@pytest.mark.parametrize("dtype, out_dtype", [(jnp.float32, jnp.float16),
                                              (jnp.float32, jnp.bfloat16),
                                              (jnp.bfloat16, jnp.bfloat16)])
def test_cast_pads_rows_with_zeros_and_sums_the_columns(dtype, out_dtype):
  key = helpers.fresh_key()
  x = (jax.random.normal(key, (45, 70)) * 100).astype(dtype)   # ragged tiles both ways
  x = x.at[3, 5].set(jnp.inf).at[40, 9].set(jnp.nan)
  job = staging.Cast(x.shape, jnp.dtype(out_dtype), rows=48, sums=True, block=(8, 32))
  poisoned = jnp.full((48, 70), jnp.nan, out_dtype)
  [(copy, sums)] = staging.grouped_launch([job], [(x,)], mode=DotMode.F16, out=poisoned,
                                          interpret=True)
  chex.assert_shape(copy, (48, 70))
  chex.assert_type(copy, out_dtype)
  chex.assert_trees_all_equal(copy[:45], x.astype(out_dtype))
  chex.assert_trees_all_equal(copy[45:], jnp.zeros((3, 70), out_dtype))
  _assert_column_sums(sums, x)


def test_cast_without_a_copy_returns_the_column_sums_alone():
  x = jax.random.normal(helpers.fresh_key(), (300, 40)).astype(jnp.bfloat16)
  zeros = staging.Zeros(5, block=4)
  sums, counters = staging.grouped_launch(
      [staging.Cast(x.shape, None, sums=True, block=(16, 32)), zeros], [(x,), ()],
      mode=DotMode.BF16, interpret=True)
  _assert_column_sums(sums, x)
  assert counters.shape == (5,) and not counters.any()


def test_cast_refuses_a_job_with_nothing_to_do():
  x = jnp.ones((4, 4))
  with pytest.raises(AssertionError):
    staging.grouped_launch([staging.Cast(x.shape, None)], [(x,)], mode=DotMode.F16,
                           interpret=True)
