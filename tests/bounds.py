"""The error model the numerics tests hold every computation to, and the chex check that does it.

Everything here is a worst-case (deterministic, Higham-style) bound, not an
estimate: it follows from the unit roundoffs below and from how the kernels
and the XLA reference compute, and holds for any input and any order of
accumulation. No number in this module was read off a run, except that
`TANH_ERROR` is an assumption on XLA's fp32 tanh (16 units of 2^-24; under 6
seen on AVX2 and SSE4.2), which tests/test_api.py holds on every ISA it runs on.

Roundings. Every rounding (to nearest) of a value x is modelled as
x (1 + d) + e with |d| <= u, the format's unit roundoff, and |e| <= eta, half
its smallest subnormal spacing (`Rounding`): fp32 u = 2^-24, float64 2^-53,
f16 2^-11 (eta 2^-25: f16's subnormals start at 2^-14), bf16 2^-8, TF32
2^-11 (10 stored bits). A GPU's tensor cores may instead truncate an fp32
operand to TF32 (they drop its 13 low bits when they read it from shared
memory): |x - t(x)| < 2^-10 |x|, `TF32_TRUNCATION`, which is what the GPU
bound for TF32 products uses. On the CPU, interpret mode and XLA compute
TF32 (`precision=None`) in fp32: there its bound is fp32's.

Products. For C = A @ B over K terms, with operands that arrive with
absolute errors H_A, H_B (the pre-GELU gradient, say), are rounded as
r_A, r_B before the multiplication (identity where a mode uses them exactly)
and are accumulated in fp32 in any order and grouping (tiles, split-K
partials summed afterwards, sums across devices),

    |C_computed - C| <= c_K (Ã @ B̃) + (Ã - |A|) @ B̃ + |A| @ (B̃ - |B|),
    Ã = (1 + u_A)(|A| + H_A) + eta_A,  B̃ likewise,

with c_K = gamma_K = K u / (1 - K u), u = 2^-24 (Higham, Accuracy and
Stability of Numerical Algorithms, 2nd ed., section 3.1: every term of a sum of
K passes through at most K roundings, its product's included, whatever the
summation tree). On the GPU, u = 2^-23 (`TENSOR_CORE_ACCUMULATION`): tensor
cores are not known to round their fp32 sums to nearest; Fasi, Higham, Mikaitis
and Pranesh (PeerJ Comput. Sci. 7:e330, 2021) found them truncating, and
round-toward-zero has twice the unit roundoff. With H = eta = 0 and u_A = u_B = u_op this is the familiar
((1 + u_op)^2 (1 + gamma_K) - 1) |A| @ |B|. bf16x3 (HIGHEST and HIGH in the
kernels) has its own c_K, see `BF16X3_PRODUCT`.

The backward, as the kernels (and the XLA reference) compute it:
grad_gelu = grad_output @ fc2_weight (K = H; on 16-bit inputs the XLA path
returns it rounded to the input dtype, as jnp.matmul does); pre = grad_gelu *
gelu'(fc1_output) in fp32, with gelu' within `gelu_grad_error` of the exact derivative and the
product rounded to fp32; pre is then rounded as the mode says (to the
16-bit operand dtype where it is stored so, to the input dtype on 16-bit
inputs, to TF32 on the GPU's TF32 products) before it is summed
(grad_fc1_bias, K = S) or multiplied (grad_hidden_state = pre @ fc1_weight,
K = I; grad_fc1_weight = pre.T @ hidden_state, K = S); its error enters those
three through H_A above. grad_fc2_weight = grad_output.T @ gelu_output and
grad_fc2_bias = sum(grad_output) (K = S) read inputs only. Each result is
finally rounded to the output dtype: nothing for fp32 outputs (the fp32
accumulator is the result), u_out (|C| + E) + eta_out for 16-bit ones, and
((1 + u_out)^D - 1) per result summed over D devices in its own dtype.

The float64 oracle is exact but for its own roundings; they are covered by
taking u = 2^-24 + 2^-53 in every gamma and by adding the float64 GELU
derivative's error. All bounds carry a growth factor of exactly 1.
"""

from __future__ import annotations

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np

from vision_mlp_bwd.precision import (SPECULATED_SCALE, DotMode, canonicalize,
                                      sample_speculated_scale)
from vision_mlp_bwd.problem import GRADIENTS as OUT_NAMES

# --- unit roundoffs -------------------------------------------------------------------------

U32 = 2.0 ** -24
U64 = 2.0 ** -53
U_TF32 = 2.0 ** -11
U_F16 = 2.0 ** -11
U_BF16 = 2.0 ** -8
TF32_TRUNCATION = 2.0 ** -10
TENSOR_CORE_ACCUMULATION = 2.0 ** -23

