"""Speed-of-light floor of one backward call: max(FLOPs / peak, bytes / bandwidth).

FLOPs = 8·S·H·I (four S×H×I products, 2 FLOPs per multiply-add). Bytes = each
input the backward reads once (grad_output, hidden_state, fc1_weight,
fc2_weight, fc1_output, gelu_output; not the biases) plus each of the five
outputs written once. Peaks are H200 datasheet numbers (dense); TF32 for the
32-bit precisions, f16 for the 16-bit ones.
"""

from __future__ import annotations

import dataclasses

PEAK_TF32 = 495e12      # FLOP/s
PEAK_F16 = 989e12       # FLOP/s, also bf16
BANDWIDTH = 4.8e12      # bytes/s, HBM3e

SIXTEEN_BIT_PRECISIONS = ("f16", "bf16")


@dataclasses.dataclass(frozen=True)
class Machine:
  peak_tf32: float = PEAK_TF32
  peak_f16: float = PEAK_F16
  bandwidth: float = BANDWIDTH

  def peak(self, precision: str) -> float:
    return self.peak_f16 if precision in SIXTEEN_BIT_PRECISIONS else self.peak_tf32


def flops(seq_len: int, hidden: int, intermediate: int) -> int:
  return 8 * seq_len * hidden * intermediate


def bytes_moved(seq_len: int, hidden: int, intermediate: int, itemsize: int = 4) -> int:
  s, h, i = seq_len, hidden, intermediate
  reads = 2 * s * h + 2 * s * i + 2 * h * i          # grad_output, hidden_state, fc1/fc2 weights,
                                                     # fc1_output, gelu_output
  writes = s * h + 2 * h * i + i + h                 # grad_hidden_state, weight and bias grads
  return itemsize * (reads + writes)


def floor_us(seq_len: int, hidden: int, intermediate: int, precision: str,
             machine: Machine = Machine()) -> float:
  """Lower bound on one call's device time, in microseconds."""
  compute = flops(seq_len, hidden, intermediate) / machine.peak(precision)
  memory = bytes_moved(seq_len, hidden, intermediate) / machine.bandwidth
  return 1e6 * max(compute, memory)
