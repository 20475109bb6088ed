"""The Hopper GEMM engine: one persistent, warp-specialized Pallas Mosaic-GPU matmul.

`matmul(a, b)` computes `C = op(A) @ B` with 16-bit operands and fp32
accumulation, where `op(A)` is `A` (`[M, K]`) or, with `transpose_a`, `A.T`
(`A` stored `[K, M]`, as the weight gradients' `grad_output` and pre-GELU
gradient are), and `B` is `[K, N]`. Every product of the backward has this
form in the layouts its operands arrive in; a 16-bit tile transposes for free
in wgmma, so nothing is copied.

How it runs (the design of jax's `hopper_matmul_mgpu` example):
- one program per SM (a persistent grid) walks the output's blocks in a
  planar snake order, so blocks that run together share operand tiles in L2;
- in each program a memory warpgroup streams `A` and `B` tiles by TMA into a
  ring of `stages` shared-memory buffers, and two compute warpgroups each
  accumulate one `tile_m x tile_n` half of the block with wgmma (registers
  are moved from the memory warpgroup to them);
- the epilogue writes each half through shared memory by TMA, in
  `epilogue_tile` pieces, double-buffered, so the next block's loads start
  while the stores drain; with `chained`, a program's block pipelines form
  one chain, so the memory warpgroup never waits for a block to finish.

Ping-pong (`GemmConfig.ping_pong`): each block is instead one compute warpgroup's
whole tile, the blocks alternate between the two warpgroups, and one ring feeds
them in block order, so one warpgroup's epilogue runs while the other's MMAs do
(CUTLASS's ping-pong kernels; `_ping_pong_program`). Its epilogue does what the
cooperative one does (scales, the fused epilogue, column sums, line maxima, speculated
copies) in pieces, on whole blocks of `op(A) = A`. It needs several blocks per program
to pay: the fused pre-GELU product on fp32 inputs takes it above S=3072 (benchmarks/
NOTES.md, 63; DEFAULT's, NOTES 71).

The last wave: a persistent grid of P programs over T output blocks leaves
T mod P blocks for a last, partly idle wave (the weight gradients at
H=1280, I=3584 have 140 blocks of 128x256 on 132 SMs: 8 blocks, a second
wave at 6% occupancy). With `tail_splits`, those r = T mod P blocks are
instead split along K into up to P // r parts, so every program has work
until the end. Each part writes its fp32 partial block to a workspace; one
more launch (`write_tails`, a `staging.TailSum` job per product) sums them
in a fixed order (no atomics: the result is bitwise deterministic) and
writes the output's last r blocks in place.

A fused epilogue (`epilogue=fn`) stores `fn(acc, X tile)` instead of the
accumulator, `X` an `[M, N]` array read by TMA while the block's MMAs run
(the backward's `(grad_output @ fc2_weight) * gelu'(fc1_output)`). `fn` needs
the whole sum, so a fused product runs whole blocks only (`tail_splits=1`:
its split last wave, finished by one more launch, lost on the H200 where it
was measured; benchmarks/NOTES.md, 48-50). It can also return
the column sums of what it computes (a bias gradient, as CUTLASS's
`LinCombDeEltActDePerRowBias` does): each warpgroup tile's sums go to one row
of a workspace, whose rows XLA adds in a fixed order. With `line_maxima` it
also returns the largest |value| of every column and every row (the power-of-
two scales of the TF32 products after it), from per-tile maxima in two more
workspaces (maxima are exact in any order). Pallas's Mosaic GPU
lowering gives every reduction across warps one shared-memory scratch
buffer, which both compute warpgroups wrote at once (wrong sums on the H200;
benchmarks/NOTES.md, 35), so the two warpgroups take turns, ordered by a
pair of barriers: warpgroup 0 reduces first while warpgroup 1 stores its tile, then
warpgroup 1 reduces.

With `speculated_copies`, the fused epilogue also stores f16 copies of its fp32 values
scaled by a speculated power of two per column (`copy_scale`, TMA'd beside the
epilogue operand), through `epilogue_buffers` shared-memory pieces per warpgroup: the
TF32 products' operands, which a checked `staging.Cast` rewrites only where a line does
not fit that scale. With `out_dtype=None` the fp32 values themselves are not stored
(that check recomputes the few tiles it rewrites).

With `row_scale` and `col_scale` (fp32 vectors, [M] and [N], TMA'd beside the
epilogue operand), the accumulator (a K-part's, in the last wave) is
multiplied by them before the epilogue: that is how the TF32 products on the
f16 engine unscale their power-of-two scaled operands, without a pass over
the output.

Side copies: with `config.copy_programs` = c > 0, the product's blocks go to the first
P - c programs and the last c copy fp32 arrays (`side_copies`) to the operand dtype, a
memory-bound pass beside a compute-bound one in one launch (two launches on one stream
never overlap). The backward gives them the casts that only the products after the fused
one read: their SMs would otherwise idle in a last partial wave, or cost the product
fewer than the pass saves (benchmarks/NOTES.md, 55). With `config.copy_warpgroup` (ping-pong
only) a fourth warpgroup of every program makes them instead, beside its compute
warpgroups, so no SM is taken from the product (NOTES 70).

Reads past the arrays' ends are zeros and writes there are dropped (TMA), so
M, N and K need not be multiples of a tile; each 16-bit array needs a row
count that is a multiple of 8 and a row length that is a multiple of 64
(TMA's tiled, 128-byte swizzled layouts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from vision_mlp_bwd.backends import staging
from vision_mlp_bwd.backends.mosaic.tiles import SWIZZLE, swizzled_tiles, tma_tile_rows
from vision_mlp_bwd.backends.shared import sum_in_order
from vision_mlp_bwd.precision import finite_abs, scaled_f16_operand


@dataclasses.dataclass(frozen=True)
class GemmConfig:
  """Tiles and scheduling of one product."""

  tile_m: int = 128         # rows of one compute warpgroup's accumulator
  tile_n: int = 128         # columns of it
  tile_k: int = 64          # contraction step
  stages: int = 4           # shared-memory ring depth of the TMA pipeline
  split: str = "n"          # the block is two warpgroup tiles side by side along "m" or "n"
  grid_minor: str = "n"     # planar snake: the dimension that varies fastest ...
  grid_tile_width: int = 8  # ... within bands this many blocks wide
  epilogue_tile: tuple[int, int] = (64, 64)
  # wgmma groups left in flight when a step's body returns (0 or 1): with 1, a
  # stage's buffers are released one step later, and the next step's MMAs are
  # issued before the last ones finish.
  mma_in_flight: int = 0
  # At most this many K-parts for each block of the last wave (1: no split);
  # each part keeps at least `stages` contraction steps.
  tail_splits: int = 1
  epilogue_buffers: int = 2   # epilogue pieces in flight per warpgroup (1 or 2)
  # Chain a program's block pipelines (Pallas's `pipeline_state`): the memory warpgroup
  # loads the next block's first stages while this block's last MMAs and epilogue run.
  # Each block's steps are rounded up to whole rings (reading zeros past K), and no
  # wgmma group stays in flight (mma_in_flight=0).
  chained: bool = False
  # Programs that make `matmul`'s side copies instead of computing blocks (the blocks go to
  # the SM count less these): a memory-bound pass run beside the product in its launch.
  copy_programs: int = 0
  # Ping-pong compute warpgroups (`_ping_pong_program`): each block is one warpgroup's
  # whole `tile_m x tile_n` tile, the blocks alternate between the two, and one ring
  # feeds them in block order, so one's epilogue runs under the other's MMAs. Its
  # epilogue goes by `epilogue_tile` pieces, `epilogue_buffers` of the fused operand's,
  # the output's and the speculated copies' in flight per warpgroup; its loop keeps one
  # wgmma group in flight (`split`, `mma_in_flight` and `chained` do not apply).
  ping_pong: bool = False
  # Side copies made by a fourth warpgroup of every ping-pong program, beside its
  # compute and memory warpgroups, instead of by copy programs of their own: every SM
  # computes blocks, and the copies' HBM traffic is spread over all of them.
  copy_warpgroup: bool = False

  @property
  def copies_beside(self) -> bool:
    """Whether the launch makes `matmul`'s side copies (copy programs or warpgroup)."""
    return self.copy_programs > 0 or self.copy_warpgroup

  @property
  def block(self) -> tuple[int, int]:
    """(rows, columns) of the output block one program computes at a time."""
    if self.ping_pong:
      return self.tile_m, self.tile_n
    return (self.tile_m * (2 if self.split == "m" else 1),
            self.tile_n * (2 if self.split == "n" else 1))

  def __post_init__(self):
    if self.split not in ("m", "n") or self.grid_minor not in ("m", "n"):
      raise ValueError(f"GemmConfig.split and grid_minor take 'm' or 'n': {self}")
    if self.tail_splits < 1 or self.epilogue_buffers not in (1, 2):
      raise ValueError(f"GemmConfig.tail_splits must be >= 1 and epilogue_buffers 1 or 2: "
                       f"{self}")
    if self.copy_programs < 0:
      raise ValueError(f"GemmConfig.copy_programs must be >= 0: {self}")
    if self.copy_warpgroup and (not self.ping_pong or self.copy_programs):
      raise ValueError(f"GemmConfig.copy_warpgroup is a ping-pong program's fourth "
                       f"warpgroup, in place of copy programs: ping_pong=True, "
                       f"copy_programs=0: {self}")
    if self.chained and self.mma_in_flight:
      raise ValueError(f"GemmConfig.chained takes mma_in_flight=0 (Pallas chains pipelines "
                       f"only without delayed releases): {self}")
    if self.ping_pong and (self.chained or self.tail_splits > 1 or self.tile_k != 64
                           or self.stages < 2):
      # (a compute warpgroup frees its ring slot one step late: one slot would deadlock)
      raise ValueError(f"GemmConfig.ping_pong runs whole blocks through one ring of 64-deep "
                       f"steps: chained=False, tail_splits=1, tile_k=64, stages >= 2: {self}")
    epi_m, epi_n = self.epilogue_tile
    if self.ping_pong and (epi_m % 64 or self.tile_m % epi_m or self.tile_n % epi_n):
      raise ValueError(f"GemmConfig.ping_pong cuts its tile into epilogue_tile pieces of whole "
                       f"64-row groups (wgmma's accumulator layout) that divide it: {self}")