# bf16x3: x = hi + lo + res with hi = bf16(x), lo = bf16(x - hi) (x - hi is exact in fp32,
# Sterbenz). |x - hi| <= 2^-8 |x| and |res| <= 2^-8 |x - hi| <= 2^-16 |x|; |hi| <= (1 + 2^-8)|x|,
# |lo| <= 2^-8 (1 + 2^-8)|x|. The kernels form hi*hi + hi*lo + lo*hi (each product exact in
# fp32); the dropped a_hi b_res + a_res b + a_lo b_lo + a_lo b_res is at most
# 2^-16 (3 + 4 2^-8 + 2 2^-16)|a||b| <= 3 2^-16 + 2^-21 relative per product. The three
# exact products of each term are accumulated in fp32 with at most K + 1 roundings on any
# term (each tile's three dots are added up before joining the K sum), and their absolute
# sum is at most (1 + 2^-8)^2 (1 + 2 2^-8 (1 + 2^-8)) |a||b| <= (1 + 2^-5)|a||b|; so
# c_K = BF16X3_PRODUCT + BF16X3_PARTS * gamma_{K+1}. The Mosaic backend's products over the
# pieces side by side (`backward_sm90`: one fp32 sum of all 3K exact products) put each
# term through at most 3K roundings: c_K = BF16X3_PRODUCT + BF16X3_PARTS * gamma_{3K}.
BF16X3_PRODUCT = 3 * 2.0 ** -16 + 2.0 ** -21
BF16X3_PARTS = 1 + 2.0 ** -5

# --- the GELU and its derivative --------------------------------------------------------------

# `reference.gelu_tanh_grad` in fp32 is within this (absolute) of the exact derivative on
# [-12, 12] on every CPU ISA (tests/test_gelu.py holds it there); outside, the exact value is
# within 1e-50 of 0 or 1 and the fp32 form returns 0 or 1 up to one rounding. Kernels in
# interpret mode compute the same jnp code.
GELU_GRAD_ERROR = 5e-7
# On the GPU the kernels' exp is `ex2.approx.f32(y * log2(e))` (relative error <= 2^-22 by
# the PTX ISA, plus one rounding of the argument: |y| 2^-24) and their division
# 1 / (1 + t) `div.approx`/`div.full` (<= 2 ulp, 2^-22 relative). With t = exp(-2|u|),
# sup_x t |d gelu'/dt| = 1/4 (at x = 0) and sup_x |y| t |d gelu'/dt| < 0.33, and a relative
# error e of p = 1/(1 + t) moves gelu' = r + q x c(x) (r = p or t p, q = t p^2) by at most
# |r + 2 q x c(x)| e <= 1.36 e. On top of the CPU bound (which already pays for an exp and
# a division of about an ulp): 5e-7 + 0.25 * 2^-22 + 0.33 * 2^-24 + 1.36 * 2^-22 < 9.1e-7.
GPU_GELU_GRAD_ERROR = 1e-6
# The float64 oracle's own derivative (the contract's tanh formula in NumPy float64): 1 - t^2
# is off by at most 4 * 2^-53 where t -> 1, times 0.5 |x| sqrt(2/pi)(1 + 3 0.044715 x^2) <= 98
# on [-12, 12], plus a few roundings of terms <= 1.13: below 1e-13.
GELU_GRAD_FLOAT64_ERROR = 1e-13
GELU_GRAD_MAX = 1.13                 # sup |gelu'| = 1.12899... (tests/test_kernels.py checks
                                     # these and the sensitivities above in float64)
GELU_SECOND_DERIVATIVE_MAX = 0.8     # sup |gelu''| = gelu''(0) = sqrt(2/pi) = 0.79788...
# The forward's fp32 GELU, 0.5 x (1 + tanh(v)), v = sqrt(2/pi)(x + 0.044715 x^3): v carries at
# most 7 roundings (two fp32 constants among them) of same-sign terms, |dv| <= 7u|v|, which
# moves tanh by <= sup(|v| sech^2 v) 7u = 0.448 * 7u; XLA's fp32 tanh is assumed within
# TANH_ERROR (absolute) of tanh (tests/test_api.py holds the GELU below to it on every ISA);
# 1 + t and the last product add 2u|x|/2 and u|x|. So |gelu_fp32(x) - gelu(x)| <=
# (0.5 TANH_ERROR + 4u)|x|.
TANH_ERROR = 2.0 ** -20
GELU_ERROR_PER_X = 0.5 * TANH_ERROR + 4 * U32
GELU_FLOAT64_ERROR_PER_X = 1e-15     # NumPy's tanh (<= 1 ulp) and 6 float64 roundings


# --- relative Frobenius checks (beside the bound, where they say more) -------------------------

