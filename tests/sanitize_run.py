"""Runs the backward once per S for `compute-sanitizer` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python -m tests.sanitize_run 1 131 293
    compute-sanitizer --tool racecheck python -m tests.sanitize_run --implementation mosaic 7 65 333

The Triton backend runs on fp32 inputs at the default precision and under
F16_F16_F32; the Mosaic backend on fp32 inputs at the default precision (TF32 on
the f16 engine) and under F16_F16_F32, and on bf16 inputs.
"""

import argparse

import jax
import jax.numpy as jnp

import vision_mlp_bwd
from tests import helpers

F16 = jax.lax.DotAlgorithmPreset.F16_F16_F32
RUNS = {"triton": ((jnp.float32, None), (jnp.float32, F16)),
        "mosaic": ((jnp.float32, None), (jnp.float32, F16), (jnp.bfloat16, None))}

parser = argparse.ArgumentParser(prog="python -m tests.sanitize_run")
parser.add_argument("seq_lens", type=int, nargs="*", default=[1, 131, 293])
parser.add_argument("--implementation", choices=list(RUNS), default="triton")
args = parser.parse_args()
for tokens in args.seq_lens:
  for dtype, precision in RUNS[args.implementation]:
    inputs = helpers.backward_inputs(tokens, 1280, 3584, dtype=dtype)
    jax.block_until_ready(vision_mlp_bwd.mlp_backward(*inputs, precision=precision,
                                                      implementation=args.implementation))
    print(f"S={tokens} {jnp.dtype(dtype).name} {precision}: ran", flush=True)
