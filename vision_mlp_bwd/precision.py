"""One mapping from the user's `precision` argument to how every dot is computed.

Users pass what `jnp.matmul` takes (`None`, a `jax.lax.Precision`, or a
`jax.lax.DotAlgorithmPreset`). We canonicalise it to a `DotMode`, which both
the XLA reference (`jnp_precision`) and the kernels (`dot`) understand, so the
two paths always agree on what a precision means.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
from jax import lax


class DotMode(enum.Enum):
  """How a float32 matrix product is computed."""

  TF32 = "tf32"            # tensor cores on TF32 operands (XLA's GPU default)
  HIGHEST = "highest"      # fp32-class: relative error <= 1e-5 (kernels: bf16x3, XLA: fp32)
  F32 = "f32"              # true fp32 products (slow on tensor-core GPUs)
  BF16X3 = "bf16x3"        # fp32 split into bf16 hi+lo, three bf16 products
  F16 = "f16"              # operands cast to float16, fp32 accumulation
  BF16 = "bf16"            # operands cast to bfloat16, fp32 accumulation

  @property
  def operand_dtype(self):
    """The 16-bit dtype operands are cast to, or None for 32-bit modes."""
    return {DotMode.F16: jnp.float16, DotMode.BF16: jnp.bfloat16}.get(self)


# The modes the kernels compute as bf16x3 (`split_bf16`, three bf16 products).
BF16X3_MODES = (DotMode.HIGHEST, DotMode.BF16X3)

# HIGHEST must be fp32-class: relative Frobenius error <= 1e-5 on every output.
# The kernels meet that with bf16x3 (6.4e-6 worst over the 16 seed cases on the
# H200), about 2x faster in Triton than tf32x3. XLA's own bf16x3 preset does not
# (2.5e-5 at S=4096: benchmarks/results/runs/2026-11-29/h200_20261129-153212.md),
# so the XLA path computes HIGHEST in true fp32.
_PRECISION_TO_MODE = {
    lax.Precision.DEFAULT: DotMode.TF32,
    lax.Precision.HIGH: DotMode.BF16X3,
    lax.Precision.HIGHEST: DotMode.HIGHEST,
}

_PRESET_TO_MODE = {
    lax.DotAlgorithmPreset.DEFAULT: DotMode.TF32,
    lax.DotAlgorithmPreset.TF32_TF32_F32: DotMode.TF32,
    lax.DotAlgorithmPreset.F32_F32_F32: DotMode.F32,
    lax.DotAlgorithmPreset.BF16_BF16_F32_X3: DotMode.BF16X3,
    lax.DotAlgorithmPreset.F16_F16_F32: DotMode.F16,
    lax.DotAlgorithmPreset.BF16_BF16_F32: DotMode.BF16,
}

_STRING_TO_PRECISION = {
    "default": lax.Precision.DEFAULT,
    "high": lax.Precision.HIGH,
    "highest": lax.Precision.HIGHEST,
}

SUPPORTED = (
    "None, 'default', 'high', 'highest', jax.lax.Precision.{DEFAULT,HIGH,HIGHEST}, "
    "jax.lax.DotAlgorithmPreset.{"
    + ",".join(p.name for p in _PRESET_TO_MODE)
    + "}"
)


def canonicalize(precision) -> DotMode:
  """Maps a `jnp.matmul`-style precision to a DotMode, or raises ValueError."""
  if precision is None:
    return DotMode.TF32
  if isinstance(precision, DotMode):
    return precision
  if isinstance(precision, str):
    key = precision.lower()
    if key not in _STRING_TO_PRECISION:
      raise ValueError(f"precision={precision!r} is not supported; expected one of {SUPPORTED}.")
    precision = _STRING_TO_PRECISION[key]
  if isinstance(precision, tuple) and len(precision) == 2 and precision[0] == precision[1]:
    precision = precision[0]
  if isinstance(precision, lax.Precision):
    return _PRECISION_TO_MODE[precision]
  if isinstance(precision, lax.DotAlgorithmPreset) and precision in _PRESET_TO_MODE:
    return _PRESET_TO_MODE[precision]
  raise ValueError(f"precision={precision!r} is not supported; expected one of {SUPPORTED}.")


_SIXTEEN_BIT_MODE = {jnp.dtype(jnp.float16): DotMode.F16, jnp.dtype(jnp.bfloat16): DotMode.BF16}


def for_inputs(mode: DotMode, dtype) -> DotMode:
  """The mode that runs on inputs of `dtype`: what `jnp.matmul` does with `precision`.

  On 16-bit inputs every 32-bit mode (TF32, HIGHEST, F32, BF16X3) multiplies
  the 16-bit values as they are, with fp32 accumulation, as `jnp.matmul` does
  (their products are exact in fp32, so these modes agree), and the pre-GELU
  gradient is rounded to the input dtype before the products that read it, as
  in jnp's autodiff: the input dtype's own 16-bit mode. The 16-bit presets keep
  their operand dtype (bf16 inputs under F16_F16_F32 are cast to f16), and
  fp32 inputs keep every mode.
  """
  dtype = jnp.dtype(dtype)
  if dtype in _SIXTEEN_BIT_MODE and mode.operand_dtype is None:
    return _SIXTEEN_BIT_MODE[dtype]
  return mode


def jnp_precision(mode: DotMode):
  """The `precision=` argument that makes XLA compute a dot the way `mode` says."""
  return {
      DotMode.TF32: lax.Precision.DEFAULT,
      DotMode.HIGHEST: lax.Precision.HIGHEST,
      DotMode.F32: lax.Precision.HIGHEST,
      DotMode.BF16X3: lax.DotAlgorithmPreset.BF16_BF16_F32_X3,
      DotMode.F16: lax.DotAlgorithmPreset.F16_F16_F32,
      DotMode.BF16: lax.DotAlgorithmPreset.BF16_BF16_F32,
  }[mode]


def xla_dot_general(a, b, dimension_numbers, mode: DotMode, out_dtype=jnp.float32):
  """`lax.dot_general` accumulated in fp32, computed as `mode` says, for XLA code.

  16-bit modes cast the operands explicitly (every backend accepts that);
  the bf16x3 preset is used on GPU and true fp32 elsewhere, which is at least
  as accurate. A 16-bit `out_dtype` with 16-bit operands is the product
  `jnp.matmul` returns for them: accumulated in fp32 and rounded once as the
  product writes it, so no fp32 copy of the result passes through memory.
  """
  sixteen_bit = _sixteen_bit_operands(a, b, mode)
  if sixteen_bit is not None:
    (a, b), precision = sixteen_bit, None
  elif mode == DotMode.BF16X3 and jax.default_backend() != "gpu":
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    precision = lax.Precision.HIGHEST  # the preset is GPU-only; fp32 is more accurate
  else:
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    precision = jnp_precision(mode)
  out_dtype = jnp.dtype(out_dtype)
  direct = out_dtype.itemsize == 2 and a.dtype == b.dtype == out_dtype
  product = lax.dot_general(a, b, dimension_numbers, precision=precision,
                            preferred_element_type=out_dtype if direct else jnp.float32)
  return product.astype(out_dtype)


def _sixteen_bit_operands(a, b, mode: DotMode):
  """The operands of a 16-bit product, or None when `mode` multiplies in 32 bits.

  16-bit modes cast; 16-bit inputs stay as they are in any mode, since their
  products are exact in fp32 and every 32-bit mode agrees on them.
  """
  if mode.operand_dtype is not None:
    return a.astype(mode.operand_dtype), b.astype(mode.operand_dtype)
  if a.dtype == b.dtype and a.dtype in (jnp.bfloat16, jnp.float16):
    return a, b
  return None


def split_bf16(x):
  """(hi, lo) = (bf16(x), bf16(x - hi)) of fp32 `x`, bf16x3's pieces: a b is then
  a_lo b_hi + a_hi b_lo + a_hi b_hi within 3 2^-16 |a b| (the dropped a_lo b_lo and the
  pieces' rounding)."""
  hi = x.astype(jnp.bfloat16)
  lo = (x - hi.astype(jnp.float32)).astype(jnp.bfloat16)
  return hi, lo


def round_to_tf32(x, ties_to_even: bool = False):
  """fp32 -> the nearest TF32 value (ties away from zero), kept in fp32; NaN stays NaN.

  This is `cvt.rna.tf32.f32`, the rounding Triton applies to fp32 operands of
  TF32 products, so rounding first leaves such a product unchanged; see
  `kernel_dot`'s `lhs_in_registers` for why a kernel would round itself.
  `ties_to_even`: ties to the even neighbour instead, as the f16 engine's scaled
  operands round (`scaled_f16_operand`).
  """
  bits = lax.bitcast_convert_type(x, jnp.uint32)
  half = (jnp.uint32(0xFFF) + ((bits >> 13) & jnp.uint32(1))) if ties_to_even else (
      jnp.uint32(0x1000))
  rounded = lax.bitcast_convert_type((bits + half) & jnp.uint32(0xFFFFE000), jnp.float32)
  return jnp.where(x != x, x, rounded)


# f16 and TF32 both keep 11 significant bits; they differ only in exponent
# range. Scaled by a power of two that brings a row's largest magnitude to
# [2^14, 2^15), every element within 2^29 of it converts to f16 as exactly its
# TF32 rounding times the scale, and the smaller ones are off by at most 2^-25
# in scaled units (2^-40 of the largest). A product of such operands, unscaled
# afterwards, is a TF32 product on f16 tensor cores (twice the rate, free
# transposes). `scaled_f16_operand` applies it; `f16_scale` picks the scale.
F16_SCALE_TOP_EXPONENT = 14


def finite_abs(x):
  """|x| in fp32, with NaN and +-Inf as 0: what f16 scales are taken from."""
  magnitude = jnp.abs(x.astype(jnp.float32))
  return jnp.where(magnitude < jnp.inf, magnitude, 0.0)


def f16_scale(max_abs):
  """The power of two `s` with `max_abs * s` in [2^14, 2^15) (within fp32's normal range).

  `max_abs` >= 0; an all-zero row gets 2^126, harmlessly, and a NaN or Inf
  maximum 2^-114 (its exponent bits are those of 2^128).
  """
  return _power_of_two(_f16_scale_exponent(max_abs))


def f16_unscale(max_abs):
  """`1 / f16_scale(max_abs)`, exactly (the reciprocal a product's result is multiplied by)."""
  return _power_of_two(-_f16_scale_exponent(max_abs))


def _f16_scale_exponent(max_abs):
  bits = lax.bitcast_convert_type(max_abs.astype(jnp.float32), jnp.int32) & 0x7FFFFFFF
  exponent = (bits >> 23) - 127          # max_abs in [2^exponent, 2^(exponent + 1))
  return jnp.clip(F16_SCALE_TOP_EXPONENT - exponent, -126, 126)


def _power_of_two(exponent):
  """2^exponent in fp32, for exponents in [-126, 127]."""
  return lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32)


