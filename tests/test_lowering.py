"""The full-size kernels lower to Triton for CUDA without a GPU.

`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))` runs the whole
Pallas-to-Triton lowering on the CPU, so unsupported primitives, block shapes
that are not powers of 2 and rank or dtype mismatches fail here, in CI.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from benchmarks.cases import SEQ_LENS
from vision_mlp_bwd.backends import triton as triton_backend
from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem

from tests import helpers

TRITON_CALL = "__gpu$xla.gpu.triton"
pytestmark = pytest.mark.skipif(not helpers.cuda_lowering_without_gpu(),
                                reason="this JAX cannot lower for CUDA without a GPU")
MODES = [DotMode.TF32, DotMode.HIGHEST, DotMode.F16, DotMode.BF16]


def lower_for_cuda(problem: Problem, dtype=jnp.float32, config=None):
  s, h, i = problem.tokens, problem.hidden, problem.intermediate
  shapes = [(s, h), (s, h), (i, h), (i,), (h, i), (h,), (s, i), (s, i)]
  specs = [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]

  def backward(*args):
    return triton_backend.backward(*args, problem=problem, config=config)
  return jax.jit(backward).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()


def casts_launches(config, mode):
  """1 where the Config casts the activations in a launch of their own before launch 1."""
  return int((mode.operand_dtype is not None and config.cast_inputs and config.fused_casts)
             or (config.tf32_on_f16 and mode == DotMode.TF32))


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("tokens", SEQ_LENS)
def test_seed_cases_lower_to_two_triton_launches(tokens, mode):
  problem = Problem(tokens, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = triton_backend.default_config(problem)
  assert lower_for_cuda(problem).count(TRITON_CALL) == 2 + casts_launches(config, mode)


@pytest.mark.parametrize("hidden,intermediate", [(768, 3072), (1024, 4096), (1152, 4304),
                                                 (1280, 5120)])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_other_model_sizes_lower(hidden, intermediate, dtype):
  problem = Problem(197, hidden, intermediate, jnp.dtype(dtype), DotMode.TF32)
  config = triton_backend.default_config(problem)
  launches = 2 + casts_launches(config, DotMode.TF32) * (dtype == jnp.float32)
  assert lower_for_cuda(problem, dtype, config).count(TRITON_CALL) == launches  # every kernel


@pytest.mark.parametrize("variant", [dict(k_major_weight_grads=True),
                                     dict(cast_inputs=True, cast_weights=True)], ids=str)
@pytest.mark.parametrize("mode", [DotMode.TF32, DotMode.F16], ids=lambda m: m.value)
def test_config_variants_lower(variant, mode):
  problem = Problem(211, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = dataclasses.replace(triton_backend.default_config(problem), fused_casts=False,
                               tf32_on_f16=False,  # layouts of fp32
                               **variant)
  assert lower_for_cuda(problem, config=config).count(TRITON_CALL) == 2


@pytest.mark.parametrize("mode", [DotMode.F16, DotMode.BF16], ids=lambda m: m.value)
def test_fused_casts_lower_as_one_launch_instead_of_three_converts(mode):
  problem = Problem(211, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = dataclasses.replace(triton_backend.default_config(problem), cast_inputs=True,
                               fused_casts=True)
  fused = lower_for_cuda(problem, config=config)
  in_xla = lower_for_cuda(problem, config=dataclasses.replace(config, fused_casts=False))
  assert (fused.count(TRITON_CALL), in_xla.count(TRITON_CALL)) == (3, 2)
  # the three activation casts leave XLA (where each is a kernel of its own)
  assert (fused.count("stablehlo.convert"), in_xla.count("stablehlo.convert")) == (0, 3)


@pytest.mark.parametrize("mode", [DotMode.TF32, DotMode.F16], ids=lambda m: m.value)
@pytest.mark.parametrize("tokens", [64, 131, 256])
def test_splits_summed_in_kernel_lower_without_the_reduction(tokens, mode):
  problem = Problem(tokens, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = triton_backend.default_config(problem)
  after = lower_for_cuda(problem, config=dataclasses.replace(config, sum_splits_in_kernel=False))
  within = lower_for_cuda(problem, config=dataclasses.replace(config, sum_splits_in_kernel=True))
  launches = 2 + casts_launches(config, mode)
  assert (after.count(TRITON_CALL), within.count(TRITON_CALL)) == (launches, launches)
  # the split partials' reduction leaves XLA; the bias sums stay
  assert within.count("stablehlo.reduce") == after.count("stablehlo.reduce") - 1


@pytest.mark.parametrize("tokens", [t for t in SEQ_LENS if t <= 256])
def test_tf32_on_f16_lowers_to_three_triton_launches(tokens):
  problem = Problem(tokens, 1280, 3584, jnp.dtype(jnp.float32), DotMode.TF32)
  # The table's TF32-on-f16 row; at S=64, where the table keeps the fp32 operands, S=65's.
  config = triton_backend.default_config(dataclasses.replace(problem, tokens=max(tokens, 65)))
  assert config.tf32_on_f16
  assert lower_for_cuda(problem, config=config).count(TRITON_CALL) == 3


@pytest.mark.parametrize("mode", [DotMode.TF32, DotMode.F16], ids=lambda m: m.value)
def test_tail_tiles_lower(mode):
  # S = 131: 128 + 3 rows; the tables' rows with a 16-row tail.
  problem = Problem(131, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = triton_backend.default_config(problem)
  assert config.pre_activation.tail_m == 16
  assert lower_for_cuda(problem, config=config).count(TRITON_CALL) == 3


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
@pytest.mark.parametrize("tokens", [144, 145, 160])
def test_rows_between_seed_cases_lower(tokens, mode):
  # Where the 16-row tail stops covering S (144) and the next row takes over.
  problem = Problem(tokens, 1280, 3584, jnp.dtype(jnp.float32), mode)
  config = triton_backend.default_config(problem)
  assert lower_for_cuda(problem).count(TRITON_CALL) == 2 + casts_launches(config, mode)


@pytest.mark.parametrize("tokens", [1, 131, 211, 256, 4096])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_mosaic_launch_1_lowers(tokens, dtype):
  """`launch_1_sm90.launch_1` (Config.mosaic_launch_1) lowers to one Mosaic GPU kernel at ragged S."""
  from vision_mlp_bwd.backends.mosaic import launch_1_sm90
  h, i, rows = 1280, 3584, launch_1_sm90.padded_rows(tokens)
  specs = [jax.ShapeDtypeStruct((rows, h), dtype), jax.ShapeDtypeStruct((h, i), jnp.float32),
           jax.ShapeDtypeStruct((tokens, i), jnp.float32), jax.ShapeDtypeStruct((rows, i), dtype)]
  text = jax.jit(launch_1_sm90.launch_1).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("mosaic_gpu") >= 1 and TRITON_CALL not in text
  mlir_dtype = {"float16": "f16", "bfloat16": "bf16"}[jnp.dtype(dtype).name]
  assert f"tensor<{tokens}x{i}x{mlir_dtype}>" in text and f"tensor<{h}x{i}xf32>" in text
