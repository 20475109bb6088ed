"""Tile configurations for the Triton kernels, and the measured tables that pick them.

The backward runs four tiled products (`kernels.Product`) in three roles. Each
role gets a `TileConfig`; a `Config` holds the three. `default_config(problem)`
picks them per S, and `triton_wins(problem)` routes between the kernels and
XLA, from the tables measured on one GPU: `configs/<gpu>.json` beside this
module (today `configs/h200.json`), which also names for every row the result
files under benchmarks/results/ it came from (`load_tables` reads it;
tests/test_configs.py and tests/test_routing.py hold it to those results).
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import json

from vision_mlp_bwd.backends.shared import in_ranges
from vision_mlp_bwd.precision import BF16X3_MODES, DotMode
from vision_mlp_bwd.problem import Problem


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """One tiled product: output tile, contraction step, split, Triton knobs."""

  block_m: int
  block_n: int
  block_k: int
  split_k: int = 1        # programs that share one output tile's contraction
  num_warps: int = 4
  num_stages: int = 3
  # Ragged M just past one block: where block_m < M <= block_m + tail_m, one
  # block of rows, computed as block_m rows plus a second accumulator of
  # tail_m rows that shares B's tiles, instead of a 2 * block_m tile or a
  # second block of rows that reads B again. wgmma takes 64 rows per group of
  # 4 warps; fewer run as older, smaller mma instructions.
  tail_m: int = 0

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      value = getattr(self, name)
      if value < 16 or value & (value - 1):
        raise ValueError(f"TileConfig.{name}={value}: Triton needs a power of 2 >= 16.")
    if self.tail_m and (self.tail_m < 16 or self.tail_m & (self.tail_m - 1)
                        or self.tail_m >= self.block_m):
      raise ValueError(f"TileConfig.tail_m={self.tail_m}: a power of 2 >= 16 below "
                       f"block_m={self.block_m}, or 0.")
    if self.split_k < 1:
      raise ValueError(f"TileConfig.split_k={self.split_k} must be >= 1.")


@dataclasses.dataclass(frozen=True)
class Config:
  """The three launches of the Triton backward."""

  # grad_fc1_output = (grad_output @ fc2_weight) * gelu'(fc1_output): M=S, N=I, K=H.
  pre_activation: TileConfig
  # grad_fc2_weight = grad_output.T @ gelu_output (M=H, N=I) and
  # grad_fc1_weight = grad_fc1_output.T @ hidden_state (M=I, N=H); K=S.
  weight_grads: TileConfig
  # grad_hidden_state = grad_fc1_output @ fc1_weight: M=S, N=H, K=I.
  input_grad: TileConfig
  # 16-bit modes: cast the fp32 activations (grad_output, hidden_state,
  # gelu_output) and/or the weights to the operand dtype in XLA first, so the
  # kernels multiply 16-bit tiles they need not convert.
  cast_inputs: bool = False
  cast_weights: bool = False
  # With cast_inputs: cast in Pallas jobs instead of XLA converts (a kernel
  # each): grad_output and gelu_output in one launch before the first,
  # hidden_state (needed only by the second) inside the first launch
  # (benchmarks/NOTES.md, 12).
  fused_casts: bool = False
  # fp32 wgmma operands must be K-major in shared memory; an operand that is
  # not K-contiguous in HBM is then copied 4 bytes at a time. The left operand
  # can come from registers instead (`Product.lhs_in_registers`), so only the
  # right one needs K-contiguous rows. In 32-bit modes (16-bit tiles transpose
  # for free) the weight gradients' right operand (gelu_output, hidden_state)
  # is then read from a transposed copy, the left one through registers
  # (benchmarks/NOTES.md, 13).
  k_major_weight_grads: bool = False
  # Split contractions (the input gradient's) summed by the last program of
  # each output tile, in split order, instead of in a reduction after the
  # launch (`kernels.Product.sum_splits_in_kernel`; benchmarks/NOTES.md, 18).
  sum_splits_in_kernel: bool = False
  # TF32 with fp32 inputs: every product runs on f16 tensor cores, its
  # operands scaled by powers of two per output row and column so that f16
  # holds their TF32 roundings (`precision.f16_scale`); three launches
  # (`_backward_on_f16` in this package). With cast_inputs, grad_output is
  # also cast by rows for the pre-activation product, which otherwise
  # converts it itself (benchmarks/NOTES.md, 20).
  tf32_on_f16: bool = False
  # 16-bit operand modes with fp32 inputs, on a Hopper GPU: launch 1 runs as
  # one Pallas Mosaic-GPU grid (`launch_1_sm90.launch_1`: its converted weight
  # tiles double-buffered, TMA-fed) instead of Triton's; the casts launch then
  # also casts hidden_state and zeroes the counters, and launch 2 sums
  # grad_output's columns (the fc2 bias gradient). Elsewhere (other GPUs,
  # interpret mode, H or I not multiples of 128, other flags:
  # `launch_1_on_mosaic`) launch 1 stays Triton's (benchmarks/NOTES.md, 23-24).
  mosaic_launch_1: bool = False

  @property
  def launch_1_on_mosaic(self) -> bool:
    """mosaic_launch_1 where the rest allows: it replaces launch 1 of the fused casts
    (cast_inputs, fused_casts), weights as stored."""
    return (self.mosaic_launch_1 and self.cast_inputs and self.fused_casts
            and not self.cast_weights)


# --- the tables, from configs/<gpu>.json -------------------------------------------------

CONFIG_FILE = "h200.json"   # the GPU the tables were measured on (the only one so far)
ROLES = ("pre_activation", "weight_grads", "input_grad")
TABLE_NAMES = ("sixteen_bit", "thirty_two_bit", "tf32_on_f16", "three_pass")
ROUTING_NAMES = ("fp32_inputs", "sixteen_bit_inputs")
_TILE_FIELDS = {f.name: f for f in dataclasses.fields(TileConfig)}
_FLAGS = {f.name: f for f in dataclasses.fields(Config) if f.name not in ROLES}

Row = tuple[int | None, Config | None]   # (largest S or None for every larger S, Config)
Ranges = tuple[tuple[int, int | None], ...]   # inclusive S ranges, None: no upper end


class ConfigFileError(ValueError):
  """A tuned-config file that does not have the layout `load_tables` reads."""


@dataclasses.dataclass(frozen=True)
class Tables:
  """A parsed configs/<gpu>.json: its tables of rows and its routing."""

  gpu: str
  tables: dict[str, tuple[Row, ...]]             # TABLE_NAMES -> rows, S ascending
  routing: dict[str, dict[DotMode, Ranges]]      # ROUTING_NAMES -> mode -> S ranges
  document: dict                                 # the file as parsed (provenance included)


def _fail(where, message):
  raise ConfigFileError(f"{where}: {message}")


def _keys(where, value, required, optional=()):
  if not isinstance(value, dict):
    _fail(where, f"expected an object, got {type(value).__name__}")
  missing = [k for k in required if k not in value]
  unknown = [k for k in value if k not in required and k not in optional]
  if missing or unknown:
    _fail(where, f"missing {missing}, unknown {unknown} (fields: "
                 f"{sorted(set(required) | set(optional))})")


def _int(where, value, minimum=1):
  if type(value) is not int or value < minimum:   # bool is an int: refused too
    _fail(where, f"expected an integer >= {minimum}, got {value!r}")
  return value


def _commit(where, value):
  if value is not None and not (isinstance(value, str) and 7 <= len(value) <= 40
                                and all(c in "0123456789abcdef" for c in value)):
    _fail(where, f"expected a commit (7-40 hex digits) or null, got {value!r}")


def config_from_dict(value, where="config") -> Config:
  """A Config from its JSON form: the three roles' tiles, each a TileConfig's fields, and
  any Config flags; what is left out takes the dataclasses' defaults."""
  _keys(where, value, ROLES, _FLAGS)
  tiles = {}
  for role in ROLES:
    tile = value[role]
    _keys(f"{where}.{role}", tile, ("block_m", "block_n", "block_k"), _TILE_FIELDS)
    for name, number in tile.items():
      _int(f"{where}.{role}.{name}", number, minimum=0 if name == "tail_m" else 1)
    try:
      tiles[role] = TileConfig(**tile)
    except ValueError as e:
      _fail(f"{where}.{role}", str(e))
  for name, flag in value.items():
    if name in _FLAGS and type(flag) is not bool:
      _fail(f"{where}.{name}", f"expected true or false, got {flag!r}")
  return Config(**tiles, **{k: v for k, v in value.items() if k in _FLAGS})