# A line's scale can be guessed instead of measured: 2^10 brings maxima from
# 2^-10 to 2^5 (where trained weights and N(0, 1) activations live) to
# [1, 2^15). There, elements within 2^14 of the maximum convert exactly and
# the others are off by at most 2^-25 of it, 2^-14 of TF32's own rounding
# error on the maximum. A kernel that finds a line outside redoes it with
# `f16_scale`. An input whose first rows and columns (`SPECULATION_SAMPLE`) lie
# outside, a loss gradient of magnitude 2^-20 say, has its guess follow them:
# `speculated_scale`.
SPECULATED_SCALE = 2.0 ** 10
SPECULATION_SAMPLE = (8, 128)
_SAMPLE_TOP_EXPONENT = 12


def fits_speculated(max_abs, speculated=SPECULATED_SCALE):
  """Whether lines with these finite maxima may take the `speculated` scale (0 fits too)."""
  scaled = max_abs * speculated
  return (max_abs == 0.0) | ((scaled >= 1.0) & (scaled < 2.0 ** 15))


def speculated_scale(sample_max):
  """The speculated scale of an input whose sample (`SPECULATION_SAMPLE`) has this largest
  finite |x|: `SPECULATED_SCALE` where the sample fits it, else the power of two that
  brings the sample's largest to [2^12, 2^13), so that lines from 2^-12 to 2^3 of it fit."""
  exponent = _f16_scale_exponent(sample_max) - F16_SCALE_TOP_EXPONENT + _SAMPLE_TOP_EXPONENT
  return jnp.where(fits_speculated(sample_max), SPECULATED_SCALE,
                   _power_of_two(jnp.clip(exponent, -126, 126)))


