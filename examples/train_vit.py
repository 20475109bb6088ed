"""Train a ViT whose MLPs run our backward on scikit-learn's digits, or time a Qwen-sized block.

  python examples/train_vit.py --fast              # CPU, ~20 s: prints test_accuracy=0.97...
  python examples/train_vit.py --gpu-compare       # GPU: step time, our backward vs XLA's

Training saves the loss and accuracy curves to `--out`/loss_curve.png and exits
with status 1 if the test accuracy is below `--min-accuracy`.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import vit
from vision_mlp_bwd import backends
from vision_mlp_bwd.precision import canonicalize
from vision_mlp_bwd.problem import Problem

IMPLEMENTATIONS = {"auto": None, "triton": "triton", "xla": "xla"}


def train(args) -> int:
  cfg, steps = (vit.FAST, 600) if args.fast else (vit.FULL, 2000)
  implementation = IMPLEMENTATIONS[args.implementation]
  print(f"{jax.default_backend()}: ViT {cfg}, implementation={implementation}")
  data = vit.load_digits_data(seed=args.seed)
  model = vit.ViT(cfg, rngs=nnx.Rngs(args.seed), implementation=implementation)
  history = vit.fit(model, data, steps=args.steps or steps, seed=args.seed)
  os.makedirs(args.out, exist_ok=True)
  vit.plot_history(history, os.path.join(args.out, "loss_curve.png"))
  accuracy = history["test_accuracy"][-1]
  print(f"loss_curve={os.path.join(args.out, 'loss_curve.png')}")
  print(f"test_accuracy={accuracy:.4f}")
  return 0 if accuracy >= args.min_accuracy else 1


def gpu_compare(args) -> int:
  if jax.default_backend() != "gpu":
    print("--gpu-compare needs a GPU (jax.default_backend() is "
          f"{jax.default_backend()!r}).", file=sys.stderr)
    return 2
  steps = args.steps or 50
  print(f"{jax.devices()[0].device_kind}: one ViT block with the Qwen-VL vision MLP "
        f"(H=1280, I=3584), batch {args.batch}, training step incl. AdamW; "
        f"median of {steps} steps after {args.warmup} warm-up steps")
  print(f"{'tokens':>7} {'implementation':>22} {'median ms':>10} {'vs xla':>7}")
  for tokens in map(int, args.tokens.split(",")):
    cfg = vit.qwen_block(tokens)
    problem = Problem(args.batch * tokens, cfg.dim, cfg.mlp_dim, jnp.dtype(jnp.float32),
                      canonicalize(None))
    rows = {}
    for name in ("xla", "triton", "auto"):
      times = vit.step_times(cfg, batch=args.batch, steps=steps, warmup=args.warmup,
                             implementation=IMPLEMENTATIONS[name])
      rows[name] = float(np.median(times)) * 1e3
    for name in ("auto", "triton", "xla"):
      label = f"auto (-> {backends.choose(None, problem, 'gpu').name})" if name == "auto" else name
      print(f"{tokens:>7} {label:>22} {rows[name]:>10.3f} {rows['xla'] / rows[name]:>6.2f}x")
  return 0


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--fast", action="store_true", help="tiny model, 600 steps (CPU friendly)")
  parser.add_argument("--gpu-compare", action="store_true",
                      help="time training steps of a Qwen-sized block: ours vs XLA (GPU)")
  parser.add_argument("--steps", type=int, default=None,
                      help="training steps (default 600 fast / 2000), or timed steps (default 50)")
  parser.add_argument("--out", default="vit_out", help="directory for loss_curve.png")
  parser.add_argument("--min-accuracy", type=float, default=0.9)
  parser.add_argument("--implementation", choices=tuple(IMPLEMENTATIONS), default="auto",
                      help="backward used for training (auto: Triton on a GPU where it wins)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--tokens", default="256,1024,4096",
                      help="--gpu-compare: patches per image (squares), comma-separated")
  parser.add_argument("--batch", type=int, default=1, help="--gpu-compare: images per step")
  parser.add_argument("--warmup", type=int, default=10, help="--gpu-compare: untimed steps")
  args = parser.parse_args(argv)
  return gpu_compare(args) if args.gpu_compare else train(args)


if __name__ == "__main__":
  sys.exit(main())