def config_as_dict(config: Config) -> dict:
  """The JSON form of `config` (`config_from_dict`): only what differs from the defaults."""
  def differs(obj, fields):
    return {name: getattr(obj, name) for name, f in fields.items()
            if f.default is dataclasses.MISSING or getattr(obj, name) != f.default}
  return {**{role: differs(getattr(config, role), _TILE_FIELDS) for role in ROLES},
          **differs(config, _FLAGS)}


def _provenance(where, value):
  _keys(where, value, ("notes", "added_in", "results"))
  if not isinstance(value["notes"], list):
    _fail(f"{where}.notes", "expected a list of benchmarks/NOTES.md section numbers")
  for j, section in enumerate(value["notes"]):
    _int(f"{where}.notes[{j}]", section)
  _commit(f"{where}.added_in", value["added_in"])
  if not isinstance(value["results"], list):
    _fail(f"{where}.results", "expected a list")
  for j, result in enumerate(value["results"]):
    at = f"{where}.results[{j}]"
    _keys(at, result, ("path", "commit", "date", "what"))
    if not (isinstance(result["path"], str) and result["path"].startswith("benchmarks/results/")):
      _fail(f"{at}.path", f"expected a path under benchmarks/results/, got {result['path']!r}")
    _commit(f"{at}.commit", result["commit"])
    if result["date"] is not None and not isinstance(result["date"], str):
      _fail(f"{at}.date", f"expected an ISO date or null, got {result['date']!r}")


