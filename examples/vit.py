"""A small vision transformer whose MLPs are `vision_mlp_bwd.flax.VisionMLP`, trained with optax.

Shared by `train_vit.py` and `training.ipynb`: the data (`load_digits_data`),
the model (`ViT`), training (`fit`), evaluation (`accuracy`), plots
(`plot_history`) and step timing (`step_times`). Blocks are named like Qwen's
vision blocks, so `state_dict(model)` has entries such as `blocks.0.mlp.fc1.weight`.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm import tqdm

from vision_mlp_bwd.flax import VisionMLP


@dataclasses.dataclass(frozen=True)
class Config:
  image_size: int = 8
  patch_size: int = 4
  channels: int = 1
  dim: int = 32
  depth: int = 2
  heads: int = 4
  mlp_dim: int = 64
  classes: int = 10

  @property
  def patches(self) -> int:
    return (self.image_size // self.patch_size) ** 2


FAST = Config()                                                 # digits, seconds on a CPU
FULL = Config(dim=64, depth=4, mlp_dim=128)                     # digits, a bit larger


def qwen_block(tokens: int) -> Config:
  """One block with Qwen-VL's vision MLP (hidden 1280, intermediate 3584) on `tokens` patches."""
  side = int(round(tokens ** 0.5))
  assert side * side == tokens, f"tokens={tokens} must be a square"
  return Config(image_size=2 * side, patch_size=2, channels=3, dim=1280, depth=1, heads=16,
                mlp_dim=3584, classes=10)


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm1(x)), then x + mlp(norm2(x))."""

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, **mlp_options):
    self.norm1 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(cfg.heads, cfg.dim, decode=False, keep_rngs=False,
                                       rngs=rngs)
    self.norm2 = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.mlp = VisionMLP(cfg.dim, cfg.mlp_dim, rngs=rngs, **mlp_options)

  def __call__(self, x):
    x = x + self.attn(self.norm1(x))
    return x + self.mlp(self.norm2(x))


class ViT(nnx.Module):
  """Patch embedding + learned positions, `depth` blocks, mean pooling, linear classifier.

  `mlp_options` (`precision`, `implementation`, `dtype`) go to every `VisionMLP`.
  """

  def __init__(self, cfg: Config, *, rngs: nnx.Rngs, **mlp_options):
    self.cfg = cfg
    self.patch_embed = nnx.Linear(cfg.patch_size ** 2 * cfg.channels, cfg.dim, rngs=rngs)
    self.pos_embed = nnx.Param(0.02 * jax.random.normal(rngs.params(), (cfg.patches, cfg.dim)))
    self.blocks = nnx.List([Block(cfg, rngs=rngs, **mlp_options) for _ in range(cfg.depth)])
    self.norm = nnx.LayerNorm(cfg.dim, rngs=rngs)
    self.head = nnx.Linear(cfg.dim, cfg.classes, rngs=rngs)

  def __call__(self, images):  # [B, image_size, image_size, channels] -> logits [B, classes]
    b, p, c = images.shape[0], self.cfg.patch_size, self.cfg.channels
    n = self.cfg.image_size // p
    patches = images.reshape(b, n, p, n, p, c).transpose(0, 1, 3, 2, 4, 5).reshape(b, n * n, -1)
    x = self.patch_embed(patches) + self.pos_embed[...]
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x).mean(axis=1))


def load_digits_data(seed: int = 0, test_size: float = 0.25):
  """scikit-learn's 8x8 digits (shipped with it): `(x_train, x_test, y_train, y_test)`.

  Images are NHWC float32 in [0, 1]; the split is stratified.
  """
  from sklearn.datasets import load_digits
  from sklearn.model_selection import train_test_split

  images, labels = load_digits(return_X_y=True)
  images = (images / 16.0).astype(np.float32).reshape(-1, 8, 8, 1)
  return train_test_split(images, labels.astype(np.int32), test_size=test_size,
                          random_state=seed, stratify=labels)


def make_train_step(model: ViT, tx: optax.GradientTransformation):
  """A jitted optax step on the model's parameters: `step(params, opt_state, x, y)`.

  Returns `(step, params, opt_state, put_back)`; `put_back(params)` writes
  trained parameters into `model`.
  """
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def loss_fn(params, images, labels):
    logits = nnx.merge(graphdef, params, rest)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  @jax.jit
  def step(params, opt_state, images, labels):
    loss, grads = jax.value_and_grad(loss_fn)(params, images, labels)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return step, params, tx.init(params), lambda trained: nnx.update(model, trained)


@nnx.jit
def _predict(model, images):
  return jnp.argmax(model(images), axis=-1)


def accuracy(model: ViT, images, labels) -> float:
  return float(np.mean(np.asarray(_predict(model, images)) == labels))


def fit(model: ViT, data, *, steps: int, batch_size: int = 64, learning_rate: float = 3e-3,
        evals: int = 10, seed: int = 0, progress: bool = True) -> dict:
  """Trains `model` in place on `data` (from `load_digits_data`) with AdamW and a cosine schedule.

  Returns the history: `loss` per step, `test_accuracy` at `eval_step` (`evals` times).
  """
  x_train, x_test, y_train, y_test = data
  schedule = optax.warmup_cosine_decay_schedule(0.0, learning_rate, steps // 10, steps)
  step, params, opt_state, put_back = make_train_step(model, optax.adamw(schedule, 1e-4))
  rng = np.random.default_rng(seed)
  history = {"loss": [], "eval_step": [], "test_accuracy": []}
  bar = tqdm(range(1, steps + 1), desc="train", disable=not progress, mininterval=1.0)
  for i in bar:
    batch = rng.choice(len(x_train), batch_size, replace=False)
    params, opt_state, loss = step(params, opt_state, x_train[batch], y_train[batch])
    history["loss"].append(float(loss))
    if i % max(1, steps // evals) == 0 or i == steps:
      put_back(params)
      history["eval_step"].append(i)
      history["test_accuracy"].append(accuracy(model, x_test, y_test))
      bar.set_postfix(loss=f"{np.mean(history['loss'][-20:]):.3f}",
                      test_acc=f"{history['test_accuracy'][-1]:.3f}")
  put_back(params)
  return history


def plot_history(history: dict, path=None):
  """Loss per step (and its running mean) beside test accuracy; saved to `path` if given."""
  import matplotlib
  if path is not None:
    matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
  loss = np.asarray(history["loss"])
  window = max(1, len(loss) // 25)
  ax_loss.plot(np.arange(1, len(loss) + 1), loss, alpha=0.3, label="step")
  running = np.convolve(loss, np.ones(window) / window, "valid")
  ax_loss.plot(np.arange(window, len(loss) + 1), running, label=f"mean of {window}")
  ax_loss.set(xlabel="step", ylabel="cross-entropy", yscale="log", title="training loss")
  ax_loss.legend()
  ax_acc.plot(history["eval_step"], history["test_accuracy"], marker="o")
  ax_acc.set(xlabel="step", ylabel="accuracy", ylim=(0, 1), title="test accuracy")
  fig.tight_layout()
  if path is not None:
    fig.savefig(path, dpi=120)
    plt.close(fig)
  return fig


def step_times(cfg: Config, *, batch: int = 1, steps: int = 50, warmup: int = 10, seed: int = 0,
               **mlp_options) -> np.ndarray:
  """Seconds per training step (forward, backward, AdamW) of `ViT(cfg)` on random data."""
  model = ViT(cfg, rngs=nnx.Rngs(seed), **mlp_options)
  step, params, opt_state, _ = make_train_step(model, optax.adamw(1e-4))
  keys = jax.random.split(jax.random.key(seed))
  images = jax.random.normal(keys[0], (batch, cfg.image_size, cfg.image_size, cfg.channels))
  labels = jax.random.randint(keys[1], (batch,), 0, cfg.classes)
  times = []
  for i in range(warmup + steps):
    start = time.perf_counter()
    params, opt_state, loss = jax.block_until_ready(step(params, opt_state, images, labels))
    if i >= warmup:
      times.append(time.perf_counter() - start)
  return np.asarray(times)
