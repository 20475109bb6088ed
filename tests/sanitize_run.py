"""Runs the backward once per S for `compute-sanitizer` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python -m tests.sanitize_run 1 131 293
    compute-sanitizer --tool racecheck python -m tests.sanitize_run --implementation mosaic 7 65 333
    XLA_FLAGS=--xla_gpu_autotune_level=0 compute-sanitizer --tool memcheck \\
        python -m tests.sanitize_run --implementation mosaic --split-pre-gelu 773 1163
    compute-sanitizer --tool racecheck \\
        python -m tests.sanitize_run --implementation mosaic 1163 --runs fp32-f16

The Triton backend runs on fp32 inputs at the default precision and under
F16_F16_F32; the Mosaic backend on fp32 inputs at the default precision (TF32 on
the f16 engine) and under F16_F16_F32, and on bf16 inputs (`--runs` picks some:
`fp32-default`, `fp32-f16`, `bf16`). `--split-pre-gelu` (Mosaic) splits the fused
pre-GELU product's last wave in every table (tail_splits 8; 3 stages on 16-bit
inputs, where its partials take a buffer of their own), as the tables do only at
some S. XLA's autotuning of its dots under memcheck takes minutes at S ~ 1000:
turning it off (above) changes which cuBLAS kernels run, not our kernels.
"""

import argparse

import jax
import jax.numpy as jnp

import vision_mlp_bwd
from tests import helpers
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import check_backward_args

F16 = jax.lax.DotAlgorithmPreset.F16_F16_F32
RUNS = {"fp32-default": (jnp.float32, None), "fp32-f16": (jnp.float32, F16),
        "bf16": (jnp.bfloat16, None)}
IMPLEMENTATIONS = {"triton": ("fp32-default", "fp32-f16"),
                   "mosaic": ("fp32-default", "fp32-f16", "bf16")}

parser = argparse.ArgumentParser(prog="python -m tests.sanitize_run")
parser.add_argument("seq_lens", type=int, nargs="*", default=[1, 131, 293])
parser.add_argument("--implementation", choices=list(IMPLEMENTATIONS), default="triton")
parser.add_argument("--runs", nargs="+", choices=list(RUNS))
parser.add_argument("--split-pre-gelu", action="store_true")
args = parser.parse_args()
if args.split_pre_gelu and args.implementation != "mosaic":
  parser.error("--split-pre-gelu takes --implementation mosaic")


def split_backward(problem):
  """The Mosaic backward with every pre-GELU row's last wave split."""
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  tables = helpers.split_pre_gelu_tables(backward_sm90.TABLES)
  return jax.jit(lambda *a: backward_sm90.backward(*a, problem=problem, tables=tables))


for tokens in args.seq_lens:
  for run in args.runs or IMPLEMENTATIONS[args.implementation]:
    dtype, precision = RUNS[run]
    inputs = helpers.backward_inputs(tokens, 1280, 3584, dtype=dtype)
    if args.split_pre_gelu:
      fn = split_backward(check_backward_args(*inputs, canonicalize(precision)))
    else:
      fn = lambda *a: vision_mlp_bwd.mlp_backward(*a, precision=precision,
                                                  implementation=args.implementation)
    jax.block_until_ready(fn(*inputs))
    print(f"S={tokens} {jnp.dtype(dtype).name} {precision}: ran"
          + (" (split pre-GELU)" if args.split_pre_gelu else ""), flush=True)