def _rows(where, table, nullable):
  _keys(where, table, ("about", "rows"))
  rows, previous = [], 0
  if not isinstance(table["rows"], list) or not table["rows"]:
    _fail(f"{where}.rows", "expected a non-empty list")
  for j, row in enumerate(table["rows"]):
    at = f"{where}.rows[{j}]"
    _keys(at, row, ("max_tokens", "config", "provenance"))
    largest, last = row["max_tokens"], j == len(table["rows"]) - 1
    if last != (largest is None):
      _fail(f"{at}.max_tokens", "the last row, and only it, has max_tokens null")
    if largest is not None and _int(f"{at}.max_tokens", largest) <= previous:
      _fail(f"{at}.max_tokens", f"{largest} does not grow past the row before ({previous})")
    previous = largest
    if row["config"] is None and not nullable:
      _fail(f"{at}.config", "null (fall back to thirty_two_bit) only in tf32_on_f16")
    config = None if row["config"] is None else config_from_dict(row["config"], f"{at}.config")
    _provenance(f"{at}.provenance", row["provenance"])
    rows.append((largest, config))
  return tuple(rows)


def _routing(where, value):
  _keys(where, value, ("about", "ranges", "provenance"))
  _keys(f"{where}.ranges", value["ranges"], (), [m.value for m in DotMode])
  _provenance(f"{where}.provenance", value["provenance"])
  routing = {}
  for mode, ranges in value["ranges"].items():
    at, parsed = f"{where}.ranges.{mode}", []
    if not isinstance(ranges, list):
      _fail(at, "expected a list of [first S, last S or null]")
    for j, pair in enumerate(ranges):
      if not (isinstance(pair, list) and len(pair) == 2):
        _fail(f"{at}[{j}]", f"expected [first S, last S or null], got {pair!r}")
      lo = _int(f"{at}[{j}][0]", pair[0])
      hi = None if pair[1] is None else _int(f"{at}[{j}][1]", pair[1], minimum=lo)
      parsed.append((lo, hi))
    routing[DotMode(mode)] = tuple(parsed)
  return routing


