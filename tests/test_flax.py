"""The Flax modules: gradients, torch-style init, state dicts, training.

Outputs and gradients are held to the float64 model within the bounds of tests/bounds.py
(the forward's, and the gradient's with the forward's own errors); the same MLP written
with nnx.Linear and jax.nn.gelu must meet the forward bound too, which pins the layout.
"""

import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import vision_mlp_bwd.api
from tests import bounds, helpers
from vision_mlp_bwd.flax import QWEN3_VL, VisionMLP, VisionMLPLinen, load_state_dict, state_dict

NAMES = ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


class NnxLinearMLP(nnx.Module):
  """The same MLP written with nnx.Linear (kernel [in, out]) and jax.nn.gelu."""

  def __init__(self, mlp: VisionMLP):
    hidden, intermediate = mlp.fc1.weight.shape[1], mlp.fc1.weight.shape[0]
    rngs = nnx.Rngs(0)
    kw = dict(precision=jax.lax.Precision.HIGHEST, rngs=rngs)
    self.fc1 = nnx.Linear(hidden, intermediate, **kw)
    self.fc2 = nnx.Linear(intermediate, hidden, **kw)
    for name in ("fc1", "fc2"):
      getattr(self, name).kernel[...] = getattr(mlp, name).weight[...].T
      getattr(self, name).bias[...] = getattr(mlp, name).bias[...]

  def __call__(self, x):
    return self.fc2(jax.nn.gelu(self.fc1(x), approximate=True))


def _rand(shape, dtype=jnp.float32):
  return jax.random.normal(helpers.fresh_key(), shape, dtype)


def _grads(model, x, cotangent):
  loss = lambda m, x: jnp.sum(m(x) * cotangent)
  return nnx.grad(loss, argnums=(0, 1))(model, x)


def _params(model):
  return tuple(getattr(getattr(model, n), p)[...] for n in ("fc1", "fc2")
               for p in ("weight", "bias"))


def _assert_output_within_bounds(out, x, params, precision, label):
  (_, _, oracle), (_, _, limit) = bounds.forward_oracle_and_bounds(x, *params, precision)
  bounds.assert_within_bounds([out], [oracle], [limit], x.dtype, label, names=("output",))


def _assert_grads_within_bounds(grad_model, grad_x, x, params, cotangent, precision, label):
  oracle, limits = bounds.gradient_oracle_and_bounds(cotangent, x, params, precision)
  grads = (grad_x, *(grad_model[n][p][...] for n in ("fc1", "fc2") for p in ("weight", "bias")))
  bounds.assert_within_bounds(grads, oracle, limits, [x.dtype, *(p.dtype for p in params)],
                              label)


@pytest.mark.parametrize("implementation, shape, hidden, intermediate", [
    ("xla", (2, 5), 16, 24),
    ("triton", (8,), 32, 48),   # Pallas interpret mode on the CPU: keep it tiny
])
def test_gradients_are_the_models(monkeypatch, implementation, shape, hidden, intermediate):
  calls = []
  original = vision_mlp_bwd.api.mlp_backward
  monkeypatch.setattr(vision_mlp_bwd.api, "mlp_backward",
                      lambda *a, **k: calls.append(k["implementation"]) or original(*a, **k))
  model = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(helpers.fresh_seed()),
                    precision="highest", implementation=implementation)
  x, cotangent = _rand(shape + (hidden,)), _rand(shape + (hidden,))
  params = _params(model)
  _assert_output_within_bounds(model(x), x, params, "highest", "VisionMLP")
  _assert_output_within_bounds(NnxLinearMLP(model)(x), x, params, "highest", "nnx.Linear MLP")

  grad_model, grad_x = _grads(model, x, cotangent)
  assert calls == [implementation]  # the gradient ran our backward, with our backend
  _assert_grads_within_bounds(grad_model, grad_x, x, params, cotangent, "highest",
                              implementation)


def test_params_named_laid_out_and_initialised_like_torch():
  hidden, intermediate = 32, 48
  model = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(helpers.fresh_seed()))
  shapes = {".".join(map(str, path)): v.shape for path, v in nnx.to_flat_state(nnx.state(model))}
  assert shapes == {"fc1.weight": (intermediate, hidden), "fc1.bias": (intermediate,),
                    "fc2.weight": (hidden, intermediate), "fc2.bias": (hidden,)}
  for name, fan_in in (("fc1", hidden), ("fc2", intermediate)):
    bound = 1 / np.sqrt(fan_in)
    weight = np.asarray(getattr(model, name).weight[...])
    # N = 1536 uniform draws on [-b, b]: max |w| < 0.9 b has probability 0.9^N < 1e-70; the
    # sample std's relative standard error is sqrt((kurtosis - 1) / 4N) = 1.1% (kurtosis
    # 9/5), so 10% is 9 standard errors: statistics of the init, not a rounding tolerance.
    assert np.abs(weight).max() <= bound and np.abs(weight).max() > 0.9 * bound
    assert abs(weight.std() - bound / np.sqrt(3)) < 0.1 * bound / np.sqrt(3)  # uniform
    bias = np.asarray(getattr(model, name).bias[...])
    assert np.abs(bias).max() <= bound and np.unique(bias).size == bias.size
  other = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(helpers.fresh_seed()))
  assert not np.array_equal(other.fc1.weight[...], model.fc1.weight[...])