def sample_speculated_scale(x):
  """`speculated_scale` of a 2-D array's sample, its first rows and columns."""
  rows, cols = SPECULATION_SAMPLE
  return speculated_scale(jnp.max(finite_abs(x[:rows, :cols]), initial=0.0))


def checked_scales(max_abs, speculated=SPECULATED_SCALE):
  """(scales, their reciprocals, which lines fit) for lines with these finite maxima:
  the `speculated` scale where `fits_speculated`, `f16_scale` elsewhere."""
  fits = fits_speculated(max_abs, speculated)
  return (jnp.where(fits, speculated, f16_scale(max_abs)),
          jnp.where(fits, 1.0 / speculated, f16_unscale(max_abs)), fits)


def scaled_f16_operand(x, scale):
  """`f16(x * scale)` (`scale` broadcast against `x`); 16-bit `x` is taken as already scaled."""
  if x.dtype == jnp.float16:
    return x
  return (x.astype(jnp.float32) * scale).astype(jnp.float16)


def kernel_dot(a, b, mode: DotMode, *, contract_a: int = 1, contract_b: int = 0,
               lhs_in_registers: bool = False, round_both: bool = False):
  """A tile product inside a Pallas kernel, computed as `mode` says.

  `a` and `b` are 2-D tiles; the product contracts `a`'s axis `contract_a` with
  `b`'s axis `contract_b` and returns fp32. This is the only place where a
  kernel decides how to multiply, so every kernel honours `precision` alike.
  `lhs_in_registers` (TF32 only): round `a` to TF32 in the kernel. The
  product does not change, but an operation between load and dot makes
  Triton feed `a` to wgmma from registers, and then `a` need not be
  K-contiguous in memory to be copied with 16-byte loads (fp32 wgmma operands
  in shared memory must be K-major). Truncating instead raised the weight
  gradients' error from 4.2e-4 to 5.5e-4 on the H200 (benchmarks/NOTES.md, 13).
  `round_both` (TF32 only): round both operands in the kernel, ties to even (as the f16
  engine's scaled operands are), the same product on the GPU and in Pallas's
  interpret mode (whose fp32 dot does not round).
  """
  dims = (((contract_a,), (contract_b,)), ((), ()))

  def dot(x, y, precision=None):
    return lax.dot_general(x, y, dims, precision=precision, preferred_element_type=jnp.float32)

  sixteen_bit = _sixteen_bit_operands(a, b, mode)
  if sixteen_bit is not None:
    return dot(*sixteen_bit)
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if mode in BF16X3_MODES:
    a_hi, a_lo = split_bf16(a)
    b_hi, b_lo = split_bf16(b)
    return dot(a_lo, b_hi) + dot(a_hi, b_lo) + dot(a_hi, b_hi)
  if mode == DotMode.F32:
    return dot(a, b, lax.Precision.HIGHEST)
  if round_both:
    return dot(round_to_tf32(a, ties_to_even=True), round_to_tf32(b, ties_to_even=True),
               lax.Precision.DEFAULT)
  return dot(round_to_tf32(a) if lhs_in_registers else a, b, lax.Precision.DEFAULT)
