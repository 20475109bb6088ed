"""Runs the backward once per S for `compute-sanitizer` (memcheck, racecheck).

    compute-sanitizer --tool memcheck python -m tests.sanitize_run 1 131 293
    compute-sanitizer --tool racecheck python -m tests.sanitize_run --implementation mosaic 7 65 333
    XLA_FLAGS=--xla_gpu_autotune_level=0 compute-sanitizer --tool memcheck \\
        python -m tests.sanitize_run --implementation mosaic 773 1163
    compute-sanitizer --tool racecheck \\
        python -m tests.sanitize_run --implementation mosaic 1163 --runs fp32-f16

The Triton backend runs on fp32 inputs at the default precision and under
F16_F16_F32; the Mosaic backend on fp32 inputs at the default precision (TF32 on
the f16 engine), under F16_F16_F32 and HIGHEST, and on bf16 inputs. `--runs` picks some:
- `fp32-default`, `fp32-f16`, `bf16`, `fp32-highest` (bf16x3 over the inputs' pieces);
- `fp32-default-off-window`: DEFAULT's checked scales copying tiles again;
- on other tables than the GPU's (`tests.helpers`): `fp32-f16-copy-warpgroup` (the fused
  product's side copies by a ping-pong copy warpgroup; S > 3072), `fp32-default-ping-pong`
  (DEFAULT's fused product run ping-pong) and `fp32-default-ping-pong-copy-warpgroup`
  (its scaled side copies by a copy warpgroup too).

XLA's autotuning of its dots under memcheck takes minutes at S ~ 1000: turning it off
(above) changes which cuBLAS kernels run, not our kernels.
"""

import argparse
import functools

import jax
import jax.numpy as jnp

import vision_mlp_bwd
from tests import helpers

F16 = jax.lax.DotAlgorithmPreset.F16_F16_F32
RUNS = {"fp32-default": (jnp.float32, None), "fp32-f16": (jnp.float32, F16),
        "bf16": (jnp.bfloat16, None),
        # DEFAULT's checked scales copying tiles again (`helpers.off_the_speculated_scale`)
        "fp32-default-off-window": (jnp.float32, None),
        "fp32-highest": (jnp.float32, jax.lax.Precision.HIGHEST),
        "fp32-f16-copy-warpgroup": (jnp.float32, F16),
        "fp32-default-ping-pong": (jnp.float32, None),
        "fp32-default-ping-pong-copy-warpgroup": (jnp.float32, None)}
# Runs on other tables than the GPU's (`tests.helpers`), the GPU's given.
VARIANT_TABLES = {"fp32-f16-copy-warpgroup": helpers.copy_warpgroup_tables,
                  "fp32-default-ping-pong": helpers.tf32_ping_pong_tables,
                  "fp32-default-ping-pong-copy-warpgroup": functools.partial(
                      helpers.tf32_ping_pong_tables, copy_warpgroup=True)}
IMPLEMENTATIONS = {"triton": ("fp32-default", "fp32-f16"),
                   "mosaic": ("fp32-default", "fp32-f16", "bf16", "fp32-highest")}

parser = argparse.ArgumentParser(prog="python -m tests.sanitize_run")
parser.add_argument("seq_lens", type=int, nargs="*", default=[1, 131, 293])
parser.add_argument("--implementation", choices=list(IMPLEMENTATIONS), default="triton")
parser.add_argument("--runs", nargs="+", choices=list(RUNS))
args = parser.parse_args()
for tokens in args.seq_lens:
  for run in args.runs or IMPLEMENTATIONS[args.implementation]:
    dtype, precision = RUNS[run]
    inputs = helpers.backward_inputs(tokens, 1280, 3584, dtype=dtype)
    if run.endswith("off-window"):
      inputs = helpers.off_the_speculated_scale(inputs)
    if run in VARIANT_TABLES:
      from vision_mlp_bwd.backends.mosaic import backward_sm90
      tables = VARIANT_TABLES[run](tokens, backward_sm90.tables_for(jax.devices()[0].device_kind))
      fn, _ = helpers.mosaic_backward_fn(tables, inputs, precision)
      jax.block_until_ready(fn(*inputs))
    else:
      jax.block_until_ready(vision_mlp_bwd.mlp_backward(*inputs, precision=precision,
                                                        implementation=args.implementation))
    print(f"S={tokens} {jnp.dtype(dtype).name} {precision}: ran", flush=True)