def test_dtype_casts_computation_not_params():
  """dtype=bfloat16 computes the model on the bf16 roundings of the input and the fp32
  parameters (within the bf16 forward's bound) and gives fp32 parameter gradients."""
  model = VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed()), dtype=jnp.bfloat16)
  x = _rand((4, 16))
  out = model(x)
  chex.assert_type(out, jnp.bfloat16)
  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(model)
  chex.assert_type([grads[n][p][...] for n in ("fc1", "fc2") for p in ("weight", "bias")],
                   jnp.float32)
  as_bf16 = lambda t: t.astype(jnp.bfloat16)
  _assert_output_within_bounds(out, as_bf16(x), tuple(map(as_bf16, _params(model))), None,
                               "bf16 computation")


class FakeTorchTensor:
  """Duck-types the torch.Tensor methods load_state_dict uses (torch is not installed)."""

  def __init__(self, array):
    self.array, self.dtype = array, "torch.float32"

  def detach(self):
    return self

  def cpu(self):
    return self

  def numpy(self):
    return self.array


def test_state_dict_round_trip_with_prefix():
  prefix = "blocks.0.mlp."
  source, target = (VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed())) for _ in range(2))
  saved = state_dict(source, prefix)
  assert sorted(saved) == sorted(prefix + n for n in NAMES)
  assert all(isinstance(v, np.ndarray) for v in saved.values())
  assert saved[prefix + "fc1.weight"].shape == (24, 16)
  checkpoint = {k: FakeTorchTensor(v) for k, v in saved.items()}
  checkpoint["blocks.0.attn.qkv.weight"] = np.zeros((48, 16))  # other entries are ignored
  x = _rand((3, 16))
  assert not np.array_equal(source(x), target(x))
  assert load_state_dict(target, checkpoint, prefix) is target
  np.testing.assert_array_equal(source(x), target(x))
  for name, value in state_dict(target).items():
    np.testing.assert_array_equal(value, saved[prefix + name])


def test_state_dict_with_qwen3_vl_names():
  source, target = (VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed())) for _ in range(2))
  prefix = "visual.blocks.3.mlp."
  saved = state_dict(source, prefix, rename=QWEN3_VL)
  assert sorted(saved) == [prefix + f"linear_{n}" for n in sorted(NAMES)]
  load_state_dict(target, saved, prefix, rename=QWEN3_VL)
  x = _rand((3, 16))
  np.testing.assert_array_equal(source(x), target(x))


def test_load_errors_name_the_key_and_shapes_and_write_nothing():
  model = VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed()))
  before = state_dict(model)
  fresh = state_dict(VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed())), "mlp.")
  missing = {k: v for k, v in fresh.items() if k != "mlp.fc2.bias"}
  with pytest.raises(KeyError, match=r"mlp\.fc2\.bias"):
    load_state_dict(model, missing, "mlp.")
  transposed = dict(fresh, **{"mlp.fc2.weight": fresh["mlp.fc2.weight"].T})
  with pytest.raises(ValueError, match=r"mlp\.fc2\.weight.*\(24, 16\).*expected \(16, 24\)"):
    load_state_dict(model, transposed, "mlp.")
  for name, value in state_dict(model).items():  # failed loads leave the module as it was
    np.testing.assert_array_equal(value, before[name])


def test_linen_module_matches_nnx_and_loads_state_dicts():
  nnx_model = VisionMLP(16, 24, rngs=nnx.Rngs(helpers.fresh_seed()), implementation="xla")
  linen_model = VisionMLPLinen(16, 24, implementation="xla")
  x, cotangent = _rand((2, 3, 16)), _rand((2, 3, 16))
  variables = linen_model.init(helpers.fresh_key(), x)
  assert sorted(state_dict(variables)) == sorted(NAMES)
  variables = load_state_dict(variables, state_dict(nnx_model))
  np.testing.assert_array_equal(linen_model.apply(variables, x), nnx_model(x))
  linen_grads = jax.grad(lambda v: jnp.sum(linen_model.apply(v, x) * cotangent))(variables)
  nnx_grads, grad_x = _grads(nnx_model, x, cotangent)
  params = _params(nnx_model)
  _assert_grads_within_bounds(nnx_grads, grad_x, x, params, cotangent, None, "nnx")
  linen = {n: {p: linen_grads["params"][n][p] for p in ("weight", "bias")} for n in ("fc1", "fc2")}
  _assert_grads_within_bounds({n: {p: np.asarray(v) for p, v in d.items()} for n, d in linen.items()},
                              grad_x, x, params, cotangent, None, "linen")


def test_jitted_optimizer_steps_lower_the_loss():
  model = VisionMLP(16, 32, rngs=nnx.Rngs(helpers.fresh_seed()), implementation="xla")
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _rand((64, 16)), jnp.tanh(_rand((64, 16)))

  @nnx.jit
  def step(model, optimizer):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert np.all(np.isfinite(losses))
  assert losses[-1] < 0.5 * losses[0]


def test_package_import_does_not_import_flax():
  code = "import sys, vision_mlp_bwd; assert 'flax' not in sys.modules, 'flax imported'"
  subprocess.run([sys.executable, "-c", code], check=True)
