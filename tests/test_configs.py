"""The tuned tables and routing are data: vision_mlp_bwd/backends/triton/configs/h200.json.

The file must parse into the Configs the tables held as Python literals before
(rows checked field by field here; the lowering of every row for CUDA was
compared hash for hash when they moved, benchmarks/NOTES.md 28), every row must
survive a round trip through its JSON form, every result file its provenance
cites must be in the repository (with the commit the file itself records, where
it records one), and a malformed file must fail with a message that says where.
tests/test_routing.py holds the routing to the committed measurements.
"""

from __future__ import annotations

import copy
import fnmatch
import json
import pathlib
import re
import tomllib

import jax.numpy as jnp
import pytest

from benchmarks import cases
from vision_mlp_bwd.backends.triton import config
from vision_mlp_bwd.backends.triton.config import (
    Config, ConfigFileError, TileConfig as T, config_as_dict, config_from_dict, default_config,
    load_tables)
from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem
from tests import helpers

REPO = pathlib.Path(__file__).resolve().parents[1]
FILE = REPO / "vision_mlp_bwd/backends/triton/configs" / config.CONFIG_FILE
DOCUMENT = json.loads(FILE.read_text())
F32, BF16, F16 = (jnp.dtype(d) for d in (jnp.float32, jnp.bfloat16, jnp.float16))


def test_the_package_reads_this_file():
  assert config.TABLES.document == DOCUMENT and config.TABLES.gpu == "NVIDIA H200"
  assert (DOCUMENT["hidden"], DOCUMENT["intermediate"]) == (cases.HIDDEN, cases.INTERMEDIATE)


def test_the_rows_are_the_tables_the_code_held():
  """Row bounds of every table, and rows field by field, as the literals of commit 1a950ee."""
  bounds = {name: [largest for largest, _ in rows] for name, rows in config.TABLES.tables.items()}
  assert bounds == {"sixteen_bit": [64, 128, 144, 160, 224, 256, 1024, None],
                    "thirty_two_bit": [64, 128, 160, 224, 256, None],
                    "tf32_on_f16": [64, 128, 144, 160, 224, 256, None],
                    "three_pass": [64, 128, 256, None]}
  problem = lambda s, mode, dtype=F32: Problem(s, 1280, 3584, dtype, mode)
  expected = {
      problem(131, DotMode.F16): Config(
          T(128, 32, 64, num_stages=4, tail_m=16), T(128, 128, 64),
          T(256, 64, 64, split_k=4, num_stages=4), cast_inputs=True, fused_casts=True,
          mosaic_launch_1=True),
      problem(211, DotMode.TF32): Config(
          T(256, 64, 64, num_warps=8, num_stages=4), T(128, 128, 32), T(128, 64, 32, split_k=4),
          cast_inputs=True, sum_splits_in_kernel=True, tf32_on_f16=True),
      problem(64, DotMode.TF32): Config(   # no TF32-on-f16 row: the fp32-operand one
          T(32, 64, 64, num_stages=4), T(128, 64, 64), T(32, 128, 32, split_k=8)),
      problem(256, DotMode.F32): Config(
          T(32, 256, 32), T(128, 64, 32), T(32, 256, 16, split_k=4, num_warps=2),
          k_major_weight_grads=True),
      problem(4096, DotMode.HIGHEST): Config(*[T(128, 128, 32, num_warps=8)] * 3),
      problem(4096, DotMode.BF16X3): Config(*[T(128, 128, 32, num_warps=8)] * 3),
      problem(997, DotMode.BF16): Config(
          T(128, 128, 64, num_warps=8), T(128, 64, 64), T(128, 64, 64, split_k=2),
          cast_inputs=True, cast_weights=True),
      problem(64, DotMode.TF32, BF16): Config(   # 16-bit inputs: the 16-bit table
          T(64, 32, 128), T(64, 128, 64), T(64, 128, 64, split_k=8)),
  }
  for p, want in expected.items():
    assert default_config(p) == want, p
  # The one row of 32-bit modes beyond S=256, every field.
  got = default_config(problem(1163, DotMode.TF32))
  assert (got.pre_activation, got.weight_grads, got.input_grad) == (
      T(32, 128, 32, split_k=1, num_warps=4, num_stages=3, tail_m=0),
      T(128, 64, 64, split_k=1, num_warps=4, num_stages=3, tail_m=0),
      T(32, 128, 32, split_k=1, num_warps=4, num_stages=3, tail_m=0))
  assert not any((got.cast_inputs, got.cast_weights, got.fused_casts, got.k_major_weight_grads,
                  got.sum_splits_in_kernel, got.tf32_on_f16, got.mosaic_launch_1))
  rows = config.TABLES.tables["tf32_on_f16"]
  assert rows[0][1] is None and rows[-1][1] is None


def test_every_row_round_trips_through_its_json_form():
  for name, table in DOCUMENT["tables"].items():
    for row, (largest, parsed) in zip(table["rows"], config.TABLES.tables[name], strict=True):
      assert row["max_tokens"] == largest
      if parsed is None:
        assert row["config"] is None and name == "tf32_on_f16"
        continue
      # The file names only what differs from the defaults, and nothing is lost either way.
      assert config_as_dict(parsed) == row["config"], (name, largest)
      assert config_from_dict(config_as_dict(parsed)) == parsed


