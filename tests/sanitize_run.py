"""Runs the Triton backward once per S for `compute-sanitizer --tool memcheck`.

    compute-sanitizer --tool memcheck python -m tests.sanitize_run 1 131 293
"""

import sys

import jax

import vision_mlp_bwd
from tests import helpers

for tokens in map(int, sys.argv[1:] or ["1", "131", "293"]):
  for precision in (None, jax.lax.DotAlgorithmPreset.F16_F16_F32):
    inputs = helpers.backward_inputs(tokens, 1280, 3584)
    jax.block_until_ready(
        vision_mlp_bwd.mlp_backward(*inputs, precision=precision, implementation="triton"))
    print(f"S={tokens} {precision}: ran", flush=True)
