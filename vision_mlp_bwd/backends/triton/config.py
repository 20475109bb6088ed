"""Tile configurations for the Triton kernels, and the heuristics that pick them.

The backward runs four tiled products (`kernels.Product`) in three roles. Each
role gets a `TileConfig`; a `Config` holds the three. `default_config(problem)`
picks them per S from tables measured on the H200 (`benchmarks/NOTES.md`).
"""

from __future__ import annotations

import dataclasses

from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem

@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One tiled product: output tile, contraction step, split, Triton knobs."""

  block_m: int
  block_n: int
  block_k: int
  split_k: int = 1        # programs that share one output tile's contraction
  num_warps: int = 4
  num_stages: int = 3
  # Ragged M just past one block: where block_m < M <= block_m + tail_m, one
  # block of rows, computed as block_m rows plus a second accumulator of
  # tail_m rows that shares B's tiles, instead of a 2 * block_m tile or a
  # second block of rows that reads B again. wgmma takes 64 rows per group of
  # 4 warps; fewer run as older, smaller mma instructions.
  tail_m: int = 0

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"TileConfig.{name}={value}: Triton needs a power of 2 >= 16.")
    if self.tail_m and (self.tail_m < 16 or self.tail_m & (self.tail_m - 1)
                        or self.tail_m >= self.block_m):
      raise ValueError(f"TileConfig.tail_m={self.tail_m}: a power of 2 >= 16 below "
                       f"block_m={self.block_m}, or 0.")
    if self.split_k < 1:
      raise ValueError(f"TileConfig.split_k={self.split_k} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class Config:
  """The three launches of the Triton backward."""

  # grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output): M=S, N=I, K=H.
  pre_activation: TileConfig
  # grad_fc2_weight = grad_output.T @ gelu_output (M=H, N=I) and
  # grad_fc1_weight = grad_fc1_output.T @ hidden_state (M=I, N=H); K=S.
  weight_grads: TileConfig
  # grad_hidden_state = grad_fc1_output @ fc1_weight: M=S, N=H, K=I.
  input_grad: TileConfig
  # 16-bit modes: cast the fp32 activations (grad_output, hidden_state,
  # gelu_output) and/or the weights to the operand dtype in XLA first, so the
  # kernels multiply 16-bit tiles they need not convert.
  cast_inputs: bool = False
  cast_weights: bool = False
  # With cast_inputs: cast in Pallas jobs instead of XLA converts (a kernel
  # each): grad_output and gelu_output in one launch before the first,
  # hidden_state (needed only by the second) inside the first launch.
  # 2.6-4.5 us less at F16 S=128-256 on the H200 (benchmarks/NOTES.md, 12).
  fused_casts: bool = False
  # fp32 wgmma operands must be K-major in shared memory; an operand that is
  # not K-contiguous in HBM is then copied 4 bytes at a time. The left operand
  # can come from registers instead (`Product.lhs_in_registers`), so only the
  # right one needs K-contiguous rows. In 32-bit modes (16-bit tiles transpose
  # for free) the weight gradients' right operand (gelu_output, hidden_state)
  # is then read from a transposed copy, the left one through registers.
  k_major_weight_grads: bool = False
  # Split contractions (the input gradient's) summed by the last program of
  # each output tile, in split order, instead of in a reduction after the
  # launch (`kernels.Product.sum_splits_in_kernel`). -1.3 to -1.7 us at F16
  # S=211-256, -0.2 to -0.6 at TF32 S=128; 1-8% slower where one small
  # program sums 8 partials (benchmarks/NOTES.md, 18).
  sum_splits_in_kernel: bool = False
  # TF32 with fp32 inputs: every product runs on f16 tensor cores, its
  # operands scaled by powers of two per output row and column so that f16
  # holds their TF32 roundings (`precision.f16_scale`); three launches
  # (`_backward_on_f16` in this package). With cast_inputs, grad_output is
  # also cast by rows for the pre-activation product, which otherwise
  # converts it itself.
  tf32_on_f16: bool = False
  # 16-bit operand modes with fp32 inputs, on a Hopper GPU: launch 1 runs as
  # one Pallas Mosaic-GPU grid (`mosaic_gpu.launch_1`: its converted weight
  # tiles double-buffered, TMA-fed) instead of Triton's; the casts launch then
  # also casts hidden_state and zeroes the counters, and launch 2 sums
  # grad_output's columns (the fc2 bias gradient). Elsewhere (other GPUs,
  # interpret mode, H or I not multiples of 128, other flags:
  # `launch_1_on_mosaic`) launch 1 stays Triton's. Measured on the H200 at
  # S=211: launch 1 20.7 against 24.4 us (benchmarks/NOTES.md, 23-24).
  mosaic_launch_1: bool = False

  @property
  def launch_1_on_mosaic(self) -> bool:
    """mosaic_launch_1 where the rest allows: it replaces launch 1 of the fused casts
    (cast_inputs, fused_casts), weights as stored."""
    return (self.mosaic_launch_1 and self.cast_inputs and self.fused_casts
            and not self.cast_weights)


T = TileConfig
C = Config

# Per S bucket, from the H200 measurements of benchmarks/tune.py (H=1280,
# I=3584). Up to S=256 the rows are the winners of a coordinate search over
# whole-backward Configs at the seed's S (`tune --search-configs`,
# results/probes/tiles/search_*_h200.json): in a grouped launch the first product's warps
# and pipeline depth serve both products, so tiles tuned one launch at a time
# (results/probes/tiles/tune*_h200.*, the rows above S=256) were up to 30% off.
# benchmarks/NOTES.md tells the story. At S=129-144 the 16-bit pre-activation
# block is 128 rows plus a 16-row tail (51.5 against 52.1 us at F16 S=131,
# results/probes/tiles/tails2_h200.log). Launch 1 as one Mosaic GPU grid (`mosaic_launch_1`)
# from S=65 to 256: F16 S=128 38.3 against 43.5 us, 131 50.7 / 51.6, 211
# 52.2 / 52.8 (results/probes/mosaic/mosaic211_f16_h200.json, benchmarks/NOTES.md, 23);
# S=145-256 since its 256-row pre-activation tiles (NOTES.md, 24).
# Rows: (largest S or None, Config).
_SIXTEEN_BIT_TABLE = (
    (64, C(T(64, 32, 128), T(64, 128, 64), T(64, 128, 64, split_k=8))),
    (128, C(T(64, 32, 64, num_stages=4), T(64, 128, 32), T(128, 32, 64, split_k=4),
            cast_inputs=True, fused_casts=True, mosaic_launch_1=True)),
    (144, C(T(128, 32, 64, num_stages=4, tail_m=16), T(128, 128, 64),
            T(256, 64, 64, split_k=4, num_stages=4), cast_inputs=True,
            fused_casts=True, mosaic_launch_1=True)),                            # S=131
    (160, C(T(128, 32, 64, num_stages=4), T(128, 128, 64),
            T(256, 64, 64, split_k=4, num_stages=4), cast_inputs=True, fused_casts=True,
            mosaic_launch_1=True)),
    (224, C(T(128, 64, 64), T(128, 128, 32), T(128, 64, 64, split_k=4), cast_inputs=True,
            fused_casts=True, sum_splits_in_kernel=True, mosaic_launch_1=True)),
    (256, C(T(128, 64, 64, num_warps=8), T(128, 128, 64), T(128, 64, 64, split_k=4),
            cast_inputs=True, fused_casts=True, sum_splits_in_kernel=True, mosaic_launch_1=True)),
    (1024, C(T(128, 128, 64, num_warps=8), T(128, 64, 64), T(128, 64, 64, split_k=2),
             cast_inputs=True, cast_weights=True)),
    (None, C(T(128, 128, 64, num_warps=8), T(128, 128, 64, num_warps=8),
             T(128, 128, 64, num_warps=8), cast_inputs=True, cast_weights=True)),
)
_THIRTY_TWO_BIT_TABLE = (
    (64, C(T(32, 64, 64, num_stages=4), T(128, 64, 64), T(32, 128, 32, split_k=8))),
    (128, C(T(32, 64, 32, num_warps=2), T(64, 128, 32, num_warps=2),
            T(64, 64, 64, split_k=4, num_warps=2), sum_splits_in_kernel=True)),
    (160, C(T(32, 128, 32, num_warps=2, num_stages=4), T(128, 64, 16),
            T(32, 256, 32, split_k=8, num_warps=2))),                            # S=131
    (224, C(T(32, 128, 32, num_warps=2), T(128, 64, 32),
            T(32, 256, 32, split_k=4, num_warps=2))),                            # S=211
    (256, C(T(32, 256, 32), T(128, 64, 32), T(32, 256, 16, split_k=4, num_warps=2),
            k_major_weight_grads=True)),
    # TF32 at S=1163 took 867 us with 128x128x32 tiles against 505 us at S=997
    # with these, so they serve every larger S too.
    (None, C(T(32, 128, 32), T(128, 64, 64), T(32, 128, 32))),
)

# TF32 (DEFAULT) from S=65 to 256: every product on f16 tensor cores with
# exact power-of-two scales (`Config.tf32_on_f16`, benchmarks/NOTES.md 20),
# with the 16-bit rows' tiles, then searched for this path (`tune
# --search-configs`, NOTES.md 21): at S=131 a pre-activation tile of 128 rows
# plus a 16-row tail (one block of rows, to S=144; a 256-row tile above) and
# 64-row input-gradient tiles; at S=211 and 256 one 256-row pre-activation
# block (8 warps) and 32-deep steps (S=211: 63.2 against 67.2 us,
# results/probes/tiles/search211_tf32_h200.json).
# Measured against the fp32-operand rows above, TF32 S=128: 49.6 against
# 58.3 us; 131: 58.2 / 72.1; 211: 67.8 (the row before) / 91.8; 256: 66.0 /
# 115.8. At S=64 the fp32-operand row stays (42.8 against 43.9).
_TF32_ON_F16_TABLE = (
    (64, None),
    (128, C(T(64, 32, 64, num_stages=4), T(64, 128, 32), T(128, 32, 64, split_k=4),
            cast_inputs=True, tf32_on_f16=True)),
    (144, C(T(128, 32, 64, num_stages=4, tail_m=16), T(128, 128, 32),
            T(64, 64, 32, split_k=4, num_stages=4), cast_inputs=True, tf32_on_f16=True)),
    (160, C(T(256, 32, 64, num_stages=4), T(128, 128, 32),
            T(64, 64, 32, split_k=4, num_stages=4), cast_inputs=True, tf32_on_f16=True)),
    (224, C(T(256, 64, 64, num_warps=8, num_stages=4), T(128, 128, 32),
            T(128, 64, 32, split_k=4), cast_inputs=True, sum_splits_in_kernel=True,
            tf32_on_f16=True)),                                                  # S=211
    (256, C(T(256, 64, 64, num_warps=8), T(128, 128, 32), T(128, 64, 32, split_k=4),
            cast_inputs=True, sum_splits_in_kernel=True, tf32_on_f16=True)),
    (None, None),
)

# bf16x3 (HIGHEST) runs three bf16 products per tile: up to S=256 the
# per-launch TF32 tiles; above, it is compute-bound and 128x128 tiles halved
# its time per token (1.15 -> 0.55 us per token between S=997 and S=1163 in
# benchmarks/results/runs/2026-11-29/h200_20261129-153212.md).
_THREE_PASS_TABLE = (
    (64, C(T(32, 64, 32), T(128, 64, 64), T(32, 64, 32, split_k=8))),
    (128, C(T(32, 64, 32, num_stages=4), T(64, 64, 32, num_warps=2), T(32, 64, 32, split_k=4))),
    (256, C(T(32, 128, 32), T(128, 64, 64), T(32, 128, 32, split_k=8))),
    (None, C(T(128, 128, 32, num_warps=8), T(128, 128, 32, num_warps=8),
             T(128, 128, 32, num_warps=8))),
)


def default_config(problem: Problem) -> Config:
  """The measured Config for `problem` from the tables above."""
  if problem.mode.operand_dtype is not None or problem.dtype.itemsize == 2:
    table = _SIXTEEN_BIT_TABLE
  elif problem.mode in (DotMode.HIGHEST, DotMode.BF16X3):
    table = _THREE_PASS_TABLE
  else:
    if problem.mode == DotMode.TF32 and _row(_TF32_ON_F16_TABLE, problem.tokens) is not None:
      return _row(_TF32_ON_F16_TABLE, problem.tokens)
    table = _THIRTY_TWO_BIT_TABLE
  return _row(table, problem.tokens)


def _row(table, tokens):
  for largest, config in table:
    if largest is None or tokens <= largest:
      return config
  raise AssertionError("unreachable: the last row takes every S")


def interpret_config(problem: Problem) -> Config:
  """Small tiles for Pallas interpret mode on the CPU (many ragged edges, fast to run)."""
  del problem
  tile = TileConfig(16, 32, 16)
  return Config(tile, tile, TileConfig(16, 32, 16, split_k=2))


# Where the automatic choice takes the Triton kernels over XLA: per DotMode, the
# S ranges (inclusive; None = no upper end) around the seed cases where they
# measured at least 8% faster than XLA at the same precision in the same run.
# S <= 256: benchmarks/results/runs/2026-11-30/h200_20261130-022805.md (TF32, F16,
# HIGHEST; TF32 on f16 tensor cores from S=65; F16 launch 1 on Mosaic GPU,
# 256-row tiles above S=128) and
# benchmarks/results/runs/2026-11-29/h200_bf16_20261129-195442.md and -223832.md,
# with the earlier runs listed in benchmarks/latest.py agreeing; above:
# benchmarks/results/runs/2026-11-29/h200_20261129-154647.md.
# Ties (within the ~5% run-to-run spread) go to XLA; so do modes not listed.
TRITON_WINS: dict[DotMode, tuple[tuple[int, int | None], ...]] = {
    DotMode.TF32: ((1, 256),),                 # 1.32-1.42x at every seed S <= 256
    DotMode.F16: ((1, 256),),                  # 1.36-1.51x at every seed S <= 256
    DotMode.BF16: ((1, 256),),                 # 1.27-1.43x at every seed S <= 256
    DotMode.HIGHEST: ((1, 64), (289, None)),   # 1.07-1.08x; 1.12x at 293, 1.5-1.8x above
}


# The same for bf16 and f16 inputs (their default precision runs as BF16 / F16
# on the 16-bit values as they are; `precision.for_inputs`), from
# benchmarks/results/runs/2026-12-01/input_dtypes_h200_20261201-091806.json:
# 1.37-1.42x at S=64, 1.18-1.20x at S=128; 0.93-1.10x at S=131-256, and XLA
# (cuBLAS on 16-bit operands) 1.4-1.8x faster from S=293.
TRITON_WINS_ON_16_BIT_INPUTS: dict[DotMode, tuple[tuple[int, int | None], ...]] = {
    DotMode.F16: ((1, 128),),
    DotMode.BF16: ((1, 128),),
}


def triton_wins(problem: Problem) -> bool:
  """Whether the Triton kernels measured faster than XLA for this S, mode and input dtype."""
  table = TRITON_WINS if problem.dtype.itemsize == 4 else TRITON_WINS_ON_16_BIT_INPUTS
  return any(lo <= problem.tokens and (hi is None or problem.tokens <= hi)
             for lo, hi in table.get(problem.mode, ()))