# HIGHEST is "fp32-class": relative Frobenius error <= 1e-5 on every output. That is the
# contract (README, precision.py), a requirement and not an error bound; the tests check it
# beside the bound, which at K terms allows ~K u and cannot tell bf16x3 from TF32.
HIGHEST_RELATIVE_ERROR = 1e-5
# Where a mode rounds operands (or results) to a format with unit roundoff u, the worst-case
# bound allows ~K u per term sum, too loose at K = 300 to tell f16 operands from bf16 ones.
# The relative Frobenius error says more. Under the standard random-rounding model
# (independent zero-mean rounding errors of variance <= u^2/3 per rounded value; Higham and
# Mary, SIAM J. Sci. Comput. 41(5), 2019) a product of two rounded operands has an expected
# relative Frobenius error <= sqrt(2/3) u on independent zero-mean data (the SOL inputs), and
# the backward's chain (the rounded pre-GELU gradient, a 16-bit output) adds at most about
# two more such terms: <= ~1.3 u. The check allows REL_FROBENIUS_GROWTH u. It is a stated
# estimate for random inputs, not a worst-case bound, and sits beside the bound.
REL_FROBENIUS_GROWTH = 2


def gamma(k, u=U32 + U64):
  """gamma_k = k u / (1 - k u); by default fp32's, with the float64 oracle's own roundings
  added (u = 2^-24 + 2^-53)."""
  ku = k * u
  assert ku < 0.5, (k, u)
  return ku / (1 - ku)


@dataclasses.dataclass(frozen=True)
class Rounding:
  """x -> x (1 + d) + e, |d| <= u, |e| <= eta: one rounding, or none (`EXACT`)."""
  u: float = 0.0
  eta: float = 0.0

  def then(self, other: "Rounding") -> "Rounding":
    """This rounding followed by `other`."""
    return Rounding((1 + self.u) * (1 + other.u) - 1, self.eta * (1 + other.u) + other.eta)


EXACT = Rounding()
ROUNDINGS = {
    "float32": Rounding(U32, 2.0 ** -150),
    "float16": Rounding(U_F16, 2.0 ** -25),
    "bfloat16": Rounding(U_BF16, 2.0 ** -134),
    "tf32": Rounding(U_TF32, 2.0 ** -134),
}
# bf16 -> f16 is exact within f16's normal range (8 significant bits fit in 11); below it,
# f16's subnormal spacing. f16 -> bf16 rounds to 8 bits, with bf16's range to spare.
CONVERSIONS = {("bfloat16", "float16"): Rounding(0.0, 2.0 ** -25),
               ("float16", "bfloat16"): ROUNDINGS["bfloat16"]}
OPERANDS = ("grad_output", "hidden_state", "fc1_weight", "fc2_weight", "gelu_output")


@dataclasses.dataclass(frozen=True)
class Arithmetic:
  """How one backward computes, in the terms of the module docstring."""
  operand: Rounding            # each input operand of a product (`operands` overrides per name)
  pre_product: Rounding        # the fp32 pre-GELU gradient -> operand of its two products
  pre_sum: Rounding            # the fp32 pre-GELU gradient -> term of grad_fc1_bias
  grad_output_sum: Rounding    # grad_output -> term of grad_fc2_bias
  output: Rounding             # each result -> its dtype
  gelu_grad_error: float
  bf16x3: bool = False
  bf16x3_one_sum: bool = False   # bf16x3's three products of a term in one sum of 3K terms
  operands: tuple = ()         # ((name, Rounding), ...) overriding `operand` for those inputs
  accumulation: float = U32    # unit roundoff of the sums (float64 for the x64 checks)
  # TF32 on the GPU may run on f16 tensor cores (`Config.tf32_on_f16`): add the f16 subnormal
  # grid of its scaled operands (`f16_scaled_etas`), which depends on their magnitudes.
  f16_scaled: bool = False
  # grad_output @ fc2_weight as it leaves its product, before gelu' multiplies it: on 16-bit
  # inputs the XLA path returns it in the input dtype, as jnp.matmul does (the kernels keep
  # it in fp32; the bound covers both).
  grad_gelu: Rounding = EXACT

  def rounding(self, name):
    return dict(self.operands).get(name, self.operand)


def bf16x3_in_one_sum(precision="highest", platform=None) -> Arithmetic:
  """`arithmetic` of fp32 inputs under HIGHEST or HIGH where each product's three bf16x3
  products are one sum of 3K terms (the Mosaic backend's products over the pieces)."""
  return dataclasses.replace(arithmetic(precision, jnp.float32, platform), bf16x3_one_sum=True)


def platform_name(platform=None):
  return platform or jax.default_backend()


def mode_for(precision, dtype) -> DotMode:
  """The DotMode that runs for `precision` on inputs of `dtype`, as jnp.matmul means it:
  on bf16/f16 inputs every 32-bit mode multiplies the 16-bit values as they are (the input
  dtype's own 16-bit mode), the 16-bit presets keep their dtype. Stated here, independently
  of `precision.for_inputs` (tests/test_api.py checks that the library agrees)."""
  mode = canonicalize(precision)
  sixteen = {"float16": DotMode.F16, "bfloat16": DotMode.BF16}.get(jnp.dtype(dtype).name)
  return sixteen if sixteen is not None and mode.operand_dtype is None else mode


