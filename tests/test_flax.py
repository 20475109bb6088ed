"""The Flax modules: gradients against plain nnx math, torch-style init, state dicts, training."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import vision_mlp_bwd.api
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


def _rand(seed, shape):
  return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _grads(model, x, cotangent):
  loss = lambda m, x: jnp.sum(m(x) * cotangent)
  return nnx.grad(loss, argnums=(0, 1))(model, x)


@pytest.mark.parametrize("implementation, shape, hidden, intermediate, atol", [
    ("xla", (2, 5), 16, 24, 1e-5),
    # Pallas interpret mode on the CPU: keep it tiny. "highest" is bf16x3 in
    # the kernels (relative error ~1e-5), hence the looser atol.
    ("triton", (8,), 32, 48, 1e-4),
])
def test_gradients_match_nnx_linear_model(monkeypatch, implementation, shape, hidden, intermediate,
                                          atol):
  calls = []
  original = vision_mlp_bwd.api.mlp_backward
  monkeypatch.setattr(vision_mlp_bwd.api, "mlp_backward",
                      lambda *a, **k: calls.append(k["implementation"]) or original(*a, **k))
  model = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(1), precision="highest",
                    implementation=implementation)
  x, cotangent = _rand(2, shape + (hidden,)), _rand(3, shape + (hidden,))
  reference = NnxLinearMLP(model)
  np.testing.assert_allclose(model(x), reference(x), rtol=1e-5, atol=1e-5)

  grad_model, grad_x = _grads(model, x, cotangent)
  ref_model, ref_x = _grads(reference, x, cotangent)
  assert calls == [implementation]  # the gradient ran our backward, with our backend
  np.testing.assert_allclose(grad_x, ref_x, rtol=1e-4, atol=atol)
  for name in ("fc1", "fc2"):
    ours, ref = getattr(grad_model, name), getattr(ref_model, name)
    assert ours["weight"].shape == ref["kernel"].shape[::-1]
    np.testing.assert_allclose(ours["weight"][...], ref["kernel"][...].T, rtol=1e-4, atol=atol)
    np.testing.assert_allclose(ours["bias"][...], ref["bias"][...], rtol=1e-4, atol=atol)
  assert float(jnp.abs(grad_model["fc1"]["weight"][...]).max()) > 0


def test_params_named_laid_out_and_initialised_like_torch():
  hidden, intermediate = 32, 48
  model = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(0))
  shapes = {".".join(map(str, path)): v.shape for path, v in nnx.to_flat_state(nnx.state(model))}
  assert shapes == {"fc1.weight": (intermediate, hidden), "fc1.bias": (intermediate,),
                    "fc2.weight": (hidden, intermediate), "fc2.bias": (hidden,)}
  for name, fan_in in (("fc1", hidden), ("fc2", intermediate)):
    bound = 1 / np.sqrt(fan_in)
    weight = np.asarray(getattr(model, name).weight[...])
    assert np.abs(weight).max() <= bound and np.abs(weight).max() > 0.9 * bound
    assert abs(weight.std() - bound / np.sqrt(3)) < 0.1 * bound / np.sqrt(3)  # uniform
    bias = np.asarray(getattr(model, name).bias[...])
    assert np.abs(bias).max() <= bound and np.unique(bias).size == bias.size
  other = VisionMLP(hidden, intermediate, rngs=nnx.Rngs(1))
  assert not np.allclose(other.fc1.weight[...], model.fc1.weight[...])


def test_dtype_casts_computation_not_params():
  model = VisionMLP(16, 24, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
  x = _rand(0, (4, 16))
  assert model(x).dtype == jnp.bfloat16
  grads = nnx.grad(lambda m: jnp.sum(m(x).astype(jnp.float32)))(model)
  assert grads["fc1"]["weight"][...].dtype == jnp.float32 == model.fc1.weight[...].dtype
  np.testing.assert_allclose(model(x).astype(jnp.float32),
                             VisionMLP(16, 24, rngs=nnx.Rngs(0))(x), rtol=0.05, atol=0.05)


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
  source, target = VisionMLP(16, 24, rngs=nnx.Rngs(0)), VisionMLP(16, 24, rngs=nnx.Rngs(1))
  saved = state_dict(source, prefix)
  assert sorted(saved) == sorted(prefix + n for n in NAMES)
  assert all(isinstance(v, np.ndarray) for v in saved.values())
  assert saved[prefix + "fc1.weight"].shape == (24, 16)
  checkpoint = {k: FakeTorchTensor(v) for k, v in saved.items()}
  checkpoint["blocks.0.attn.qkv.weight"] = np.zeros((48, 16))  # other entries are ignored
  x = _rand(0, (3, 16))
  assert not np.allclose(source(x), target(x))
  assert load_state_dict(target, checkpoint, prefix) is target
  np.testing.assert_array_equal(source(x), target(x))
  for name, value in state_dict(target).items():
    np.testing.assert_array_equal(value, saved[prefix + name])


def test_state_dict_with_qwen3_vl_names():
  source, target = VisionMLP(16, 24, rngs=nnx.Rngs(0)), VisionMLP(16, 24, rngs=nnx.Rngs(1))
  prefix = "visual.blocks.3.mlp."
  saved = state_dict(source, prefix, rename=QWEN3_VL)
  assert sorted(saved) == [prefix + f"linear_{n}" for n in sorted(NAMES)]
  load_state_dict(target, saved, prefix, rename=QWEN3_VL)
  x = _rand(0, (3, 16))
  np.testing.assert_array_equal(source(x), target(x))


def test_load_errors_name_the_key_and_shapes_and_write_nothing():
  model = VisionMLP(16, 24, rngs=nnx.Rngs(0))
  before = state_dict(model)
  fresh = state_dict(VisionMLP(16, 24, rngs=nnx.Rngs(1)), "mlp.")
  missing = {k: v for k, v in fresh.items() if k != "mlp.fc2.bias"}
  with pytest.raises(KeyError, match=r"mlp\.fc2\.bias"):
    load_state_dict(model, missing, "mlp.")
  transposed = dict(fresh, **{"mlp.fc2.weight": fresh["mlp.fc2.weight"].T})
  with pytest.raises(ValueError, match=r"mlp\.fc2\.weight.*\(24, 16\).*expected \(16, 24\)"):
    load_state_dict(model, transposed, "mlp.")
  for name, value in state_dict(model).items():  # failed loads leave the module as it was
    np.testing.assert_array_equal(value, before[name])


def test_linen_module_matches_nnx_and_loads_state_dicts():
  nnx_model = VisionMLP(16, 24, rngs=nnx.Rngs(0), implementation="xla")
  linen_model = VisionMLPLinen(16, 24, implementation="xla")
  x, cotangent = _rand(1, (2, 3, 16)), _rand(2, (2, 3, 16))
  variables = linen_model.init(jax.random.key(5), x)
  assert sorted(state_dict(variables)) == sorted(NAMES)
  variables = load_state_dict(variables, state_dict(nnx_model))
  np.testing.assert_array_equal(linen_model.apply(variables, x), nnx_model(x))
  linen_grads = jax.grad(lambda v: jnp.sum(linen_model.apply(v, x) * cotangent))(variables)
  nnx_grads, _ = _grads(nnx_model, x, cotangent)
  np.testing.assert_allclose(linen_grads["params"]["fc1"]["weight"],
                             nnx_grads["fc1"]["weight"][...], rtol=1e-6, atol=1e-6)


def test_jitted_optimizer_steps_lower_the_loss():
  model = VisionMLP(16, 32, rngs=nnx.Rngs(0), implementation="xla")
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x, target = _rand(1, (64, 16)), jnp.tanh(_rand(2, (64, 16)))

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
