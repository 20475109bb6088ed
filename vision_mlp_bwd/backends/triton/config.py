"""Tile configurations for the Triton kernels, and the heuristics that pick them.

The backward runs one kernel, `tiled_matmul`, in three roles. Each role gets a
`TileConfig`; a `Config` holds the three. `default_config(problem)` picks them
from the shape, following the measurements in `benchmarks/NOTES.md`.
"""

from __future__ import annotations

import dataclasses

from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem

NUM_SMS_H200 = 132


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One launch of `tiled_matmul`: output tile, contraction step, split, Triton knobs."""

  block_m: int
  block_n: int
  block_k: int
  split_k: int = 1        # programs that share one output tile's contraction
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"TileConfig.{name}={value}: Triton needs a power of 2 >= 16.")
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


def _cdiv(a, b):
  return -(-a // b)


def _block_for_tokens(tokens: int) -> int:
  """Row tile over S: small S keeps tiles small so more programs run."""
  if tokens <= 32:
    return 16
  if tokens <= 128:
    return 32
  if tokens <= 512:
    return 64
  return 128


def _split_for_occupancy(programs: int, steps: int, target: int) -> int:
  """Splits the contraction until about `target` programs run, keeping >= 4 steps each."""
  split = 1
  while programs * split * 2 <= target and steps // (split * 2) >= 4:
    split *= 2
  return split


def default_config(problem: Problem, num_sms: int = NUM_SMS_H200) -> Config:
  """Heuristic tiles for `problem`; see benchmarks/NOTES.md for what they rest on."""
  s, h, i = problem.tokens, problem.hidden, problem.intermediate
  sixteen_bit = problem.mode.operand_dtype is not None or problem.dtype.itemsize == 2
  block_k = 64 if sixteen_bit else 32
  bm = _block_for_tokens(s)
  wide = 128 if s > 512 else 64
  warps = 8 if bm * wide >= 128 * 128 else 4

  pre_activation = TileConfig(bm, wide, block_k, num_warps=warps)

  input_programs = _cdiv(s, bm) * _cdiv(h, wide)
  split = _split_for_occupancy(input_programs, _cdiv(i, block_k), 2 * num_sms)
  input_grad = TileConfig(bm, wide, block_k, split_k=split, num_warps=warps)

  wb = 128 if s > 512 else 64
  weight_grads = TileConfig(wb, wb, 32, num_warps=8 if wb == 128 else 4)
  return Config(pre_activation, weight_grads, input_grad)


def interpret_config(problem: Problem) -> Config:
  """Small tiles for Pallas interpret mode on the CPU (many ragged edges, fast to run)."""
  del problem
  tile = TileConfig(16, 32, 16)
  return Config(tile, tile, TileConfig(16, 32, 16, split_k=2))


# Where the automatic choice takes the Triton kernels over XLA, per DotMode: the
# largest S at which they measured faster on the H200 (benchmarks/results/).
# Modes not listed go to XLA.
TRITON_WINS_UP_TO_TOKENS: dict[DotMode, int] = {}