def load_tables(path=None) -> Tables:
  """Parses a tuned-config file (default: this package's configs/CONFIG_FILE), or raises
  ConfigFileError naming the file and the place in it that is malformed."""
  source = (importlib.resources.files(__package__) / "configs" / CONFIG_FILE
            if path is None else path)
  try:
    with open(source, encoding="utf-8") if isinstance(source, str) else source.open(
        encoding="utf-8") as f:
      document = json.load(f)
    _keys("top level", document,
          ("gpu", "about", "hidden", "intermediate", "jax", "tables", "routing"))
    _keys("tables", document["tables"], TABLE_NAMES)
    _keys("routing", document["routing"], ROUTING_NAMES)
    tables = {name: _rows(f"tables.{name}", document["tables"][name],
                          nullable=name == "tf32_on_f16") for name in TABLE_NAMES}
    routing = {name: _routing(f"routing.{name}", document["routing"][name])
               for name in ROUTING_NAMES}
  except ConfigFileError as e:
    raise ConfigFileError(f"{source}: {e}") from None
  except json.JSONDecodeError as e:
    raise ConfigFileError(f"{source}: not JSON: {e}") from None
  return Tables(document["gpu"], tables, routing, document)


TABLES = load_tables()


def default_config(problem: Problem) -> Config:
  """The measured Config for `problem`: 16-bit operands or inputs take the sixteen_bit
  table, HIGHEST and BF16X3 three_pass, TF32 tf32_on_f16 where it has a row, and the
  other 32-bit modes thirty_two_bit."""
  rows = TABLES.tables
  if problem.mode.operand_dtype is not None or problem.dtype.itemsize == 2:
    table = rows["sixteen_bit"]
  elif problem.mode in BF16X3_MODES:
    table = rows["three_pass"]
  else:
    if problem.mode == DotMode.TF32 and _row(rows["tf32_on_f16"], problem.tokens) is not None:
      return _row(rows["tf32_on_f16"], problem.tokens)
    table = rows["thirty_two_bit"]
  return _row(table, problem.tokens)


def _row(table, tokens):
  for largest, config in table:
    if largest is None or tokens <= largest:
      return config
  raise AssertionError("unreachable: the last row takes every S")


def interpret_config(problem: Problem) -> Config:
  """Small tiles for Pallas interpret mode on the CPU (many ragged edges, fast to run)."""
  del problem
  tile = TileConfig(16, 32, 16)
  return Config(tile, tile, TileConfig(16, 32, 16, split_k=2))


# Where the automatic choice takes the Triton kernels over XLA: per DotMode, the
# S ranges where they measured at least 8% faster than XLA at the same
# precision in the same run, for fp32 inputs and for bf16/f16 inputs (whose
# default precision runs as BF16 / F16, `precision.for_inputs`). Ties (within
# the ~5% run-to-run spread) go to XLA; so do modes not listed.
TRITON_WINS: dict[DotMode, Ranges] = TABLES.routing["fp32_inputs"]
TRITON_WINS_ON_16_BIT_INPUTS: dict[DotMode, Ranges] = TABLES.routing["sixteen_bit_inputs"]


def triton_wins(problem: Problem) -> bool:
  """Whether the Triton kernels measured faster than XLA for this S, mode and input dtype."""
  table = TRITON_WINS if problem.dtype.itemsize == 4 else TRITON_WINS_ON_16_BIT_INPUTS
  return in_ranges(problem.tokens, table.get(problem.mode, ()))