def arithmetic(precision, dtype, platform=None) -> Arithmetic:
  """The error model of the backward (kernels and XLA alike) for `precision` on `dtype` inputs."""
  dtype = jnp.dtype(dtype)
  gpu = platform_name(platform) == "gpu"
  common = dict(gelu_grad_error=GPU_GELU_GRAD_ERROR if gpu else GELU_GRAD_ERROR,
                accumulation=TENSOR_CORE_ACCUMULATION if gpu else U32)
  mode = mode_for(precision, dtype)
  name = dtype.name
  if name == "float64":        # a float64 computation (the x64 checks): exact but for its sums
    return Arithmetic(EXACT, EXACT, EXACT, EXACT, EXACT, GELU_GRAD_FLOAT64_ERROR,
                      accumulation=U64)
  if name == "float32":
    if mode == DotMode.TF32:
      tf32 = Rounding(TF32_TRUNCATION, ROUNDINGS["tf32"].eta) if gpu else EXACT
      return Arithmetic(tf32, tf32, EXACT, EXACT, EXACT, f16_scaled=gpu, **common)
    if mode in (DotMode.HIGHEST, DotMode.BF16X3):
      # On the GPU the automatic choice may run either bf16x3 (the Triton kernels' or the
      # Mosaic backend's products over the pieces): the bound of the longer sums covers both.
      return Arithmetic(EXACT, EXACT, EXACT, EXACT, EXACT, bf16x3=True, bf16x3_one_sum=gpu,
                        **common)
    if mode == DotMode.F32:
      return Arithmetic(EXACT, EXACT, EXACT, EXACT, EXACT, **common)
    r = ROUNDINGS[jnp.dtype(mode.operand_dtype).name]   # F16 / BF16: cast operands, pre stored so
    return Arithmetic(r, r, r, r, EXACT, **common)
  # 16-bit inputs: the mode's operand dtype is the input dtype (every 32-bit precision) or the
  # preset's; the pre-GELU gradient is rounded to the input dtype, then to the operand dtype.
  target = jnp.dtype(mode.operand_dtype).name
  op = EXACT if target == name else CONVERSIONS[(name, target)]
  pre = ROUNDINGS[name] if target == name else ROUNDINGS[name].then(ROUNDINGS[target])
  return Arithmetic(op, pre, pre, op, ROUNDINGS[name], grad_gelu=ROUNDINGS[name], **common)


def forward_arithmetic(precision, dtype, platform=None):
  """(operand rounding, bf16x3?) of the forward's two XLA products (`reference.mlp_forward`)."""
  dtype = jnp.dtype(dtype)
  gpu = platform_name(platform) == "gpu"
  mode = mode_for(precision, dtype)
  if dtype.name == "float64":
    return EXACT, False
  if dtype.name != "float32":
    target = jnp.dtype(mode.operand_dtype).name
    return (EXACT if target == dtype.name else CONVERSIONS[(dtype.name, target)]), False
  if mode == DotMode.TF32:
    return (Rounding(TF32_TRUNCATION, ROUNDINGS["tf32"].eta) if gpu else EXACT), False
  if mode == DotMode.BF16X3 and gpu:
    return EXACT, True                       # XLA's bf16x3 preset
  if mode.operand_dtype is not None:
    return ROUNDINGS[jnp.dtype(mode.operand_dtype).name], False
  return EXACT, False                        # HIGHEST and F32 are true fp32 in XLA


def output_rounding(dtype):
  """The rounding of an fp32 result to `dtype` (none for fp32 and float64 results)."""
  name = jnp.dtype(dtype).name
  return EXACT if name in ("float32", "float64") else ROUNDINGS[name]


def relative_frobenius_tolerance(precision, dtype, platform=None):
  """The relative Frobenius error allowed beside the bound, or None where the bound says it all.

  HIGHEST and HIGH on fp32 inputs: the contract, `HIGHEST_RELATIVE_ERROR`. Modes that round to
  a format of unit roundoff u (16-bit operands or inputs and outputs, TF32 on the GPU):
  `REL_FROBENIUS_GROWTH` u, with u the largest among them. fp32 products: None.
  """
  dtype = jnp.dtype(dtype)
  mode = mode_for(precision, dtype)
  if dtype.name == "float32":
    if mode in (DotMode.HIGHEST, DotMode.BF16X3):
      return HIGHEST_RELATIVE_ERROR
    if mode == DotMode.TF32 and platform_name(platform) == "gpu":
      return REL_FROBENIUS_GROWTH * U_TF32
    if mode.operand_dtype is None:
      return None
  names = {dtype.name, jnp.dtype(mode.operand_dtype).name} - {"float32"}
  return REL_FROBENIUS_GROWTH * max(ROUNDINGS[n].u for n in names)


# --- float64 building blocks --------------------------------------------------------------------

def f64(x):
  """`x` (any float dtype, JAX or NumPy) as a float64 NumPy array, exactly."""
  return np.asarray(x).astype(np.float64)