def test_the_routing_is_the_files():
  for name, table in (("fp32_inputs", config.TRITON_WINS),
                      ("sixteen_bit_inputs", config.TRITON_WINS_ON_16_BIT_INPUTS)):
    ranges = DOCUMENT["routing"][name]["ranges"]
    assert table == {DotMode(m): tuple(map(tuple, r)) for m, r in ranges.items()}
  assert config.TRITON_WINS[DotMode.HIGHEST] == ((1, 64), (289, None))
  assert config.triton_wins(Problem(4096, 1280, 3584, F32, DotMode.HIGHEST))
  assert not config.triton_wins(Problem(4096, 1280, 3584, F16, DotMode.F16))


def _provenances():
  for name, table in DOCUMENT["tables"].items():
    for row in table["rows"]:
      yield f"tables.{name} <= {row['max_tokens']}", row["provenance"]
  for name, routing in DOCUMENT["routing"].items():
    yield f"routing.{name}", routing["provenance"]


def test_every_provenance_result_exists_and_agrees_with_its_file():
  notes = (REPO / "benchmarks/NOTES.md").read_text()
  sections = {int(n) for n in re.findall(r"^### (\d+)\.", notes, re.M)}
  missing, disagreeing = [], []
  for where, provenance in _provenances():
    assert set(provenance["notes"]) <= sections, (where, provenance["notes"])
    for result in provenance["results"]:
      path = REPO / result["path"]
      if not path.is_file():
        missing.append(f"{where}: {result['path']}")
        continue
      recorded = helpers.recorded_commit(path)
      if recorded and not (result["commit"] and recorded.startswith(result["commit"])):
        disagreeing.append(f"{where}: {result['path']} records {recorded}, the file says "
                           f"{result['commit']}")
  assert not missing, "cited, but not in the repository:\n" + "\n".join(missing)
  assert not disagreeing, "\n".join(disagreeing)
  # Every table row that ran in a whole-backward run names it (not only the probe that chose it).
  for name, table in DOCUMENT["tables"].items():
    for row in table["rows"]:
      if row["config"] is not None:
        assert row["provenance"]["results"], (name, row["max_tokens"])


def test_a_non_editable_install_carries_the_file():
  pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
  patterns = pyproject["tool"]["setuptools"]["package-data"]["vision_mlp_bwd.backends.triton"]
  assert any(fnmatch.fnmatch(f"configs/{config.CONFIG_FILE}", p) for p in patterns), patterns


def _broken(tmp_path, change):
  document = copy.deepcopy(DOCUMENT)
  change(document)
  path = tmp_path / "broken.json"
  path.write_text(json.dumps(document))
  return str(path)


def _row(document, table="sixteen_bit", index=2):
  return document["tables"][table]["rows"][index]


@pytest.mark.parametrize("change,message", [
    (lambda d: _row(d)["config"]["pre_activation"].update(tiles_per_program=2),
     r"tables\.sixteen_bit\.rows\[2\]\.config\.pre_activation: .*unknown \['tiles_per_program'\]"),
    (lambda d: _row(d)["config"].update(group_launches=True),
     r"rows\[2\]\.config: .*unknown \['group_launches'\]"),
    (lambda d: _row(d)["config"]["input_grad"].pop("block_k"),
     r"rows\[2\]\.config\.input_grad: missing \['block_k'\]"),
    (lambda d: _row(d)["config"]["input_grad"].update(split_k=True),
     r"config\.input_grad\.split_k: expected an integer >= 1, got True"),
    (lambda d: _row(d)["config"]["pre_activation"].update(block_m=96),
     r"config\.pre_activation: TileConfig\.block_m=96: Triton needs a power of 2"),
    (lambda d: _row(d)["config"].update(cast_inputs=1),
     r"config\.cast_inputs: expected true or false, got 1"),
    (lambda d: _row(d).update(config=None),
     r"rows\[2\]\.config: null .* only in tf32_on_f16"),
    (lambda d: _row(d).update(max_tokens=100),
     r"rows\[2\]\.max_tokens: 100 does not grow past the row before \(128\)"),
    (lambda d: _row(d, index=-1).update(max_tokens=4096),
     r"rows\[7\]\.max_tokens: the last row, and only it, has max_tokens null"),
    (lambda d: d["tables"].pop("three_pass"), r"tables: missing \['three_pass'\]"),
    (lambda d: _row(d)["provenance"]["results"][0].update(commit="not-a-commit"),
     r"provenance\.results\[0\]\.commit: expected a commit"),
    (lambda d: _row(d)["provenance"]["results"][0].update(path="benchmarks/NOTES.md"),
     r"provenance\.results\[0\]\.path: expected a path under benchmarks/results/"),
    (lambda d: d["routing"]["fp32_inputs"]["ranges"].update(tf33=[[1, 64]]),
     r"routing\.fp32_inputs\.ranges: .*unknown \['tf33'\]"),
    (lambda d: d["routing"]["fp32_inputs"]["ranges"].update(tf32=[[64, 1]]),
     r"routing\.fp32_inputs\.ranges\.tf32\[0\]\[1\]: expected an integer >= 64, got 1"),
], ids=lambda v: v if isinstance(v, str) else "")
def test_a_malformed_file_fails_saying_where(tmp_path, change, message):
  path = _broken(tmp_path, change)
  with pytest.raises(ConfigFileError, match=message) as error:
    load_tables(path)
  assert str(error.value).startswith(path)


def test_a_file_that_is_not_json_fails_loudly(tmp_path):
  path = tmp_path / "h200.json"
  path.write_text('{"gpu": "NVIDIA H200",')
  with pytest.raises(ConfigFileError, match="not JSON"):
    load_tables(str(path))
  assert load_tables(str(FILE)).tables == config.TABLES.tables