SHARED_MEMORY_BYTES = 227 * 1024   # an sm_90 block's opt-in maximum
BARRIER_SLACK_BYTES = 1024         # the pipeline's mbarriers and alignment
REDUCTION_SCRATCH_BYTES = 128 * 4 * 4   # Pallas's scratch for a reduction across warps
SMEM_ALIGNMENT_BYTES = 1024        # where Pallas starts each shared-memory buffer
# Registers per thread (65536 per SM): the memory warpgroup's, and a ping-pong program's
# compute warpgroups' (the cooperative pipeline gives its compute warpgroups the rest)
MEMORY_REGISTERS, PING_PONG_COMPUTE_REGISTERS = 40, 232
COLUMN_SUMS = (None, "stored", "unrounded")
# Side copies: fp32 tiles of COPY_TILE, COPY_LOADS of them in flight per warpgroup, rounded
# in registers into COPY_STORES 16-bit buffers stored by TMA (no swizzle: a row-major
# tile's loads and stores are contiguous across a warpgroup's threads; a deeper ring of
# smaller tiles was no faster on the H200, benchmarks/NOTES.md, 55b).
COPY_TILE = (32, 128)
COPY_LOADS, COPY_STORES = 3, 2
COPY_COLUMN_MULTIPLE = 8   # TMA: rows of the 16-bit copy in whole 16-byte units
# A ping-pong program's copy warpgroup (`GemmConfig.copy_warpgroup`): fp32 tiles of
# COPIER_TILE in flight, as many as fit beside the product's buffers from COPIER_LOADS down
# to MIN_COPIER_LOADS (10 beside a 4-stage ring of 128x128 blocks with one 64x64 epilogue
# piece, 40 KB: about 2.5x the copy rate the fused product needs at 2 us a round trip; 6,
# 1.4-1.8x; benchmarks/NOTES.md, 70), and COPY_STORES 16-bit ones; registers 40
# (memory) + 40 (copies) + 2 x 216 (compute) = 512.
COPIER_TILE = (8, 128)
COPIER_LOADS, MIN_COPIER_LOADS = 10, 6
COPIER_REGISTERS, COPIER_COMPUTE_REGISTERS = 40, 216


# Pallas's per-warpgroup timeline of named regions, for the kernels traced within `traced`:
# profile_space and profile_dir of plgpu.CompilerParams, or none.
_TRACE: dict = {}


@contextlib.contextmanager
def traced(directory: str, events: int = 64):
  """Kernels traced (jitted) within write, on every call, Pallas's timeline of their
  named regions per warpgroup (each block's "mainloop" and "epilogue") into `directory`
  as a Chrome trace: what overlaps what on each SM. At most `events` regions per
  warpgroup; for profiling runs only (it reads the clock around every region)."""
  previous = dict(_TRACE)
  _TRACE.update(profile_space=events, profile_dir=directory)
  try:
    yield
  finally:
    _TRACE.clear()
    _TRACE.update(previous)