def gelu64(x):
  """The tanh-approximate GELU in NumPy float64."""
  x = np.asarray(x, np.float64)
  return 0.5 * x * (1.0 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def gelu_grad64(x):
  """The contract's derivative 0.5 (1 + t) + 0.5 x (1 - t^2) u'(x), t = tanh u, in float64."""
  x = np.asarray(x, np.float64)
  s = math.sqrt(2 / math.pi)
  with np.errstate(invalid="ignore", over="ignore"):   # +-inf and NaN give NaN, as the contract's
    t = np.tanh(s * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * s * (1 + 3 * 0.044715 * x * x)


def product_error(a_abs, b_abs, *, k=None, a_error=0.0, b_error=0.0, a_rounding=EXACT,
                  b_rounding=EXACT, bf16x3=False, bf16x3_one_sum=False, accumulation=U32):
  """(bound on |computed a @ b - a @ b|, Ã @ B̃), given `a_abs` >= |a| and `b_abs` >= |b|.

  See the module docstring: `a_error`, `b_error` are the operands' incoming absolute errors
  (arrays or scalars), the roundings what the product does to them before multiplying, K
  the contraction length (`a_abs.shape[-1]`). The float64 oracle's own roundings are in the
  gamma (u = accumulation + 2^-53). The bound only grows with `a_abs` and `b_abs`.
  """
  k = a_abs.shape[-1] if k is None else k
  at = (1 + a_rounding.u) * (a_abs + a_error) + a_rounding.eta
  bt = (1 + b_rounding.u) * (b_abs + b_error) + b_rounding.eta
  u = accumulation + U64
  roundings = 3 * k if bf16x3_one_sum else k + 1
  c = BF16X3_PRODUCT + BF16X3_PARTS * gamma(roundings, u) if bf16x3 else gamma(k, u)
  magnitude = at @ bt
  error = c * magnitude
  if np.any(at != a_abs):
    error = error + (at - a_abs) @ bt
  if np.any(bt != b_abs):
    error = error + a_abs @ (bt - b_abs)
  return error, magnitude


def _oracle_slack(magnitude, k):
  """How far a float64 value from K terms of this absolute magnitude can be from exact."""
  return gamma(k + 2, U64) * magnitude


def _finish(error, magnitude, ref, rounding, devices=1):
  """The bound after rounding a result to its dtype (summed over `devices` in that dtype)."""
  if rounding == EXACT:
    return error
  if devices == 1:
    return error + rounding.u * (np.abs(ref) + error) + rounding.eta
  grow = (1 + rounding.u) ** devices
  return error + (grow - 1) * (magnitude + error) + devices * grow * rounding.eta


# --- the backward ---------------------------------------------------------------------------------

def backward_oracle_and_bounds(inputs, precision=None, *, platform=None, model=None,
                               dtype=None, residual_errors=None, product_inputs=None,
                               devices=(1, 1, 1, 1, 1), magnitudes=False):
  """Float64 oracle and bound arrays for the five outputs of `mlp_backward(*inputs)`.

  `inputs` are the eight arguments (any leading dimensions). The bounds are for
  `precision` on inputs of `dtype` (default: `inputs[1]`'s) on `platform` (default: JAX's
  backend), unless `model` (an `Arithmetic`) gives the error model.
  `residual_errors=(E_x, E_a)`: `fc1_output` and `gelu_output` are the exact activations
  and the computation sees values within E_x, E_a of them (`gradient_oracle_and_bounds`).
  `product_inputs`: name -> array replacing that input in the oracle's products (not in its
  bias sums), e.g. TF32-rounded operands. `devices[i]`: result i is summed over that many
  devices in its own dtype (sharded 16-bit results).
  Returns (oracle, bounds): two tuples of five float64 arrays shaped like the outputs.
  """
  dtype = jnp.dtype(dtype if dtype is not None else inputs[1].dtype)
  ar = model or arithmetic(precision, dtype, platform)
  acc = ar.accumulation
  dy, hs, w1, _, w2, _, x, a = (f64(t) for t in inputs)
  lead = hs.shape
  dy, hs, x, a = (t.reshape(-1, t.shape[-1]) for t in (dy, hs, x, a))
  s, h = dy.shape
  i = w1.shape[0]
  prod = dict(zip(OPERANDS, (dy, hs, w1, w2, a)))
  for name, value in (product_inputs or {}).items():
    value = f64(value)
    prod[name] = value if name.endswith("weight") else value.reshape(-1, value.shape[-1])
  p_dy, p_hs, p_w1, p_w2, p_a = (prod[n] for n in OPERANDS)
  x_error, a_error = 0.0, 0.0
  if residual_errors is not None:
    x_error, a_error = (f64(e).reshape(-1, i) for e in residual_errors)
  if ar.f16_scaled:
    etas, pre_eta = f16_scaled_etas(inputs)
    ar = dataclasses.replace(
        ar, operands=tuple((n, Rounding(ar.rounding(n).u, ar.rounding(n).eta + e))
                           for n, e in etas.items()),
        pre_product=Rounding(ar.pre_product.u, ar.pre_product.eta + pre_eta), f16_scaled=False)
  r = ar.rounding
  kw = dict(bf16x3=ar.bf16x3, bf16x3_one_sum=ar.bf16x3_one_sum, accumulation=acc)
  ones = np.ones((s, 1))

  # grad_gelu = grad_output @ fc2_weight, then pre = fl(grad_gelu * gelu'(x)).
  g = p_dy @ p_w2
  g_error, _ = product_error(np.abs(p_dy), np.abs(p_w2), a_rounding=r("grad_output"),
                             b_rounding=r("fc2_weight"), **kw)
  g_mag = np.abs(p_dy) @ np.abs(p_w2)
  g_abs = np.abs(g) + _oracle_slack(g_mag, h)                         # >= |exact grad_gelu|
  g_error = g_error + ar.grad_gelu.u * (g_abs + g_error) + ar.grad_gelu.eta
  d = gelu_grad64(x)
  d_error = ar.gelu_grad_error + GELU_GRAD_FLOAT64_ERROR + GELU_SECOND_DERIVATIVE_MAX * x_error
  pre = g * d
  pre_abs = (np.abs(pre) + _oracle_slack(g_mag, h + 1) * np.abs(d)
             + g_abs * GELU_GRAD_FLOAT64_ERROR)                       # >= |exact pre|
  e1 = g_error * (np.abs(d) + d_error) + g_abs * d_error
  pre_error = e1 + (acc + U64) * (pre_abs + e1) + ROUNDINGS["float32"].eta

  results = [  # (oracle, error, magnitude, K)
      (pre @ p_w1, *product_error(pre_abs, np.abs(p_w1), a_error=pre_error,
                                  a_rounding=ar.pre_product, b_rounding=r("fc1_weight"), **kw),
       i),
      (pre.T @ p_hs, *product_error(pre_abs.T, np.abs(p_hs), a_error=pre_error.T,
                                    a_rounding=ar.pre_product, b_rounding=r("hidden_state"),
                                    **kw), s),
      (pre.sum(0), *(t[:, 0] for t in product_error(pre_abs.T, ones, a_error=pre_error.T,
                                                     a_rounding=ar.pre_sum,
                                                     accumulation=acc)), s),
      (p_dy.T @ p_a, *product_error(np.abs(p_dy).T, np.abs(p_a), b_error=a_error,
                                    a_rounding=r("grad_output"), b_rounding=r("gelu_output"),
                                    **kw), s),
      (dy.sum(0), *(t[:, 0] for t in product_error(np.abs(dy).T, ones,
                                                     a_rounding=ar.grad_output_sum,
                                                     accumulation=acc)), s),
  ]
  oracle, bounds = [], []
  for (ref, error, magnitude, k), n in zip(results, devices):
    oracle.append(ref)
    bounds.append(_finish(error + _oracle_slack(magnitude, k), magnitude, ref, ar.output, n))
  oracle[0], bounds[0] = oracle[0].reshape(lead), bounds[0].reshape(lead)
  if magnitudes:
    sizes = [m for _, _, m, _ in results]
    return tuple(oracle), tuple(bounds), (sizes[0].reshape(lead), *sizes[1:])
  return tuple(oracle), tuple(bounds)


def tf32_rne(x):
  """fp32 `x` rounded to TF32 with ties to even (what an f16 conversion of it scaled by a power
  of two gives within f16's normal range), in float64."""
  bits = np.asarray(x, np.float32).view(np.uint32).astype(np.uint64)
  rounded = ((bits + 0x0FFF + ((bits >> 13) & 1)) & 0xFFFFE000).astype(np.uint32)
  out = rounded.view(np.float32).astype(np.float64)
  return np.where(np.isfinite(np.asarray(x, np.float32)), out, np.asarray(x, np.float64))


def f16_scaled_etas(inputs):
  """({operand: eta}, eta of the pre-GELU gradient) of TF32 products on f16 tensor cores.

  An element far below its row's or column's largest falls into f16's subnormals, spacing
  2^-24 in scaled units, where it can differ from its TF32 rounding by 2^-24 / scale:
  measured scales bring maxima to [2^14, 2^15), so eta <= 2^-38 max|x|; a speculated
  scale gives 2^-24 over it: 2^-34 for `precision.SPECULATED_SCALE` (the weights' on the
  Triton backend), and on the Mosaic one each input's `precision.sample_speculated_scale`
  (the pre-GELU gradient's copies take grad_output's); the Triton backend measures the
  activations' scales. The pre-GELU gradient's measured
  scales follow the bound 2 H max|grad_output| max|fc2_weight| on its lines.
  """
  dy, hs, w1, _, w2, _, _, a = (f64(t) for t in inputs)
  top = lambda v: float(np.max(np.abs(v), initial=0.0, where=np.isfinite(v)))
  speculated = lambda v: float(sample_speculated_scale(
      jnp.asarray(v.reshape(-1, v.shape[-1]), jnp.float32)))
  weights = ("fc1_weight", "fc2_weight")
  eta = {name: max(2.0 ** -24 / (min(SPECULATED_SCALE, speculated(v)) if name in weights
                                 else speculated(v)), 2.0 ** -38 * top(v))
         for name, v in (("grad_output", dy), ("hidden_state", hs), ("gelu_output", a),
                         ("fc1_weight", w1), ("fc2_weight", w2))}
  return eta, max(2.0 ** -24 / speculated(dy),
                  2.0 ** -38 * 2 * dy.shape[-1] * top(dy) * top(w2))


def tf32_on_f16_oracle_and_bounds(inputs, platform=None):
  """Oracle and bounds for `Config.tf32_on_f16`: TF32 products run on f16 tensor cores.

  The oracle multiplies the TF32 roundings (ties to even, as f16 converts) of every
  operand, so the inputs' rounding is no error; the pre-GELU gradient is rounded to TF32
  (u = 2^-11) after its own errors: one TF32 ulp where the computed value and the exact
  one fall on either side of a rounding boundary. Elements far below their row's or
  column's largest fall into f16's subnormal grid (`f16_scaled_etas`). The bias sums are
  of the fp32 values.
  """
  eta, pre_eta = f16_scaled_etas(inputs)
  tf32 = arithmetic(None, jnp.float32, platform)   # its GELU derivative and accumulation
  ar = dataclasses.replace(tf32, operand=EXACT, pre_product=Rounding(U_TF32, pre_eta),
                           operands=tuple((n, Rounding(0.0, e)) for n, e in eta.items()),
                           f16_scaled=False)
  rounded = {n: tf32_rne(np.asarray(inputs[j], np.float32))
             for n, j in (("grad_output", 0), ("hidden_state", 1), ("fc1_weight", 2),
                          ("fc2_weight", 4), ("gelu_output", 7))}
  return backward_oracle_and_bounds(inputs, model=ar, product_inputs=rounded, platform=platform)


# --- the forward and the gradient of vision_mlp ------------------------------------------------

def forward_oracle_and_bounds(hidden_state, fc1_weight, fc1_bias, fc2_weight, fc2_bias,
                              precision=None, *, platform=None):
  """((fc1_output, gelu_output, output), their bounds) of `reference.mlp_forward`, in float64.

  As the forward computes: fc1_output = fl(hidden_state @ fc1_weight.T + fc1_bias), rounded
  to the input dtype (on 16-bit inputs the product is rounded to it first, as jnp.matmul
  returns it, then the bias is added); gelu_output = the fp32 GELU of that (`GELU_ERROR_PER_X`, plus sup|gelu'|
  times the error of its argument), rounded to the dtype; the output likewise from
  gelu_output. Leading dimensions are kept.
  """
  dtype = jnp.dtype(hidden_state.dtype)
  op, bf16x3 = forward_arithmetic(precision, dtype, platform)
  acc = (U64 if dtype.name == "float64" else
         TENSOR_CORE_ACCUMULATION if platform_name(platform) == "gpu" else U32)
  per_x = (GELU_FLOAT64_ERROR_PER_X if dtype.name == "float64" else GELU_ERROR_PER_X)
  out_round = output_rounding(dtype)
  hs, w1, b1, w2, b2 = (f64(t) for t in (hidden_state, fc1_weight, fc1_bias, fc2_weight,
                                         fc2_bias))
  lead = hs.shape[:-1]
  hs = hs.reshape(-1, hs.shape[-1])

  def linear(act, act_error, weight, bias):
    value = act @ weight.T + bias
    k = act.shape[1]
    error, magnitude = product_error(np.abs(act), np.abs(weight).T, a_error=act_error,
                                     a_rounding=op, b_rounding=op, bf16x3=bf16x3,
                                     accumulation=acc)
    error = error + _oracle_slack(magnitude, k)
    if out_round != EXACT:   # 16-bit inputs: the product leaves in the input dtype
      product = np.abs(act @ weight.T) + _oracle_slack(magnitude, k)
      error = error + out_round.u * (product + error) + out_round.eta
    total = np.abs(value) + _oracle_slack(magnitude + np.abs(bias), k + 1)   # >= |exact|
    error = error + (acc + U64) * (total + error) + ROUNDINGS["float32"].eta  # the bias add
    return value, _finish(error, None, value, out_round)

  x, x_error = linear(hs, 0.0, w1, b1)
  a = gelu64(x)
  a_error = ((per_x + GELU_FLOAT64_ERROR_PER_X) * (np.abs(x) + x_error)
             + GELU_GRAD_MAX * x_error)
  a_error = _finish(a_error, None, a, out_round)
  out, out_error = linear(a, a_error, w2, b2)
  shape = lambda t: t.reshape(*lead, t.shape[-1])
  return (shape(x), shape(a), shape(out)), (shape(x_error), shape(a_error), shape(out_error))


def gradient_oracle_and_bounds(cotangent, hidden_state, params, precision=None, *,
                               platform=None, devices=(1, 1, 1, 1, 1)):
  """Oracle and bounds for the gradient of sum(vision_mlp(hidden_state, *params) * cotangent)
  with respect to (hidden_state, *params): the backward on the forward's activations, whose
  own errors (`forward_oracle_and_bounds`) enter through gelu' and gelu_output."""
  (x, a, _), (x_error, a_error, _) = forward_oracle_and_bounds(hidden_state, *params,
                                                               precision, platform=platform)
  inputs = (cotangent, hidden_state, *params, x, a)
  return backward_oracle_and_bounds(inputs, precision, platform=platform,
                                    dtype=hidden_state.dtype, residual_errors=(x_error, a_error),
                                    devices=devices)


# --- the chex check ---------------------------------------------------------------------------------

def bound_ratios(outs, oracle, bounds):
  """|out - oracle| / bound per element (0 where both are 0), float64, one array per output."""
  ratios = []
  for out, ref, bound in zip(outs, oracle, bounds):
    out = f64(out)
    ref = np.asarray(ref, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
      diff = np.abs(out - ref)
      ratio = np.where(bound > 0, diff / np.where(bound > 0, bound, 1.0),
                       np.where(diff == 0, 0.0, np.inf))
    ratios.append(np.where(np.isnan(ratio), np.inf, ratio))
  return ratios


def assert_within_bounds(outs, oracle, bounds, dtypes, label="", names=OUT_NAMES):
  """chex: the outputs' structure, shapes, dtypes and finiteness, then |out - oracle| <= bound
  elementwise; the message names the output and its worst element."""
  outs, oracle, bounds = tuple(outs), tuple(oracle), tuple(bounds)
  dtypes = (dtypes,) * len(outs) if not isinstance(dtypes, (tuple, list)) else tuple(dtypes)
  chex.assert_trees_all_equal_structs(outs, tuple(np.zeros(()) for _ in oracle))
  chex.assert_shape(outs, [np.shape(r) for r in oracle])
  chex.assert_type(outs, dtypes)
  if all(np.all(np.isfinite(r)) for r in oracle):
    chex.assert_tree_all_finite(
        outs, custom_message=f"{label}: a non-finite output where the oracle is finite "
                             "(an unwritten, NaN-poisoned element or an overflow)")
  ratios = bound_ratios(outs, oracle, bounds)
  worst = []
  for name, ratio, out, ref, bound in zip(names, ratios, outs, oracle, bounds):
    if not ratio.size:
      continue
    j = tuple(int(t) for t in np.unravel_index(int(np.argmax(ratio)), ratio.shape))
    if ratio[j] > 1:
      worst.append(f"{name}{list(j)}: {float(f64(out)[j]):.9g} vs oracle {float(ref[j]):.9g}, "
                   f"bound {float(bound[j]):.3g} ({float(ratio[j]):.3g} x)")
  chex.assert_trees_all_close(dict(zip(names, ratios)),
                              {n: np.zeros(np.shape(r)) for n, r in zip(names, ratios)},
                              atol=1.0, rtol=0.0,
                              custom_message=f"{label}: outside the bound: " + "; ".join(worst))
  return ratios


def relative_frobenius_error(out, ref):
  """||out - ref||_F / ||ref||_F in float64."""
  out, ref = f64(out), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-300))


def assert_relative_frobenius(outs, oracle, tolerance, label="", names=OUT_NAMES):
  """Every output within `tolerance` relative Frobenius error of the oracle (chex: shapes)."""
  chex.assert_shape(tuple(outs), [np.shape(r) for r in oracle])
  errors = {name: relative_frobenius_error(out, ref)
            for name, out, ref in zip(names, outs, oracle)}
  bad = {name: f"{e:.2e}" for name, e in errors.items() if not e <= tolerance}
  assert not bad, f"{label}: relative Frobenius error above {tolerance:.2e}: {bad}"
  return errors


def check_backward(outs, inputs, precision=None, label="", *, relative=True, **kwargs):
  """`mlp_backward(*inputs, precision=precision)`'s outputs (`outs`) against the oracle: the
  bounds (`assert_within_bounds`, dtypes those of inputs[1:6]) and, with `relative`, the
  relative Frobenius tolerance where there is one. Returns (oracle, bounds)."""
  oracle, bounds = backward_oracle_and_bounds(inputs, precision, **kwargs)
  assert_within_bounds(outs, oracle, bounds, [x.dtype for x in inputs[1:6]], label)
  tolerance = relative_frobenius_tolerance(precision, inputs[1].dtype, kwargs.get("platform"))
  if relative and tolerance is not None:
    assert_relative_frobenius(outs, oracle, tolerance, label)
  return oracle, bounds
