"""SOL-ExecBench problem 022 as data: its 16 cases, the sizes we sweep, how inputs are drawn.

The cases, sizes and tolerances are read from the public contract, vendored
as `benchmarks/contract/sol_execbench_022.json`; the benchmark and the tests
take them from here.
"""

from __future__ import annotations

import json
import math
import pathlib

import jax
import jax.numpy as jnp
from jax import lax

from vision_mlp_bwd.problem import BACKWARD_ARGS

CONTRACT_PATH = pathlib.Path(__file__).parent / "contract" / "sol_execbench_022.json"
CONTRACT = json.loads(CONTRACT_PATH.read_text())

HIDDEN = CONTRACT["semantics"]["hidden_size"]
INTERMEDIATE = CONTRACT["semantics"]["intermediate_size"]

# (seq_len, atol) of the 16 benchmark cases.
CASES = tuple((c["seq_len"], c["atol"]) for c in CONTRACT["cases"])
SEQ_LENS = tuple(s for s, _ in CASES)

# (H, I) pairs of vision towers the sweep may cover; the first is the contract's.
SIZES = ((1280, 3584), (768, 3072), (1024, 4096), (1152, 4304), (1280, 5120))

# Without a GPU: tiny shapes, so Pallas interpret mode finishes in seconds.
CPU_DEMO_SIZE = (64, 160)
CPU_DEMO_SEQ_LENS = (7, 64)

# Benchmark precision names -> what users pass as `precision=`.
PRECISIONS = {
    "default": None,                                   # TF32 on the GPU
    "f16": lax.DotAlgorithmPreset.F16_F16_F32,
    "highest": lax.Precision.HIGHEST,                  # fp32-class (bf16x3)
    "bf16": lax.DotAlgorithmPreset.BF16_BF16_F32,
}
# Precisions that claim the SOL-ExecBench tolerance (bf16 does not).
SOL_PRECISIONS = ("default", "f16", "highest")

INPUT_NAMES = BACKWARD_ARGS


def make_inputs(key, seq_len: int, hidden: int = HIDDEN, intermediate: int = INTERMEDIATE):
  """The eight float32 inputs of `mlp_backward`, drawn as the contract says.

  Everything is N(0, 1) except the weights, scaled by 1/sqrt(fan_in)
  (fc1: H, fc2: I). `gelu_output` is independent of `fc1_output`, as in the benchmark.
  """
  shapes = {"grad_output": (seq_len, hidden), "hidden_state": (seq_len, hidden),
            "fc1_weight": (intermediate, hidden), "fc1_bias": (intermediate,),
            "fc2_weight": (hidden, intermediate), "fc2_bias": (hidden,),
            "fc1_output": (seq_len, intermediate), "gelu_output": (seq_len, intermediate)}
  scale = {"fc1_weight": 1 / math.sqrt(hidden), "fc2_weight": 1 / math.sqrt(intermediate)}
  keys = jax.random.split(key, len(INPUT_NAMES))
  return tuple(jax.random.normal(k, shapes[name], jnp.float32) * scale.get(name, 1.0)
               for k, name in zip(keys, INPUT_NAMES))