def shared_memory_bytes(config: GemmConfig, k_steps: int, dtype, out_dtype,
                        split_tail: bool, epilogue_dtype=None, column_sums=False,
                        scales=False, line_maxima=False, speculated_copies=False,
                        copier_loads: int = COPIER_LOADS, scaled_side_copies=False) -> int:
  """Shared memory one program allocates: the operand ring plus the epilogue buffers, each
  buffer aligned to SMEM_ALIGNMENT_BYTES as Pallas places them.

  JAX 0.10.2's Mosaic lowering refuses a kernel over the limit, but with JAX
  0.11.2 on the H200 such a kernel was launched and faulted
  (benchmarks/engine_shapes.py), so `matmul` checks this first.
  """
  block_m, block_n = config.block
  epi_m, epi_n = config.epilogue_tile
  stages = min(config.stages, k_steps) * config.tile_k * jnp.dtype(dtype).itemsize
  buffers = [stages * block_m, stages * block_n]   # the A and B rings
  slots = min(config.epilogue_buffers, (config.tile_m // epi_m) * (config.tile_n // epi_n))
  if out_dtype is not None:
    buffers.append(2 * slots * epi_m * epi_n * jnp.dtype(out_dtype).itemsize)
  if split_tail and _partials_need_own_buffer(out_dtype):   # one per warpgroup
    buffers.append(2 * epi_m * max(epi_n, 32) * 4)
  if epilogue_dtype is not None:      # the fused epilogue's operand tiles, or pieces
    buffers.append(2 * (slots * epi_m * epi_n if config.ping_pong else
                        config.tile_m * config.tile_n) * jnp.dtype(epilogue_dtype).itemsize)
  if column_sums:                     # one row of sums per warpgroup
    buffers.append(2 * config.tile_n * 4)
  if line_maxima:                     # each warpgroup's column and row maxima
    buffers += [2 * config.tile_n * 4, 2 * config.tile_m * 4]
  if speculated_copies:               # each warpgroup's f16 pieces of them, and their scales
    buffers += [2 * slots * epi_m * epi_n * 2, 2 * config.tile_n * 4]
  if scales:                          # each warpgroup's row and column scales
    buffers += [2 * config.tile_m * 4, 2 * config.tile_n * 4]
  if column_sums or line_maxima:      # the reductions' scratch (one at a time)
    buffers.append(REDUCTION_SCRATCH_BYTES)
  if config.copy_warpgroup:           # its fp32 tiles and their 16-bit copies
    copier_tile = COPIER_TILE[0] * COPIER_TILE[1]
    buffers += [copier_loads * copier_tile * 4,
                COPY_STORES * copier_tile * jnp.dtype(dtype).itemsize]
    if scaled_side_copies:            # a strip's column maxima
      buffers.append(COPIER_TILE[1] * 4)
  return sum(-(-size // SMEM_ALIGNMENT_BYTES) * SMEM_ALIGNMENT_BYTES for size in buffers)


def copy_shared_memory_bytes(dtype) -> int:
  """Shared memory of a copy program's buffers (`_copy_tiles`)."""
  rows, cols = COPY_TILE
  buffers = [3 * rows * cols * COPY_LOADS * 4, 3 * rows * cols * COPY_STORES *
             jnp.dtype(dtype).itemsize, 3 * cols * 4]   # loads, stores, maxima rows
  return sum(-(-size // SMEM_ALIGNMENT_BYTES) * SMEM_ALIGNMENT_BYTES for size in buffers)


@dataclasses.dataclass(frozen=True)
class Schedule:
  """How a persistent grid of `programs` covers `grid_mn` blocks.

  The first `whole` blocks in row-major order are computed whole; each of the
  remaining blocks is computed in `splits` parts of `steps_per_split`
  contraction steps (the last part may read past K, which reads zeros). A chained
  schedule's blocks take `whole_steps` (`k_steps` rounded up to whole rings of `ring`
  stages) and its parts a multiple of `ring`.
  """

  grid_mn: tuple[int, int]
  programs: int
  k_steps: int
  whole: int
  splits: int
  steps_per_split: int
  ring: int = 1
  chained: bool = False

  @property
  def whole_steps(self) -> int:
    return pl.cdiv(self.k_steps, self.ring) * self.ring if self.chained else self.k_steps

  @property
  def tail(self) -> int:
    return self.grid_mn[0] * self.grid_mn[1] - self.whole


def schedule(m: int, n: int, k: int, config: GemmConfig, programs: int) -> Schedule:
  """The blocks, and the split of the last wave's blocks along K (see the module docstring)."""
  block_m, block_n = config.block
  grid_mn = (pl.cdiv(m, block_m), pl.cdiv(n, block_n))
  blocks = grid_mn[0] * grid_mn[1]
  k_steps = pl.cdiv(k, config.tile_k)
  # Every SM gets a program even when there are fewer blocks (the others find no work): a
  # grid smaller than the SM count faulted on the H200 (benchmarks/engine_shapes.py).
  tail = blocks % programs   # all of them when there are fewer blocks than programs
  ring = _ring(config, k_steps)
  splits = min(programs // tail if tail else 1, config.tail_splits,
               k_steps // max(config.stages, 1))
  if tail == 0 or splits < 2:
    return Schedule(grid_mn, programs, k_steps, blocks, 1, k_steps, ring, config.chained)
  steps_per_split = pl.cdiv(k_steps, splits)
  if config.chained:
    steps_per_split = pl.cdiv(steps_per_split, ring) * ring
  splits = pl.cdiv(k_steps, steps_per_split)
  return Schedule(grid_mn, programs, k_steps, blocks - tail, splits, steps_per_split, ring,
                  config.chained)


def _ring(config: GemmConfig, k_steps: int) -> int:
  """Stages of the operand ring. A chained schedule rounds its steps up to whole rings:
  of the depths from `stages` down to half of it, the deepest that pads the fewest
  steps (8 steps take a ring of 4, not 6 and 12 steps; 19 steps 5 and 20)."""
  deepest = min(config.stages, k_steps)
  if not config.chained:
    return deepest
  shallowest = max(1, min(2, deepest), deepest // 2)
  return min(range(deepest, shallowest - 1, -1), key=lambda r: pl.cdiv(k_steps, r) * r)


def _warpgroup_tile_lines(shape, block, warpgroup_tile):
  """(rows, columns) of warpgroup tiles over an `[M, N]` product in `block`s: how many
  partial rows its epilogue's column reductions and its row maxima leave."""
  (m, n), (bm, bn), (tm, tn) = shape, block, warpgroup_tile
  return pl.cdiv(m, bm) * bm // tm, pl.cdiv(n, bn) * bn // tn


def _partials_need_own_buffer(out_dtype) -> bool:
  """Whether a K-part's fp32 partial tile needs a shared-memory buffer of its own: it goes
  through the output's epilogue buffers when they are fp32."""
  return out_dtype is None or jnp.dtype(out_dtype) != jnp.float32


def num_sms() -> int:
  device = jax.devices()[0]
  return int(getattr(device, "core_count", 0) or 132)


def matmul(a, b, *, transpose_a: bool = False, out_dtype=jnp.float32,
           config: GemmConfig = GemmConfig(), num_programs: int | None = None,
           epilogue: Callable | None = None, epilogue_operand=None, column_sums=None,
           line_maxima: bool = False, row_scale=None, col_scale=None,
           approx_math: bool = False, partial_reductions: bool = False,
           defer_tail: bool = False, out_rows: int | None = None, speculated_copies: int = 0,
           copy_scale=None, side_copies=(), interpret=None):
  """`op(a) @ b` in fp32 accumulation, stored as `out_dtype`; see the module docstring.

  With `epilogue`, stores `epilogue(acc, epilogue_operand)` computed in fp32
  (`epilogue_operand` `[M', N]`, M' <= M: rows past it read as zeros, and rows past M
  add `epilogue(0, 0)` to the column sums). `row_scale` [M] and `col_scale` [N] (fp32,
  given together) multiply the accumulator's rows and columns first.
  `column_sums="stored"` (of the values as stored) or `"unrounded"` (of the fp32
  values) also returns the fp32 sums over the rows, `(out, sums [N])`; `line_maxima`
  the largest |value| (fp32, NaN if any is) of each column and row after them,
  `(out, [sums,] column_max [N], row_max [M])`; with `out_dtype=None` (only with
  `speculated_copies`) nothing is stored for `out` and it is left out of the results.
  `approx_math` lets `exp` and division in the kernel (the epilogue's) use the GPU's
  approximate instructions (ex2.approx, div.approx: within 2^-22 relative). With
  `partial_reductions`, the sums and maxima come as their partial rows (`[R, N]`, `[R,
  N]`, `[R', M]`: one per row or column of warpgroup tiles), for a later launch to
  reduce. With `defer_tail`, a product whose last wave is split returns a `SplitProduct`
  for `write_tails` (which finishes several in one launch). With `out_rows` (<= M), the output keeps only its first `out_rows`
  rows (TMA drops the stores past them: an S-row gradient from a product over operands
  padded to whole groups of 8 rows, without a copy). `speculated_copies` (with an
  epilogue, an fp32 output and `copy_scale` [N], fp32) returns that many f16 arrays after
  the output, each `precision.scaled_f16_operand(value, copy_scale)` of the stored fp32
  values (`staging.SpeculatedScale` makes `copy_scale`). `side_copies`, `(x, rows)` pairs
  (x fp32 `[R, C]`), are copied to the operands' dtype with `rows` rows (zeros past R) by
  `config.copy_programs` programs of the same launch while the others compute the product
  (see `_copy_tiles`), or with `config.copy_warpgroup` by a fourth warpgroup of every
  ping-pong program; the result is then `(product's result, copies)`. A triple
  `(x, rows, scale)` (f16 operands; `scale` an fp32 vector, a `staging.SpeculatedScale`,
  whose first element is a power of two) is copied as
  `precision.scaled_f16_operand(x, scale[0])`, and its copy comes as `(copy, partial
  maxima [P, C])`: the largest finite |x| of each column, in P partial rows, which a
  checked `staging.Cast` reduces. `interpret` is
  `plgpu.kernel`'s
  (Pallas's GPU interpret mode runs the kernel on a CPU, unwritten output elements NaN:
  the tests')."""
  if a.dtype != b.dtype or jnp.dtype(a.dtype).itemsize != 2:
    raise TypeError(f"matmul takes two operands of one 16-bit dtype; got a {a.dtype}, "
                    f"b {b.dtype}.")
  (m, k) = a.shape[::-1] if transpose_a else a.shape
  if b.shape[0] != k:
    raise ValueError(f"matmul: op(a) is [{m}, {k}] but b has shape {b.shape}; expected [{k}, N].")
  n = b.shape[1]
  piece_bytes = config.epilogue_tile[1] * jnp.dtype(out_dtype or jnp.float32).itemsize
  if piece_bytes < SWIZZLE:   # (the output's pieces; a copy's swizzle is as wide as its rows)
    raise ValueError(f"GemmConfig.epilogue_tile {config.epilogue_tile} stores rows of "
                     f"{piece_bytes} bytes of {jnp.dtype(out_dtype).name}; the swizzled "
                     f"epilogue needs >= {SWIZZLE}.")
  if (epilogue is None) != (epilogue_operand is None):
    raise ValueError("matmul takes epilogue and epilogue_operand together.")
  if column_sums not in COLUMN_SUMS or (column_sums and epilogue is None):
    raise ValueError(f"matmul: column_sums={column_sums!r}; it takes one of {COLUMN_SUMS}, "
                     "and sums only with an epilogue.")
  if line_maxima and epilogue is None:
    raise ValueError("matmul: line_maxima are an epilogue's; pass epilogue and "
                     "epilogue_operand too.")
  if (row_scale is None) != (col_scale is None):
    raise ValueError("matmul takes row_scale and col_scale together.")
  if row_scale is not None:
    for name, v, size in (("row_scale", row_scale, m), ("col_scale", col_scale, n)):
      if v.shape != (size,) or v.dtype != jnp.float32:
        raise ValueError(f"matmul: {name} has shape {v.shape} and dtype {v.dtype}; expected "
                         f"float32 [{size}].")
  out_name = "None" if out_dtype is None else jnp.dtype(out_dtype).name
  if speculated_copies and (epilogue is None or out_name not in ("float32", "None")):
    raise ValueError(f"matmul: speculated_copies={speculated_copies} are an epilogue's f16 "
                     f"copies of its fp32 values; out_dtype is {out_name}"
                     f"{'' if epilogue is not None else ' and there is no epilogue'}.")
  if out_dtype is None and (not speculated_copies or column_sums == "stored"):
    raise ValueError(f"matmul: out_dtype=None stores no product; it takes speculated_copies, "
                     f"which store its f16 copies instead, and no column sums of stored "
                     f"values (speculated_copies={speculated_copies}, "
                     f"column_sums={column_sums!r}).")
  if (copy_scale is not None) != bool(speculated_copies) or copy_scale is not None and (
      copy_scale.shape != (n,) or copy_scale.dtype != jnp.float32):
    raise ValueError(
        f"matmul: speculated_copies={speculated_copies} with copy_scale "
        f"{None if copy_scale is None else (copy_scale.shape, copy_scale.dtype)}; expected "
        f"a float32 [{n}] copy_scale exactly when speculated_copies > 0.")
  if out_rows is not None and not 0 < out_rows <= m:
    raise ValueError(f"matmul: out_rows={out_rows}; expected 1 <= out_rows <= M = {m}.")
  if epilogue is not None and config.tail_splits > 1:
    raise ValueError(f"matmul: a fused epilogue runs whole blocks only; {config} splits the "
                     "last wave (tail_splits must be 1).")
  if config.ping_pong and (transpose_a or n % config.epilogue_tile[1]):
    raise ValueError(f"matmul: GemmConfig.ping_pong computes op(a) = a (transpose_a="
                     f"{transpose_a}), N = {n} a multiple of the epilogue pieces' "
                     f"{config.epilogue_tile[1]} columns.")
  if epilogue is not None:
    if epilogue_operand.ndim != 2 or epilogue_operand.shape[1] != n or (
        epilogue_operand.shape[0] > m):
      raise ValueError(f"matmul: epilogue_operand has shape {epilogue_operand.shape} and dtype "
                       f"{epilogue_operand.dtype}; expected [M' <= {m}, {n}].")
  side_copies = tuple(side_copies)
  if bool(side_copies) != config.copies_beside:
    raise ValueError(f"matmul: {len(side_copies)} side copies with GemmConfig.copy_programs="
                     f"{config.copy_programs}, copy_warpgroup={config.copy_warpgroup}; side "
                     "copies need copy programs or a copy warpgroup, and those need side "
                     "copies.")
  for i, (x, rows, *scale) in enumerate(side_copies):
    if x.ndim != 2 or x.dtype != jnp.float32 or x.shape[1] % COPY_COLUMN_MULTIPLE or rows < 1:
      raise ValueError(f"matmul: side_copies[{i}] is {x.dtype} {x.shape} to {rows} rows; "
                       f"expected a float32 [R, C] array, C a multiple of "
                       f"{COPY_COLUMN_MULTIPLE}, to rows >= 1.")
    if scale and (len(scale) > 1 or scale[0].ndim != 1 or scale[0].shape[0] < 1
                  or scale[0].dtype != jnp.float32 or a.dtype != jnp.float16):
      raise ValueError(f"matmul: side_copies[{i}] has {len(scale)} more entries "
                       f"{[(v.dtype, v.shape) for v in scale]} with {a.dtype} operands; a "
                       "scaled copy takes one float32 vector [>= 1] and float16 operands.")
  programs = num_programs or num_sms()
  if not 0 <= config.copy_programs < programs:
    raise ValueError(f"matmul: GemmConfig.copy_programs={config.copy_programs} leaves no "
                     f"program of {programs} for the product.")
  plan = schedule(m, n, k, config, programs - config.copy_programs)
  scaled_copies = [i for i, side in enumerate(side_copies) if len(side) == 3]
  smem_with = lambda loads: shared_memory_bytes(
      config, plan.k_steps, a.dtype, out_dtype, plan.splits > 1,
      None if epilogue is None else epilogue_operand.dtype, column_sums is not None,
      row_scale is not None, line_maxima, speculated_copies > 0, loads, bool(scaled_copies))
  copier_loads = COPIER_LOADS if config.copy_warpgroup else 0
  while (copier_loads > MIN_COPIER_LOADS
         and smem_with(copier_loads) > SHARED_MEMORY_BYTES - BARRIER_SLACK_BYTES):
    copier_loads -= 1
  smem = smem_with(copier_loads)
  if config.copy_programs:   # copy programs' buffers: after the product's, in its space
    smem = max(smem, copy_shared_memory_bytes(a.dtype))
  if smem > SHARED_MEMORY_BYTES - BARRIER_SLACK_BYTES:
    raise ValueError(f"GemmConfig {config} needs {smem} bytes of shared memory for "
                     f"[{m}, {k}] @ [{k}, {n}] into {out_name}; an sm_90 "
                     f"block has {SHARED_MEMORY_BYTES} (fewer stages or smaller epilogue "
                     "pieces fit).")
  block_m, block_n = config.block
  scales = () if row_scale is None else (row_scale, col_scale)
  kernel = functools.partial(_kernel, config=config, transpose_a=transpose_a, plan=plan,
                             epilogue=epilogue, column_sums=column_sums, scaled=bool(scales),
                             line_maxima=line_maxima, speculated_copies=speculated_copies,
                             stores_out=out_dtype is not None,
                             side_copies=tuple(len(side) == 3 for side in side_copies),
                             copier_loads=copier_loads,
                             copy_programs=config.copy_programs)
  out_types = [] if out_dtype is None else [jax.ShapeDtypeStruct((out_rows or m, n), out_dtype)]
  out_types += [jax.ShapeDtypeStruct((out_rows or m, n), jnp.float16)] * speculated_copies
  sum_rows, max_rows = _warpgroup_tile_lines((m, n), config.block,
                                             (config.tile_m, config.tile_n))
  # One row of column sums (and maxima) per row of warpgroup tiles, one row of row maxima
  # per column of them; ping-pong's in epilogue pieces, reshaped below.
  epi_m, epi_n = config.epilogue_tile
  column_lines = (sum_rows, n // epi_n, epi_n) if config.ping_pong else (sum_rows, n)
  row_lines = (max_rows, pl.cdiv(m, epi_m), epi_m) if config.ping_pong else (max_rows, m)
  if column_sums:
    out_types.append(jax.ShapeDtypeStruct(column_lines, jnp.float32))
  if line_maxima:
    out_types += [jax.ShapeDtypeStruct(column_lines, jnp.float32),
                  jax.ShapeDtypeStruct(row_lines, jnp.float32)]
  if plan.splits > 1:
    out_types.append(jax.ShapeDtypeStruct(
        (plan.tail * plan.splits, block_m, block_n), jnp.float32))
  out_types += [jax.ShapeDtypeStruct((rows, x.shape[1]), a.dtype) for x, rows, *_ in side_copies]
  out_types += [jax.ShapeDtypeStruct((copy_parts(copy_lanes(config, plan.programs),
                                                 side_copies[i][0]),
                                      side_copies[i][0].shape[1]), jnp.float32)
                for i in scaled_copies]
  outs = plgpu.kernel(
      kernel, out_type=tuple(out_types),
      grid=(programs,), grid_names=("program",),
      num_threads=4 if config.copy_warpgroup else 3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup,
                                           approx_math=approx_math, **_TRACE),
      **({} if interpret is None else dict(interpret=interpret)),
  )(a, b, *(() if epilogue is None else (epilogue_operand,)), *scales,
    *(() if copy_scale is None else   # (ping-pong's by epilogue piece)
      (copy_scale.reshape(n // epi_n, epi_n) if config.ping_pong else copy_scale,)),
    *(x for x, *_ in side_copies), *(side_copies[i][2] for i in scaled_copies))
  if config.ping_pong and (column_sums or line_maxima):   # the lines' pieces as rows
    first = int(out_dtype is not None) + speculated_copies
    lines = [x.reshape(x.shape[0], -1) for x in outs[first:first + bool(column_sums)
                                                     + 2 * line_maxima]]
    if line_maxima:
      lines[-1] = lines[-1][:, :m]
    outs = (*outs[:first], *lines, *outs[first + len(lines):])
  if side_copies:
    first = len(outs) - len(side_copies) - len(scaled_copies)
    copies = list(outs[first:first + len(side_copies)])
    for i, partial_max in zip(scaled_copies, outs[first + len(side_copies):]):
      copies[i] = (copies[i], partial_max)
    outs, copies = outs[:first], tuple(copies)
    return _product_result(outs, plan, config, column_sums, line_maxima, partial_reductions,
                           speculated_copies, out_dtype is not None, defer_tail,
                           interpret), copies
  return _product_result(outs, plan, config, column_sums, line_maxima, partial_reductions,
                         speculated_copies, out_dtype is not None, defer_tail, interpret)


def _product_result(outs, plan: Schedule, config: GemmConfig, column_sums, line_maxima,
                    partial_reductions, speculated_copies, stores_out, defer_tail, interpret):
  """What `matmul` returns from the kernel's product outputs (see its docstring)."""
  if (column_sums or line_maxima) and partial_reductions:
    return tuple(outs)
  if column_sums or line_maxima:
    stored = stores_out + speculated_copies
    reduced = list(outs[stored:])
    sums = (sum_in_order(reduced.pop(0)),) if column_sums else ()
    maxima = tuple(jnp.max(x, axis=0) for x in reduced) if line_maxima else ()
    return (*outs[:stored], *sums, *maxima)
  if speculated_copies:   # (whole blocks only: a fused epilogue has no split tail)
    return tuple(outs)
  if plan.splits == 1:
    return outs[0]
  split = SplitProduct(outs[0], outs[1].reshape(-1, config.block[1]),
                       _tail_job(outs[0], plan, config.block))
  if defer_tail:
    return split
  (out,) = write_tails(split, interpret=bool(interpret))
  return out


@dataclasses.dataclass(frozen=True)
class SplitProduct:
  """A product whose last blocks are still K-parts: `write_tails` finishes it."""

  out: jax.Array        # the product, its last `job.tail` blocks not yet written
  partials: jax.Array   # their fp32 K-parts, [tail * splits * block_m, block_n]
  job: staging.TailSum


def write_tails(*products, also=(), interpret: bool = False):
  """The products whole: every `SplitProduct`'s last blocks summed (first K-part to last,
  bitwise deterministic) and written in place, all in one launch; other products as given.
  `also`: more `(staging job, operands)` pairs for the same launch, whose results follow
  the products'. `interpret` runs the launch in Pallas interpret mode."""
  split = [p for p in products if isinstance(p, SplitProduct)]
  pairs = [(p.job, (p.out, p.partials)) for p in split] + list(also)
  if not pairs:
    return products
  results = staging.launch(pairs, mode=None, interpret=interpret, name="engine_tails")
  written = iter(results[:len(split)])
  return (*(next(written) if isinstance(p, SplitProduct) else p for p in products),
          *results[len(split):])


def _tail_job(out, plan: Schedule, block) -> staging.TailSum:
  return staging.TailSum(out.shape, out.dtype, block, plan.grid_mn[1], plan.whole, plan.tail,
                         plan.splits)


def _kernel(a_gmem, b_gmem, *refs, config: GemmConfig, transpose_a: bool, plan: Schedule,
            epilogue: Callable | None, column_sums: str | None, scaled: bool,
            line_maxima: bool, speculated_copies: int, stores_out: bool,
            side_copies: tuple[bool, ...], copy_programs: int, copier_loads: int):
  refs = list(refs)   # inputs after a and b, then outputs, in `matmul`'s order
  operand_gmem = refs.pop(0) if epilogue is not None else None
  row_scale_gmem, col_scale_gmem = (refs.pop(0), refs.pop(0)) if scaled else (None, None)
  copy_scale_gmem = refs.pop(0) if speculated_copies else None
  scaled_sides = [i for i, is_scaled in enumerate(side_copies) if is_scaled]
  side_sources = [refs.pop(0) for _ in side_copies]
  side_scales = [refs.pop(0) for _ in scaled_sides]
  side_maxima = [refs.pop() for _ in scaled_sides][::-1]
  side_targets = [refs.pop() for _ in side_copies][::-1]
  scales, maxima = [None] * len(side_copies), [None] * len(side_copies)
  for i, scale, partial_max in zip(scaled_sides, side_scales, side_maxima):
    scales[i], maxima[i] = scale, partial_max
  # Programs from plan.programs on copy and find no blocks of the product; the others find
  # no tiles to copy. (Branching on the program failed in Pallas's interpret mode, and so
  # did copies after the product's scope there: its scoped allocations are matched across
  # threads by their order.)
  if copy_programs:
    _copy_tiles(side_sources, side_targets, first_program=plan.programs, workers=copy_programs,
                scales=scales, maxima=maxima)
  if config.ping_pong:
    _ping_pong_program(a_gmem, b_gmem, operand_gmem, row_scale_gmem, col_scale_gmem,
                       copy_scale_gmem, *refs, config=config, plan=plan,
                       epilogue=epilogue, column_sums=column_sums, line_maxima=line_maxima,
                       speculated_copies=speculated_copies, stores_out=stores_out,
                       side_copies=tuple(zip(side_sources, side_targets, scales, maxima))
                       if config.copy_warpgroup else (), copier_loads=copier_loads)
  else:
    _product_program(a_gmem, b_gmem, operand_gmem, row_scale_gmem, col_scale_gmem,
                     copy_scale_gmem, *refs, config=config, transpose_a=transpose_a,
                     plan=plan, epilogue=epilogue, column_sums=column_sums, scaled=scaled,
                     line_maxima=line_maxima, speculated_copies=speculated_copies,
                     stores_out=stores_out)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def _product_outputs(refs, stores_out: bool, speculated_copies: int, column_sums,
                     line_maxima: bool):
  """(output, speculated copies, column sums, column maxima, row maxima, the split tail's
  fp32 partials) among a product program's output refs, in `matmul`'s order (None, or
  empty lists, where it has none)."""
  refs = list(refs)
  out = refs.pop(0) if stores_out else None
  copies = [refs.pop(0) for _ in range(speculated_copies)]
  sums = refs.pop(0) if column_sums else None
  col_max, row_max = (refs.pop(0), refs.pop(0)) if line_maxima else (None, None)
  return out, copies, sums, col_max, row_max, refs


def _copy_pieces_smem(slots: int, epilogue_tile, rows: int):
  """Each compute warpgroup's `slots` shared-memory pieces of the speculated f16 copies,
  swizzled as wide as a piece's rows (`rows`: the copies' `tma_tile_rows`)."""
  epi_m, epi_n = epilogue_tile
  return plgpu.SMEM((2, slots, epi_m, epi_n), jnp.float16,
                    transforms=swizzled_tiles(jnp.float16, rows, min(SWIZZLE, 2 * epi_n)))


def _times_line_scales(x, row_scale, col_scale):
  """`x` times its rows' scales, then its columns' (the TF32 products' unscaling).
  (broadcast_in_dim, not [:, None]: Mosaic's layout inference takes only the former.)"""
  return (x * lax.broadcast_in_dim(row_scale, x.shape, (0,))
          * lax.broadcast_in_dim(col_scale, x.shape, (1,)))


def _speculated_copy(value, copy_scale):
  """The f16 copy of `value` at its columns' speculated scales (`copy_scale`, a vector)."""
  return scaled_f16_operand(value, lax.broadcast_in_dim(copy_scale, value.shape, (1,)))


def _product_program(a_gmem, b_gmem, operand_gmem, row_scale_gmem, col_scale_gmem,
                     copy_scale_gmem, *refs, config: GemmConfig, transpose_a: bool,
                     plan: Schedule, epilogue: Callable | None, column_sums: str | None,
                     scaled: bool, line_maxima: bool, speculated_copies: int,
                     stores_out: bool):
  """One program's blocks of the product (`refs`: the product's outputs)."""
  out_gmem, copies_gmem, sums_gmem, col_max_gmem, row_max_gmem, partial_gmem = (
      _product_outputs(refs, stores_out, speculated_copies, column_sums, line_maxima))
  dtype, out_dtype = a_gmem.dtype, None if out_gmem is None else out_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  block_m, block_n = config.block
  grid_m, grid_n = plan.grid_mn
  epi_m, epi_n = config.epilogue_tile
  pieces = (tile_m // epi_m) * (tile_n // epi_n)
  slots = min(config.epilogue_buffers, pieces)

  partial_dtype = jnp.float32
  separate_partial_smem = bool(partial_gmem) and _partials_need_own_buffer(out_dtype)
  # Two warpgroups x `slots` buffers of one epilogue piece. The fp32 partials of a
  # 16-bit product get one buffer each, at least 32 columns wide (a 128-byte swizzle),
  # so the two epilogues fit beside the operand ring.
  epilogue_smem = lambda dtype, buffers, width, rows=8: plgpu.SMEM(
      (2, buffers, epi_m, width), dtype, transforms=swizzled_tiles(dtype, rows))
  out_rows = (out_gmem if stores_out else copies_gmem[0]).shape[0]
  out_tile_rows = tma_tile_rows(out_rows)   # TMA reaches a ragged output
  extra_smem = (dict(partial_smem=epilogue_smem(partial_dtype, 1, max(epi_n, 32)))
                if separate_partial_smem else {})
  if stores_out:
    extra_smem.update(out_smem=epilogue_smem(out_dtype, slots, epi_n, out_tile_rows))
  if epilogue is not None:
    operand_rows = tma_tile_rows(operand_gmem.shape[0])
    extra_smem.update(
        operand_smem=plgpu.SMEM((2, tile_m, tile_n), operand_gmem.dtype,
                                transforms=swizzled_tiles(operand_gmem.dtype, operand_rows)),
        operand_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  if copies_gmem:
    extra_smem.update(copy_smem=_copy_pieces_smem(slots, config.epilogue_tile, out_tile_rows),
        copy_scale_smem=plgpu.SMEM((2, tile_n), jnp.float32),
        copy_scale_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  if scaled:   # scales_arrived[w]: warpgroup w's row scales; [2 + w]: its column scales
    extra_smem.update(row_scale_smem=plgpu.SMEM((2, tile_m), jnp.float32),
                      col_scale_smem=plgpu.SMEM((2, tile_n), jnp.float32),
                      scales_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=4))
  reduces_columns = column_sums is not None or line_maxima
  if sums_gmem is not None:
    extra_smem.update(sums_smem=plgpu.SMEM((2, tile_n), jnp.float32))
  if line_maxima:
    extra_smem.update(col_max_smem=plgpu.SMEM((2, tile_n), jnp.float32),
                      row_max_smem=plgpu.SMEM((2, tile_m), jnp.float32))
  if reduces_columns:   # reduction_turn[w]: warpgroup w may reduce across its warps
    extra_smem.update(reduction_turn=plgpu.Barrier(num_arrivals=1, num_barriers=2))

  # The pipeline shrinks its ring to the step count; a released stage must stay behind it.
  delay = config.mma_in_flight if min(config.stages, plan.k_steps) > config.mma_in_flight else 0
  a_tile = (tile_k, block_m) if transpose_a else (block_m, tile_k)
  a_spec = plgpu.BlockSpec(a_tile, (lambda kk: (kk, 0)) if transpose_a else (lambda kk: (0, kk)),
                           transforms=swizzled_tiles(dtype), delay_release=delay)
  b_spec = plgpu.BlockSpec((tile_k, block_n), lambda kk: (kk, 0),
                           transforms=swizzled_tiles(dtype), delay_release=delay)

  def pipeline(body, compute_context, steps, state=None):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(steps,), memory_registers=MEMORY_REGISTERS, in_specs=[a_spec, b_spec],
        wg_axis="wg", num_compute_wgs=2, max_concurrent_steps=plan.ring,
        compute_context=compute_context, pipeline_state=state)

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocations=pipeline(ignore, ignore, plan.k_steps).get_allocations(a_gmem, b_gmem),
      **extra_smem, collective_axes="wg")
  def _scope(allocations, out_smem=None, partial_smem=None, operand_smem=None,
             operand_arrived=None, sums_smem=None, reduction_turn=None, row_scale_smem=None,
             col_scale_smem=None, scales_arrived=None, col_max_smem=None, row_max_smem=None,
             copy_smem=None, copy_scale_smem=None, copy_scale_arrived=None):
    wg = lax.axis_index("wg")

    def start_tile(row0, col0, whole=True):
      """Starts the TMA copies of what warpgroup `wg`'s epilogue reads for its tile at
      (row0, col0): they arrive while the MMAs run. A K-part (not `whole`) reads no
      epilogue operand."""
      rows, cols = pl.ds(row0, tile_m), pl.ds(col0, tile_n)
      if epilogue is not None and whole:
        plgpu.copy_gmem_to_smem(operand_gmem.at[rows, cols], operand_smem.at[wg],
                                operand_arrived.at[wg])
      if copies_gmem and whole:
        plgpu.copy_gmem_to_smem(copy_scale_gmem.at[cols], copy_scale_smem.at[wg],
                                copy_scale_arrived.at[wg])
      if scaled:
        plgpu.copy_gmem_to_smem(row_scale_gmem.at[rows], row_scale_smem.at[wg],
                                scales_arrived.at[wg])
        plgpu.copy_gmem_to_smem(col_scale_gmem.at[cols], col_scale_smem.at[wg],
                                scales_arrived.at[2 + wg])

    def store_in_pieces(tile_value, ring, targets):
      """Stores warpgroup `wg`'s `tile_value` to each of `targets` (its tile's place in
      each) by TMA, one piece at a time through its buffers of `ring` ([2, buffers, piece
      rows, piece columns]). A buffer is written again once the stores of the piece before
      in it have read it: each piece's stores are one group per target, and groups finish
      in the order they were committed."""
      buffers, piece_m, piece_n = ring.shape[1:]
      for pm in range(tile_m // piece_m):
        for pn in range(tile_n // piece_n):
          slot = (pm * (tile_n // piece_n) + pn) % buffers
          rows = slice(pm * piece_m, (pm + 1) * piece_m)
          cols = slice(pn * piece_n, (pn + 1) * piece_n)
          plgpu.wait_smem_to_gmem(len(targets) * (buffers - 1), wait_read_only=True)
          ring[wg, slot] = tile_value[rows, cols]
          plgpu.commit_smem()
          for target in targets:
            plgpu.copy_smem_to_gmem(ring.at[wg, slot], target.at[rows, cols])

    def finish_tile(acc, row0, col0, partial_index=None, partial_origin=(0, 0)):
      """Warpgroup `wg`'s epilogue for its tile at (row0, col0), its accumulator `acc`:
      scales, the fused epilogue and its reductions, then the store by TMA in pieces, to
      the output or, with `partial_index`, to that fp32 partial block (the tile at
      `partial_origin` in it)."""
      value = acc
      if scaled:
        plgpu.barrier_wait(scales_arrived.at[wg])
        plgpu.barrier_wait(scales_arrived.at[2 + wg])
        acc = value = _times_line_scales(acc, row_scale_smem[wg], col_scale_smem[wg])
      if partial_index is None:
        out, smem = (None, None) if out_gmem is None else (
            out_gmem.at[pl.ds(row0, tile_m), pl.ds(col0, tile_n)], out_smem)
      else:   # the partial block's own coordinates
        out = partial_gmem[0].at[partial_index, pl.ds(partial_origin[0], tile_m),
                                 pl.ds(partial_origin[1], tile_n)]
        smem = partial_smem if separate_partial_smem else out_smem
      if epilogue is not None:   # (whole blocks only: K-parts have no epilogue)
        plgpu.barrier_wait(operand_arrived.at[wg])
        value = epilogue(acc, operand_smem[wg].astype(jnp.float32))
      acc = None if smem is None else value.astype(smem.dtype)
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # the last tile's stores

      def reduce_lines():
        """The column sums and line maxima of this tile, in this warpgroup's turn."""
        plgpu.barrier_wait(reduction_turn.at[wg])
        if sums_gmem is not None:
          sums_smem[wg] = jnp.sum(
              value if column_sums == "unrounded" else acc.astype(jnp.float32), axis=0)
        if line_maxima:
          magnitude = jnp.abs(value)
          col_max_smem[wg] = jnp.max(magnitude, axis=0)
        plgpu.barrier_arrive(reduction_turn.at[1 - wg])
        if line_maxima:
          row_max_smem[wg] = jnp.max(magnitude, axis=1)   # within warps: no turn
        plgpu.commit_smem()
        for smem_row, gmem in ((sums_smem, sums_gmem), (col_max_smem, col_max_gmem)):
          if gmem is not None:
            plgpu.copy_smem_to_gmem(smem_row.at[wg], gmem.at[row0 // tile_m, pl.ds(col0, tile_n)])
        if line_maxima:
          plgpu.copy_smem_to_gmem(row_max_smem.at[wg],
                                  row_max_gmem.at[col0 // tile_n, pl.ds(row0, tile_m)])

      # Warpgroup 0 reduces first; warpgroup 1 stores meanwhile and reduces last.
      if reduces_columns:
        pl.when(wg == 0)(reduce_lines)
      if smem is not None:   # (None: no output stored, only the copies below)
        store_in_pieces(acc, smem, [out])
      if copies_gmem:   # the same values scaled to f16, to every copy
        plgpu.barrier_wait(copy_scale_arrived.at[wg])
        copy = _speculated_copy(value, copy_scale_smem[wg])
        tile = (pl.ds(row0, tile_m), pl.ds(col0, tile_n))
        store_in_pieces(copy, copy_smem, [copy_gmem.at[tile] for copy_gmem in copies_gmem])
      if reduces_columns:
        pl.when(wg == 1)(reduce_lines)

    whole_block = functools.partial(_whole_block, plan=plan, config=config)

    def tail_part(part):
      """(block row, block column, first contraction step) of the part-th tail K-part."""
      bm, bn = divmod(plan.whole + part // plan.splits, grid_n)
      return bm, bn, (part % plan.splits) * plan.steps_per_split

    if reduces_columns:
      @pl.when(wg == 1)
      def _first_turn():   # warpgroup 0 reduces first
        plgpu.barrier_arrive(reduction_turn.at[0])

    if config.split == "m":
      wg_rows, wg_cols = pl.ds(wg * tile_m, tile_m), slice(None)
    else:
      wg_rows, wg_cols = slice(None), pl.ds(wg * tile_n, tile_n)
    wg_row0, wg_col0 = (wg * tile_m, 0) if config.split == "m" else (0, wg * tile_n)

    def run_block(bm, bn, k_first_step, steps, partial_index=None, seq=None):
      """Accumulates block (bm, bn) over `steps` contraction steps, each warpgroup its tile:
      the program's `seq`-th pipeline of a chained schedule."""
      row0, col0 = bm * block_m + wg_row0, bn * block_n + wg_col0   # this warpgroup's tile
      k_range = pl.ds(k_first_step * tile_k, steps * tile_k)

      def compute_context(run_pipeline):
        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, tile_n), jnp.float32))
        def _acc(acc_ref):
          start_tile(row0, col0, whole=partial_index is None)
          with jax.named_scope("mainloop"):
            run_pipeline(acc_ref)
            acc = acc_ref[...]   # (waits for the MMAs)
          with jax.named_scope("epilogue"):
            finish_tile(acc, row0, col0, partial_index, (wg_row0, wg_col0))

      def mma(_, a_smem, b_smem, acc_ref):
        if transpose_a:
          plgpu.wgmma(acc_ref, a_smem.at[:, wg_rows].transpose((1, 0)) if config.split == "m"
                      else a_smem.transpose((1, 0)), b_smem.at[:, wg_cols])
        else:
          plgpu.wgmma(acc_ref, a_smem.at[wg_rows], b_smem.at[:, wg_cols])
        plgpu.wgmma_wait(delay)
        return acc_ref

      block_rows, block_cols = pl.ds(bm * block_m, block_m), pl.ds(bn * block_n, block_n)
      a_view = a_gmem.at[k_range, block_rows] if transpose_a else a_gmem.at[block_rows, k_range]
      run = lambda state: pipeline(mma, compute_context, steps, state)(
          a_view, b_gmem.at[k_range, block_cols], allocations=allocations)
      if seq is None:
        return run(None)
      # START, STEADY..., STOP; a program of one block runs it unchained (Pallas has no
      # state that both starts and stops).
      @pl.when(pipelines_here == 1)
      def _alone():
        run(None)

      @pl.when(pipelines_here > 1)
      def _chained():
        state = lax.select(seq == 0, START, lax.select(seq == pipelines_here - 1, STOP, STEADY))
        run(state)

    program = lax.axis_index("program")
    chain, whole_here = (lambda seq: None), 0
    if config.chained:   # this program's pipelines: its whole blocks, then its K-parts
      START, STEADY, STOP = (jnp.int32(s) for s in plgpu.PipelinePipeline)
      whole_here = _count_here(plan.whole, program, plan.programs)
      pipelines_here = whole_here + (
          _count_here(plan.tail * plan.splits, program, plan.programs) if partial_gmem else 0)
      chain = lambda seq: seq

    if plan.whole:
      @_strided_loop(plan.whole, program, plan.programs)
      def _whole_blocks(index, local_index):
        run_block(*whole_block(index), 0, plan.whole_steps, seq=chain(local_index))
    if partial_gmem:
      @_strided_loop(plan.tail * plan.splits, program, plan.programs)
      def _tail_parts(index, local_index):
        run_block(*tail_part(index), plan.steps_per_split, partial_index=index,
                  seq=chain(whole_here + local_index))
    if reduces_columns:
      @pl.when(wg == 0)
      def _last_turn():   # warpgroup 1's last arrival: every barrier phase is waited on
        plgpu.barrier_wait(reduction_turn.at[0])


def _ping_pong_program(a_gmem, b_gmem, operand_gmem, row_scale_gmem, col_scale_gmem,
                       copy_scale_gmem, *refs, config: GemmConfig, plan: Schedule,
                       epilogue: Callable | None, column_sums: str | None, line_maxima: bool,
                       speculated_copies: int, stores_out: bool, side_copies=(),
                       copier_loads: int = 0):
  """One program's blocks of a ping-pong product (`GemmConfig.ping_pong`), as CUTLASS's
  ping-pong kernels run them: the memory warpgroup streams the program's blocks in order
  through one ring (block j's steps, then block j + 1's), and block j is compute
  warpgroup j mod 2's. Each ring slot has a "full" barrier per compute warpgroup (each
  waits only on its own) and one "consumed" barrier, which the memory warpgroup waits
  on before it refills the slot. The epilogue scales the accumulator (`row_scale_gmem`,
  `col_scale_gmem`: TMA'd while the MMAs run), reads the fused operand and stores the
  output and the speculated f16 copies in `epilogue_tile` pieces (a piece's operand
  buffer is refilled with a later piece as soon as it is read, before the piece's math);
  the column sums and maxima gather a column's pieces in registers, then reduce across
  warps, the warpgroups taking turns at Pallas's one reduction scratch (written
  `[row blocks, N / piece columns, piece columns]`; the row maxima `[column blocks, M /
  piece rows, piece rows]`, `copy_scale_gmem` read `[N / piece columns, piece columns]`).
  With `config.copy_warpgroup`, a fourth warpgroup makes `side_copies` ((fp32 source,
  16-bit target, scale or None, partial maxima or None)) meanwhile, `copier_loads` tiles
  in flight: program p takes the `COPIER_TILE` tiles p, p + P, ... of an unscaled one, and
  is lane p of a scaled one (`_scaled_copy_share`)."""
  out_gmem, copies_gmem, sums_gmem, col_max_gmem, row_max_gmem, _ = _product_outputs(
      refs, stores_out, speculated_copies, column_sums, line_maxima)
  dtype = a_gmem.dtype
  tile_m, tile_n, tile_k = config.tile_m, config.tile_n, config.tile_k
  epi_m, epi_n = config.epilogue_tile
  # column pieces outermost: a column's pieces follow each other, for its sums and maxima
  pieces = [(pm, pn) for pn in range(tile_n // epi_n) for pm in range(tile_m // epi_m)]
  slots = min(config.epilogue_buffers, len(pieces))
  ring, k_steps = min(config.stages, plan.k_steps), plan.k_steps
  program = lax.axis_index("program")
  here = _count_here(plan.whole, program, plan.programs)
  scaled = row_scale_gmem is not None
  reduces_columns = column_sums is not None or line_maxima
  targets = ([out_gmem] if stores_out else []) + copies_gmem
  # Each piece's stores are one group per target; a piece buffer is written again once the
  # groups of the piece before in it have read it.
  stores_after_slot = (slots - 1) * len(targets)
  out_tile_rows = tma_tile_rows(targets[0].shape[0])

  def origin(local):
    bm, bn = _whole_block(program + local * plan.programs, plan, config)
    return bm * tile_m, bn * tile_n

  scratch = dict(
      a_smem=plgpu.SMEM((ring, tile_m, tile_k), dtype, transforms=swizzled_tiles(dtype)),
      b_smem=plgpu.SMEM((ring, tile_k, tile_n), dtype, transforms=swizzled_tiles(dtype)),
      a_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * ring),
      b_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * ring),
      consumed=plgpu.Barrier(num_arrivals=1, num_barriers=ring))
  if stores_out:
    scratch.update(out_smem=plgpu.SMEM((2, slots, epi_m, epi_n), out_gmem.dtype,
                                       transforms=swizzled_tiles(out_gmem.dtype, out_tile_rows)))
  if copies_gmem:
    scratch.update(
        copy_smem=_copy_pieces_smem(slots, config.epilogue_tile, out_tile_rows),
        copy_scale_smem=plgpu.SMEM((2, tile_n // epi_n, epi_n), jnp.float32),
        copy_scale_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  if scaled:   # scales_arrived[w]: warpgroup w's row scales; [2 + w]: its column scales
    scratch.update(row_scale_smem=plgpu.SMEM((2, tile_m), jnp.float32),
                   col_scale_smem=plgpu.SMEM((2, tile_n), jnp.float32),
                   scales_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=4))
  if epilogue is not None:
    scratch.update(
        operand_smem=plgpu.SMEM((2, slots, epi_m, epi_n), operand_gmem.dtype,
                                transforms=swizzled_tiles(
                                    operand_gmem.dtype, tma_tile_rows(operand_gmem.shape[0]))),
        operand_full=plgpu.Barrier(num_arrivals=1, num_barriers=2 * slots))
  if column_sums:
    scratch.update(sums_smem=plgpu.SMEM((2, tile_n // epi_n, epi_n), jnp.float32))
  if line_maxima:
    scratch.update(col_max_smem=plgpu.SMEM((2, tile_n // epi_n, epi_n), jnp.float32),
                   row_max_smem=plgpu.SMEM((2, tile_m // epi_m, epi_m), jnp.float32))
  if reduces_columns:   # turn[w]: warpgroup w may reduce across its warps
    scratch.update(turn=plgpu.Barrier(num_arrivals=1, num_barriers=2))
  if config.copy_warpgroup:
    scratch.update(
        copy_loaded=plgpu.SMEM((copier_loads, *COPIER_TILE), jnp.float32),
        copy_rounded=plgpu.SMEM((COPY_STORES, *COPIER_TILE), dtype),
        copy_arrived=plgpu.Barrier(num_arrivals=1, num_barriers=copier_loads))
    if any(scale is not None for _, _, scale, _ in side_copies):
      scratch.update(copy_largest=plgpu.SMEM((1, COPIER_TILE[1]), jnp.float32))

  @functools.partial(pl.run_scoped, **scratch, collective_axes="wg")
  def _scope(a_smem, b_smem, a_full, b_full, consumed, out_smem=None, copy_smem=None,
             copy_scale_smem=None, copy_scale_arrived=None, row_scale_smem=None,
             col_scale_smem=None, scales_arrived=None, operand_smem=None, operand_full=None,
             sums_smem=None, col_max_smem=None, row_max_smem=None, turn=None,
             copy_loaded=None, copy_rounded=None, copy_arrived=None, copy_largest=None):
    wg = lax.axis_index("wg")

    if config.copy_warpgroup:
      @pl.when(wg == 3)
      def _copies():
        plgpu.set_max_registers(COPIER_REGISTERS, action="decrease")
        stored = jnp.int32(0)
        for source, target, scale, partial_max in side_copies:
          buffers = (copy_loaded, copy_rounded, copy_arrived, 0)
          if scale is None:
            stored = _copy_share(source, target, program, plan.programs, stored, *buffers)
          else:
            stored = _scaled_copy_share(source, target, scale, partial_max, program,
                                        plan.programs, stored, *buffers, copy_largest)
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    @pl.when(wg == 2)
    def _memory():
      plgpu.set_max_registers(MEMORY_REGISTERS, action="decrease")

      @pl.loop(0, here)
      def _block(local):   # (its origin once, not at every step: NOTES 65d)
        row0, col0 = origin(local)
        owner = lax.rem(local, 2)

        @pl.loop(0, k_steps)
        def _step(kk):
          g = local * k_steps + kk
          slot = lax.rem(g, ring)

          @pl.when(g >= ring)
          def _():
            plgpu.barrier_wait(consumed.at[slot])
          plgpu.copy_gmem_to_smem(a_gmem.at[pl.ds(row0, tile_m), pl.ds(kk * tile_k, tile_k)],
                                  a_smem.at[slot], a_full.at[owner * ring + slot])
          plgpu.copy_gmem_to_smem(b_gmem.at[pl.ds(kk * tile_k, tile_k), pl.ds(col0, tile_n)],
                                  b_smem.at[slot], b_full.at[owner * ring + slot])

      @pl.loop(jnp.maximum(here * k_steps - ring, 0), here * k_steps)
      def _drain(g):   # every phase of `consumed` is waited on
        plgpu.barrier_wait(consumed.at[lax.rem(g, ring)])

    if reduces_columns:
      @pl.when((wg == 1) & (here > 0))
      def _first_turn():   # warpgroup 0 reduces first
        plgpu.barrier_arrive(turn.at[0])

    @pl.when(wg < 2)
    def _compute():
      plgpu.set_max_registers(COPIER_COMPUTE_REGISTERS if config.copy_warpgroup
                              else PING_PONG_COMPUTE_REGISTERS, action="increase")

      @pl.loop(0, lax.div(here - wg + 1, 2))   # blocks wg, wg + 2, ... of `here`
      def _block(i):
        local = 2 * i + wg
        row0, col0 = origin(local)

        def load_operand(p):
          pm, pn = pieces[p]
          plgpu.copy_gmem_to_smem(
              operand_gmem.at[pl.ds(row0 + pm * epi_m, epi_m), pl.ds(col0 + pn * epi_n, epi_n)],
              operand_smem.at[wg, p % slots], operand_full.at[wg * slots + p % slots])

        # What the epilogue reads arrives during the MMAs: the block's scales (their
        # buffers last read by this warpgroup's previous block, before its last commit)
        # and the first operand pieces.
        if scaled:
          plgpu.copy_gmem_to_smem(row_scale_gmem.at[pl.ds(row0, tile_m)],
                                  row_scale_smem.at[wg], scales_arrived.at[wg])
          plgpu.copy_gmem_to_smem(col_scale_gmem.at[pl.ds(col0, tile_n)],
                                  col_scale_smem.at[wg], scales_arrived.at[2 + wg])
        if copies_gmem:
          plgpu.copy_gmem_to_smem(copy_scale_gmem.at[pl.ds(col0 // epi_n, tile_n // epi_n)],
                                  copy_scale_smem.at[wg], copy_scale_arrived.at[wg])
        if epilogue is not None:
          for p in range(slots):
            load_operand(p)

        def accumulate(acc_ref):
          def step(kk, carry):
            g = local * k_steps + kk
            slot = lax.rem(g, ring)
            plgpu.barrier_wait(a_full.at[wg * ring + slot])
            plgpu.barrier_wait(b_full.at[wg * ring + slot])
            plgpu.wgmma(acc_ref, a_smem.at[slot], b_smem.at[slot])
            plgpu.wgmma_wait(1)   # the step before is done: its slot is free

            @pl.when(kk > 0)
            def _():
              plgpu.barrier_arrive(consumed.at[lax.rem(g - 1, ring)])
            return carry
          lax.fori_loop(0, k_steps, step, None)
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(consumed.at[lax.rem(local * k_steps + k_steps - 1, ring)])
          return acc_ref[...]
        with jax.named_scope("mainloop"):
          acc = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
        with jax.named_scope("epilogue"):
          if scaled:
            plgpu.barrier_wait(scales_arrived.at[wg])
            plgpu.barrier_wait(scales_arrived.at[2 + wg])
            acc = _times_line_scales(acc, row_scale_smem[wg], col_scale_smem[wg])
          if copies_gmem:
            plgpu.barrier_wait(copy_scale_arrived.at[wg])
          sums, maxima, row_maxima = None, None, [None] * (tile_m // epi_m)
          for p, (pm, pn) in enumerate(pieces):
            rows, cols = slice(pm * epi_m, (pm + 1) * epi_m), slice(pn * epi_n, (pn + 1) * epi_n)
            value = acc[rows, cols]
            if epilogue is not None:
              plgpu.barrier_wait(operand_full.at[wg * slots + p % slots])
              operand = operand_smem[wg, p % slots].astype(jnp.float32)
              if p + slots < len(pieces):
                plgpu.commit_smem()   # every thread has read the piece: refill its buffer
                load_operand(p + slots)
              value = epilogue(value, operand)
            plgpu.wait_smem_to_gmem(stores_after_slot, wait_read_only=True)
            if stores_out:
              stored = value.astype(out_gmem.dtype)
              out_smem[wg, p % slots] = stored
            if copies_gmem:
              copy_smem[wg, p % slots] = _speculated_copy(value, copy_scale_smem[wg, pn])
            plgpu.commit_smem()
            place = (pl.ds(row0 + pm * epi_m, epi_m), pl.ds(col0 + pn * epi_n, epi_n))
            if stores_out:
              plgpu.copy_smem_to_gmem(out_smem.at[wg, p % slots], out_gmem.at[place])
            for copy_gmem in copies_gmem:
              plgpu.copy_smem_to_gmem(copy_smem.at[wg, p % slots], copy_gmem.at[place])
            if column_sums:
              term = value if column_sums == "unrounded" else stored.astype(jnp.float32)
              sums = term if pm == 0 else sums + term
            if line_maxima:
              magnitude = jnp.abs(value)
              maxima = magnitude if pm == 0 else jnp.maximum(maxima, magnitude)
              row_max = jnp.max(magnitude, axis=1)   # within warps
              row_maxima[pm] = row_max if pn == 0 else jnp.maximum(row_maxima[pm], row_max)
            if reduces_columns and pm == tile_m // epi_m - 1:   # a column's last piece:
              if pn == 0:                                       # across warps
                plgpu.barrier_wait(turn.at[wg])
              if column_sums:
                sums_smem[wg, pn] = jnp.sum(sums, axis=0)
              if line_maxima:
                col_max_smem[wg, pn] = jnp.max(maxima, axis=0)
          if len(pieces) % slots:   # the next block's first piece takes the buffer whose
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # stores this block ended on
          if reduces_columns:
            @pl.when(local + 1 < here)
            def _():
              plgpu.barrier_arrive(turn.at[1 - wg])
            if line_maxima:
              for pm, row_max in enumerate(row_maxima):
                row_max_smem[wg, pm] = row_max
            plgpu.commit_smem()
            row_block, col_pieces = lax.div(row0, tile_m), pl.ds(col0 // epi_n, tile_n // epi_n)
            for lines_smem, lines_gmem in ((sums_smem, sums_gmem), (col_max_smem, col_max_gmem)):
              if lines_gmem is not None:
                plgpu.copy_smem_to_gmem(lines_smem.at[wg], lines_gmem.at[row_block, col_pieces])
            if line_maxima:
              plgpu.copy_smem_to_gmem(
                  row_max_smem.at[wg],
                  row_max_gmem.at[lax.div(col0, tile_n), pl.ds(row0 // epi_m, tile_m // epi_m)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)   # before the next block's lines
      plgpu.wait_smem_to_gmem(0)


def _whole_block(index, plan: Schedule, config: GemmConfig):
  """(block row, block column) of the index-th whole block: planar snake over the full
  block rows, then row-major over the rest of the whole blocks."""
  grid_n = plan.grid_mn[1]
  whole_rows = plan.whole // grid_n
  in_rows = index < whole_rows * grid_n
  bm, bn = plgpu.planar_snake(index, (max(whole_rows, 1), grid_n),
                              0 if config.grid_minor == "m" else 1, config.grid_tile_width)
  return (lax.select(in_rows, bm, jnp.int32(whole_rows)),
          lax.select(in_rows, bn, index - whole_rows * grid_n))


def _count_here(count: int, first, stride: int):
  """How many of the indices first, first + stride, ... lie below `count`: none unless
  0 <= first < stride (one of `stride` lanes)."""
  here = jnp.maximum(count - first + stride - 1, 0) // stride
  return lax.select((first >= 0) & (first < stride), here, jnp.zeros_like(here))


def _strided_loop(count: int, first, stride: int):
  """Runs the decorated `body(index, local_index)` for index = first, first + stride, ...
  below `count` (local_index = 0, 1, ...): a persistent program's share of `count` items."""
  def decorator(body):
    def step(local_index, carry):
      body(first + local_index * stride, local_index)
      return carry
    lax.fori_loop(0, _count_here(count, first, stride), step, None)
  return decorator


def copy_lanes(config: GemmConfig, programs: int) -> int:
  """Warpgroups that make a product's side copies: each copy program's 3, or a copy
  warpgroup in each of the product's `programs`."""
  return 3 * config.copy_programs if config.copy_programs else programs


def copy_parts(lanes: int, x) -> int:
  """Partial rows of a scaled side copy's column maxima: its copying `lanes` per column
  strip of 128 columns (`COPY_TILE`'s and `COPIER_TILE`'s), at least 1."""
  return max(1, lanes // pl.cdiv(x.shape[1], COPY_TILE[1]))


def _copy_run(source, target, first, stride, count, stored, loaded, rounded, arrived,
              first_barrier, scale=None):
  """One warpgroup's copies of `source`'s tiles first, first + stride, ... (`count` of
  them, row-major tile indices of `loaded`'s tile shape) into `target`, through its fp32
  buffers `loaded` ([loads, rows, cols], `arrived.at[first_barrier + slot]` each) and
  16-bit buffers `rounded` ([stores, rows, cols]). Returns the warpgroup's stores so far
  (the store slots rotate across runs: the one store that may still read a slot is the
  warpgroup's last) and, with a scale, the elementwise largest finite |x| over the run's
  tiles."""
  loads, rows, cols = loaded.shape
  stores = rounded.shape[0]
  tiles_n = pl.cdiv(target.shape[1], cols)

  def tile(i):
    r, c = divmod(first + i * stride, tiles_n)
    return pl.ds(r * rows, rows), pl.ds(c * cols, cols)

  def load(i):
    slot = i % loads
    plgpu.copy_gmem_to_smem(source.at[tile(i)], loaded.at[slot],
                            arrived.at[first_barrier + slot])

  for i in range(loads - 1):   # the first loads in flight
    pl.when(i < count)(functools.partial(load, i))

  def step(i, running):
    pl.when(i + loads - 1 < count)(functools.partial(load, i + loads - 1))
    slot, out_slot = i % loads, (stored + i) % stores
    plgpu.barrier_wait(arrived.at[first_barrier + slot])
    plgpu.wait_smem_to_gmem(stores - 1, wait_read_only=True)
    x = loaded[slot]
    if scale is None:
      rounded[out_slot] = x.astype(target.dtype)
    else:
      rounded[out_slot] = scaled_f16_operand(x, scale)
      running = jnp.maximum(running, finite_abs(x))
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(rounded.at[out_slot], target.at[tile(i)])
    return running
  running = lax.fori_loop(0, count, step, None if scale is None
                          else jnp.zeros((rows, cols), jnp.float32))
  return stored + count, running


def _copy_share(source, target, lane, lanes, stored, loaded, rounded, arrived,
                first_barrier):
  """Lane `lane` of `lanes`' share of an unscaled copy: `target`'s tiles lane, lane +
  lanes, ... in row-major order, by `_copy_run`; returns the lane's stores so far."""
  _, rows, cols = loaded.shape
  tiles = pl.cdiv(target.shape[0], rows) * pl.cdiv(target.shape[1], cols)
  stored, _ = _copy_run(source, target, lane, lanes, _count_here(tiles, lane, lanes), stored,
                        loaded, rounded, arrived, first_barrier)
  return stored


def _scaled_copy_share(source, target, scale, partial_max, lane, lanes, stored, loaded,
                       rounded, arrived, first_barrier, largest):
  """Lane `lane` of `lanes`' share of a scaled copy, f16(x * scale[0]), and of its largest
  finite |x| per column, left as the P rows of `partial_max` ([P, C]): lane p of a column
  strip's P lanes copies the strip's row tiles p, p + P, ... by `_copy_run` and writes row
  p of the strip (through `largest`, [1, columns]); returns the lane's stores so far."""
  _, rows, cols = loaded.shape
  tiles_m, tiles_n = pl.cdiv(target.shape[0], rows), pl.cdiv(target.shape[1], cols)
  parts = partial_max.shape[0]
  groups, part, group = lanes // parts, lane % parts, lane // parts
  factor = scale[0]

  def strip(j, stored):
    c = group + j * groups
    stored, running = _copy_run(source, target, part * tiles_n + c, parts * tiles_n,
                                _count_here(tiles_m, part, parts), stored, loaded, rounded,
                                arrived, first_barrier, factor)
    # The strip's rows of maxima to one, through shared memory (no cross-warp reduction:
    # Pallas gives those one scratch buffer, which other warpgroups may be using).
    loaded[0] = running
    plgpu.commit_smem()
    top = loaded[0, 0]
    for r in range(1, rows):
      top = jnp.maximum(top, loaded[0, r])
    largest[0] = top
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(largest, partial_max.at[pl.ds(part, 1), pl.ds(c * cols, cols)])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    return stored
  return lax.fori_loop(0, _count_here(tiles_n, group, groups), strip, stored)


def _copy_tiles(sources, targets, *, first_program: int, workers: int, scales=None,
                maxima=None):
  """The copy programs' work (`workers` programs from `first_program` on; the others
  find none): each of a program's 3 warpgroups (lanes) copies its share of each source's
  `COPY_TILE` tiles into its 16-bit target (TMA fills rows past the source with zeros
  and drops tiles past the target's end).

  A source with a scale (`scales[i]`, an fp32 vector whose first element is a power of
  two; `maxima[i]` `[P, C]` with it) is copied as f16(x * scale) with its column maxima
  (`_scaled_copy_share`). Other sources go to the lanes tile by tile (every (3
  workers)-th tile in row-major order)."""
  rows, cols = COPY_TILE
  scales = scales or [None] * len(sources)
  maxima = maxima or [None] * len(sources)

  @functools.partial(
      pl.run_scoped,
      loaded=plgpu.SMEM((3, COPY_LOADS, rows, cols), jnp.float32),
      rounded=plgpu.SMEM((3, COPY_STORES, rows, cols), targets[0].dtype),
      largest=plgpu.SMEM((3, 1, cols), jnp.float32),
      arrived=plgpu.Barrier(num_arrivals=1, num_barriers=3 * COPY_LOADS),
      collective_axes="wg")
  def _scope(loaded, rounded, largest, arrived):
    wg, worker = lax.axis_index("wg"), lax.axis_index("program") - first_program
    lane, lanes = worker * 3 + wg, workers * 3
    buffers = (loaded.at[wg], rounded.at[wg], arrived, wg * COPY_LOADS)
    stored = jnp.int32(0)
    for source, target, scale, partial_max in zip(sources, targets, scales, maxima):
      if scale is None:
        stored = _copy_share(source, target, lane, lanes, stored, *buffers)
      else:
        stored = _scaled_copy_share(source, target, scale, partial_max, lane, lanes, stored,
                                    *buffers, largest.at[wg])
