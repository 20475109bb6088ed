"""The Mosaic backend (backends/mosaic): where it runs, what it refuses, and that it lowers.

Its numbers are held on the GPU (tests/test_gpu.py: bounds at ragged S, determinism);
here the whole backward is lowered for CUDA without a GPU at S that leave a tail in
every block dimension, which also runs Mosaic's layout inference and its shared-memory
check.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from vision_mlp_bwd import precision
from vision_mlp_bwd.backends import mosaic
from vision_mlp_bwd.backends.mosaic import backward_sm90 as mosaic_backward
from vision_mlp_bwd.backends.shared import in_ranges
from vision_mlp_bwd.precision import DotMode
from vision_mlp_bwd.problem import Problem
from tests import bounds, helpers

needs_lowering = pytest.mark.skipif(not helpers.cuda_lowering_without_gpu(),
                                    reason="this JAX lowers for CUDA only on a GPU")
H, I = 1280, 3584
MODES = [(jnp.float32, DotMode.F16), (jnp.float32, DotMode.BF16), (jnp.bfloat16, DotMode.BF16),
         (jnp.float16, DotMode.F16), (jnp.bfloat16, DotMode.F16), (jnp.float32, DotMode.TF32)]


def _problem(tokens, dtype=jnp.float32, mode=DotMode.F16, hidden=H, intermediate=I):
  return Problem(tokens, hidden, intermediate, jnp.dtype(dtype), mode)


def _abstract_inputs(tokens, dtype):
  """The backward's eight inputs at full size, as shapes for tracing and lowering."""
  shapes = [(tokens, H), (tokens, H), (I, H), (I,), (H, I), (H,), (tokens, I), (tokens, I)]
  return [jax.ShapeDtypeStruct(shape, dtype) for shape in shapes]


# Every input and mode at S=2500 (ragged blocks); S=7 (padded rows) and 8192 (the tables'
# configs above S=4096) once per table: fp32_inputs, sixteen_bit_inputs, tf32_on_f16.
TABLE_MODES = [(jnp.float32, DotMode.F16), (jnp.bfloat16, DotMode.BF16),
               (jnp.float32, DotMode.TF32)]
LOWERING_CASES = [*((2500, *m) for m in MODES),
                  *((tokens, *m) for tokens in (7, 8192) for m in TABLE_MODES),
                  (600, jnp.float32, DotMode.F16),    # the pre-GELU product as XLA's dot
                  (293, jnp.float32, DotMode.F16)]    # its launch copying with copy programs


@needs_lowering
@pytest.mark.parametrize("tokens, dtype, mode", LOWERING_CASES,
                         ids=lambda v: getattr(v, "name", str(v)))
def test_the_whole_backward_lowers_with_the_tables_products(tokens, dtype, mode):
  args = _abstract_inputs(tokens, dtype)
  problem = _problem(tokens, dtype, mode)
  lowered = jax.jit(lambda *a: mosaic.backward(*a, problem=problem)).trace(*args).lower(
      lowering_platforms=("cuda",))
  assert [(o.shape, o.dtype) for o in lowered.out_info] == [
      ((tokens, H), dtype), ((I, H), dtype), ((I,), dtype), ((H, I), dtype), ((H,), dtype)]
  text = lowered.as_text()
  pre, rows, weights = mosaic_backward.TABLES.configs(problem)
  on_xla = ((pre is mosaic_backward.XLA_DOT) + (rows is mosaic_backward.XLA_DOT)
            + 2 * (weights is mosaic_backward.XLA_DOT))
  assert text.count("mosaic_gpu") >= 4 - on_xla, "expected the engine's products"
  assert text.count("stablehlo.dot_general") == on_xla, "the tables' XLA dots, and no other"
  if rows is mosaic_backward.XLA_DOT and weights is mosaic_backward.XLA_DOT:
    assert "stablehlo.slice" not in text, "the pre-GELU gradient cut back to S rows by a copy"


# Tables other than the GPU's, which a GPU test or a benchmark variant runs: the fused
# product's side copies by a ping-pong copy warpgroup (F16), and DEFAULT's fused product
# (scales, line maxima, speculated copies) run ping-pong, its scaled side copies by copy
# programs or by a copy warpgroup.
VARIANT_TABLES = {
    "copy warpgroup": (DotMode.F16, helpers.copy_warpgroup_tables),
    "DEFAULT ping-pong": (DotMode.TF32, helpers.tf32_ping_pong_tables),
    "DEFAULT ping-pong, copy warpgroup": (DotMode.TF32, functools.partial(
        helpers.tf32_ping_pong_tables, copy_warpgroup=True))}


@needs_lowering
@pytest.mark.parametrize("variant, tokens", [("copy warpgroup", 3333),
                                             ("copy warpgroup", 8192),
                                             ("DEFAULT ping-pong", 5003),
                                             ("DEFAULT ping-pong, copy warpgroup", 8192)])
def test_the_backward_lowers_with_variant_tables(variant, tokens):
  """The whole backward lowers at full size with each of `VARIANT_TABLES` (Mosaic's own
  shared-memory count refuses a kernel that does not fit), every product on the engine or
  the tables' XLA dots."""
  mode, variant_tables = VARIANT_TABLES[variant]
  args = _abstract_inputs(tokens, jnp.float32)
  problem = _problem(tokens, jnp.float32, mode)
  tables = variant_tables(tokens)
  assert tables.configs(problem)[0].ping_pong
  lowered = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, tables=tables)
                    ).trace(*args).lower(lowering_platforms=("cuda",))
  assert [o.shape for o in lowered.out_info] == [(tokens, H), (I, H), (I,), (H, I), (H,)]
  assert lowered.as_text().count("mosaic_gpu") >= 4


INPUTS_MODES = {"fp32_inputs": (jnp.float32, DotMode.F16), "tf32_on_f16": (jnp.float32, DotMode.TF32),
                "sixteen_bit_inputs": (jnp.bfloat16, DotMode.BF16)}


@needs_lowering
@pytest.mark.parametrize("path", mosaic_backward.GPU_FILES, ids=lambda p: p.name)
def test_each_gpu_files_table_entries_lower_at_full_size(path):
  """Another GPU's table entries fit an sm_90 block (JAX 0.10.2's Mosaic lowering counts
  the shared memory): the whole backward lowers with that GPU's tables at S = 7, 2500
  and 8192 for the inputs each entry serves."""
  import json
  document = json.loads(path.read_text())
  tables = mosaic_backward.load_gpu_tables([path])[document["gpu"]]
  for inputs in document.get("tables", {}):
    dtype, mode = INPUTS_MODES[inputs]
    for tokens in (7, 2500, 8192):
      args = _abstract_inputs(tokens, dtype)
      problem = _problem(tokens, dtype, mode)
      text = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, tables=tables)
                     ).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text, (inputs, tokens)


@needs_lowering
@pytest.mark.parametrize("tokens", [7, 2500])
def test_bf16x3_lowers_to_four_xla_dots_over_the_pieces(tokens):
  """HIGHEST at full size: the staging launches (Pallas-Triton, lowered for CUDA) and four
  XLA dots of bf16 pieces with K three times as long, nothing else multiplying."""
  args = _abstract_inputs(tokens, jnp.float32)
  problem = _problem(tokens, jnp.float32, DotMode.HIGHEST)
  lowered = jax.jit(lambda *a: mosaic.backward(*a, problem=problem)).trace(*args).lower(
      lowering_platforms=("cuda",))
  assert [(o.shape, o.dtype) for o in lowered.out_info] == [
      ((tokens, H), jnp.float32), ((I, H), jnp.float32), ((I,), jnp.float32),
      ((H, I), jnp.float32), ((H,), jnp.float32)]
  text = lowered.as_text()
  dots = [line for line in text.splitlines() if "stablehlo.dot_general" in line]
  assert len(dots) == 4 and all("bf16" in line for line in dots), dots
  assert "mosaic_gpu" not in text


@pytest.mark.parametrize("dtype, mode", [*TABLE_MODES, (jnp.float32, DotMode.HIGHEST)],
                         ids=lambda v: getattr(v, "name", str(v)))
def test_the_backward_closes_over_no_constants(dtype, mode):
  """The sharding layer wraps the backward in `custom_partitioning`, which refuses a traced
  function with closed-over constants (JAX 0.11 makes them of arrays built from no input)."""
  tokens = 65
  args = _abstract_inputs(tokens, dtype)
  problem = _problem(tokens, dtype, mode)
  assert not jax.make_jaxpr(lambda *a: mosaic.backward(*a, problem=problem))(*args).consts


def test_it_runs_16_bit_products_on_hopper_only_and_says_why_not():
  backend = mosaic.BACKEND
  assert "32 bits" not in backend.unsupported_reason(_problem(64, mode=DotMode.TF32), "gpu")
  assert "32 bits" in backend.unsupported_reason(_problem(64, jnp.bfloat16, DotMode.TF32), "gpu")
  assert "32 bits" in backend.unsupported_reason(_problem(64, jnp.bfloat16, DotMode.F32), "gpu")
  assert "32 bits" in backend.unsupported_reason(_problem(64, mode=DotMode.F32), "gpu")
  for mode in (DotMode.HIGHEST, DotMode.BF16X3):   # bf16x3 on the same 16-bit products
    assert "32 bits" not in backend.unsupported_reason(_problem(64, mode=mode), "gpu")
  assert "H=1000 is not a multiple of 64" in backend.unsupported_reason(
      _problem(64, hidden=1000), "gpu")
  assert "I=4304 is not a multiple of 64" in backend.unsupported_reason(
      _problem(64, intermediate=4304), "gpu")
  assert "Hopper" in backend.unsupported_reason(_problem(64), "cpu")
  assert backend.unsupported_reason(_problem(64, jnp.bfloat16, DotMode.BF16), "cpu") == (
      backend.unsupported_reason(_problem(64), "cpu"))


def test_it_is_preferred_only_where_its_routing_says():
  backend = mosaic.BACKEND
  assert backend.preferred(_problem(4096), "gpu") and not backend.preferred(_problem(256), "gpu")
  assert backend.preferred(_problem(4096, mode=DotMode.BF16), "gpu")
  assert not backend.preferred(_problem(292, mode=DotMode.BF16), "gpu")   # not measured
  assert backend.preferred(_problem(384, jnp.bfloat16, DotMode.BF16), "gpu")
  assert not backend.preferred(_problem(768, jnp.bfloat16, DotMode.BF16), "gpu")

def test_a_gpu_with_a_routing_of_its_own_is_routed_by_it(monkeypatch, tmp_path):
  """On a GPU whose device kind has a config file, its pairs of input dtype and mode
  replace the H200's; the others keep the H200's; another GPU gets the H200's."""
  backend = mosaic.BACKEND
  path = tmp_path / "other.json"
  path.write_text('{"gpu": "%s", "routing": {"float32": {"f16": [[1024, null]]}}}'
                  % jax.devices()[0].device_kind)
  monkeypatch.setattr(mosaic_backward, "GPU_TABLES", mosaic_backward.load_gpu_tables([path]))
  assert backend.preferred(_problem(10 ** 6), "gpu")
  assert not backend.preferred(_problem(512), "gpu")   # the H200 takes it from 293
  assert backend.preferred(_problem(4096, jnp.bfloat16, DotMode.BF16), "gpu")   # kept
  assert backend.preferred(_problem(4096, mode=DotMode.BF16), "gpu")
  monkeypatch.setattr(mosaic_backward, "GPU_TABLES", {"another GPU": mosaic_backward.TABLES})
  assert backend.preferred(_problem(512), "gpu")
  h100 = mosaic_backward.load_gpu_tables()["NVIDIA H100 80GB HBM3"].routing
  assert h100["bfloat16"]["bf16"] != mosaic_backward.TABLES.routing["bfloat16"]["bf16"]
  assert h100["float32"] == mosaic_backward.TABLES.routing["float32"]


def test_a_gpu_with_tables_of_its_own_runs_them(monkeypatch, tmp_path):
  """A GPU file's (inputs, product) entries replace the H200's for that pair alone, and
  `backward` runs the tables of the GPU it runs on."""
  path = tmp_path / "other.json"
  kind = jax.devices()[0].device_kind
  path.write_text('{"gpu": "%s", "routing": {}, "tables": {"sixteen_bit_inputs": {"pre_gelu": '
                  '[[2048, {"stages": 5}], [null, {"stages": 3, "chained": true}]]}}}' % kind)
  h200 = mosaic_backward.TABLES
  other = mosaic_backward.load_gpu_tables([path])[kind]
  for tokens, stages in ((1536, 5), (2048, 5), (2049, 3)):
    pre, rows, weights = other.configs(_problem(tokens, jnp.bfloat16, DotMode.BF16))
    assert pre.stages == stages and pre.block == (128, 256)
    assert (rows, weights) == h200.configs(_problem(tokens, jnp.bfloat16, DotMode.BF16))[1:]
  for mode in (DotMode.F16, DotMode.TF32):   # other inputs keep the H200's entries
    assert other.configs(_problem(2048, mode=mode)) == h200.configs(_problem(2048, mode=mode))
  assert other.routing == h200.routing
  used = []

  def recording_configs(self, problem):
    used.append(self)
    raise RuntimeError("recorded")
  monkeypatch.setattr(mosaic_backward.Tables, "configs", recording_configs)
  monkeypatch.setattr(mosaic_backward, "GPU_TABLES", {kind: other})
  inputs = [jnp.ones((8, 64), jnp.bfloat16)] * 8
  with pytest.raises(RuntimeError, match="recorded"):
    mosaic_backward.backward(*inputs, problem=_problem(8, jnp.bfloat16, DotMode.BF16))
  assert used == [other]


ROUTED_FILES = (mosaic_backward.CONFIG_FILE, *mosaic_backward.GPU_FILES)


def _routing_runs(path):
  """The input-dtype runs a config file's routing cites, merged: {(inputs, S):
  {implementation: µs}}, `inputs` a column label's prefix ("fp32 in, F16", "fp32 in,
  DEFAULT", "bf16 in", ...)."""
  import json
  import pathlib
  document = json.loads(path.read_text())
  paths = [r["path"] for r in document["provenance"]["results"] if "routing" in r["what"]]
  times = {}
  for path in paths:
    rows = json.loads((pathlib.Path(__file__).resolve().parents[1] / path).read_text())["rows"]
    for r in rows:
      for label, us in r.items():
        if " in" in label:
          inputs, implementation = label.rsplit(", ", 1)
          times.setdefault((inputs, r["seq_len"]), {})[implementation] = us
  return times


@pytest.mark.parametrize("path", ROUTED_FILES, ids=lambda p: p.name)
@pytest.mark.parametrize("dtype, mode, inputs", [(jnp.float32, DotMode.F16, "fp32 in, F16"),
                                                 (jnp.float32, DotMode.BF16, "fp32 in, BF16"),
                                                 (jnp.float32, DotMode.TF32, "fp32 in, DEFAULT"),
                                                 (jnp.bfloat16, DotMode.BF16, "bf16 in"),
                                                 (jnp.float16, DotMode.F16, "f16 in"),
                                                 (jnp.float32, DotMode.HIGHEST,
                                                  "fp32 in, HIGHEST"),
                                                 (jnp.float32, DotMode.BF16X3, "fp32 in, HIGH")])
def test_routing_holds_to_the_measurements_it_cites(path, dtype, mode, inputs):
  """In each config file, the routing takes the backend only where it measured faster than
  every other implementation in the runs that file cites (fp32 inputs under F16, BF16,
  DEFAULT, HIGHEST and HIGH, 16-bit inputs at the default precision; another GPU's file
  only the pairs it lists), and each routed range ends at measured S."""
  import json
  ranges = json.loads(path.read_text())["routing"].get(jnp.dtype(dtype).name, {}).get(
      mode.value)
  if ranges is None and path != mosaic_backward.CONFIG_FILE:
    pytest.skip(f"{path.name} keeps {mosaic_backward.CONFIG_FILE.name}'s routing of {inputs}")
  runs = _routing_runs(path)
  measured = {tokens for name, tokens in runs if name == inputs}
  assert measured, f"no cited run measured {inputs}"
  for (name, tokens), times in runs.items():
    if name != inputs:
      continue
    others = min(us for label, us in times.items() if label not in ("mosaic", "auto"))
    routed = in_ranges(tokens, ranges)
    assert routed == (times["mosaic"] < others), (inputs, tokens, times)
  for lo, hi in ranges:
    assert lo in measured and hi in measured


@pytest.mark.parametrize("path", mosaic_backward.GPU_FILES, ids=lambda p: p.name)
def test_a_gpu_files_table_entries_hold_to_the_measurements_they_cite(path):
  """Each (inputs, product) entry of another GPU's file was the fastest variant, on that
  GPU, at every S of the `backward_configs` runs it cites for that pair (the configs the
  rows record; in older files, their variants over the H200's config at that S), and
  every row it lists was measured."""
  import json
  import pathlib
  from benchmarks.backward_configs import recorded_config
  repo = pathlib.Path(__file__).resolve().parents[1]
  document = json.loads(path.read_text())
  ours = mosaic_backward.load_gpu_tables([path])[document["gpu"]]
  h200 = mosaic_backward.TABLES
  for inputs, products in document.get("tables", {}).items():
    for product in products:
      runs = [json.loads((repo / r["path"]).read_text())
              for r in document["provenance"]["results"] if r["path"].endswith(".json")]
      runs = [run for run in runs if run.get("table") == inputs
              and run.get("product") == product and run["device"] == document["gpu"]]
      assert runs, f"{path.name} cites no run of {inputs} {product} on {document['gpu']}"
      measured = set()
      for run in runs:
        for tokens in {row["seq_len"] for row in run["rows"]}:
          entry = ours.config_for(getattr(ours, product), inputs, tokens)
          base = h200.config_for(getattr(h200, product), inputs, tokens)
          times = {}
          for row in run["rows"]:
            if row["seq_len"] == tokens:
              config = recorded_config(row, base)
              times[config] = min(row["median_us"], times.get(config, float("inf")))
          assert entry in times, (inputs, product, tokens, entry)
          assert times[entry] == min(times.values()), (inputs, product, tokens, times)
          measured.add(entry)
      for _, config in getattr(ours, product)[inputs]:
        assert config in measured, (inputs, product, config)


XLA = "xla"


@pytest.mark.parametrize("tokens, dtype, mode, rows_block, weight_block", [
    (768, jnp.float32, DotMode.TF32, (128, 128), (128, 128)),
    (769, jnp.float32, DotMode.TF32, (128, 128), (128, 128)),
    *((tokens, dtype, DotMode.F16 if dtype == jnp.float32 else DotMode.BF16,
       XLA, block)
      for dtype in (jnp.float32, jnp.bfloat16)
      for tokens, block in ((64, XLA), (4096, XLA), (4097, (128, 256)), (16384, (128, 256))))])
def test_configs_by_s_from_the_file(tokens, dtype, mode, rows_block, weight_block):
  """The tables' rows by S ("xla": XLA's dot), and the fused product always on the engine."""
  pre, rows, weights = mosaic_backward.TABLES.configs(_problem(tokens, dtype, mode))
  block = lambda c: XLA if c is mosaic_backward.XLA_DOT else c.block
  assert (block(rows), block(weights)) == (rows_block, weight_block)
  assert isinstance(pre, mosaic_backward.engine.GemmConfig)
  if jnp.dtype(dtype).itemsize == 2:
    # 16-bit outputs store 64-column (128-byte) epilogue pieces.
    width = min(c.epilogue_tile[1] for c in (pre, rows, weights)
                if c is not mosaic_backward.XLA_DOT) * jnp.dtype(dtype).itemsize
    assert width >= 128


@pytest.mark.parametrize("path", ROUTED_FILES, ids=lambda p: p.name)
def test_its_config_files_cite_results_commits_and_notes_that_exist(path):
  import json
  import pathlib
  import re
  repo = pathlib.Path(__file__).resolve().parents[1]
  document = json.loads(path.read_text())
  sections = {int(n) for n in re.findall(r"^### (\d+)\.",
                                         (repo / "benchmarks/NOTES.md").read_text(), re.M)}
  assert set(document["provenance"]["notes"]) <= sections
  for result in document["provenance"]["results"]:
    path = repo / result["path"]
    assert path.is_file(), result["path"]
    assert helpers.recorded_commit(path).startswith(result["commit"]), result["path"]
    if "routing" in result["what"]:   # measured on the GPU the file routes
      assert json.loads(path.read_text())["device"] == document["gpu"], result["path"]


def _jnp_engine(a, b, *, transpose_a=False, out_dtype=jnp.float32, epilogue=None,
                epilogue_operand=None, column_sums=None, line_maxima=False, row_scale=None,
                col_scale=None, partial_reductions=False, out_rows=None, speculated_copies=0,
                copy_scale=None, side_copies=(), **_):
  """`engine.matmul`'s contract in jnp (float32-exact products of its 16-bit operands;
  partial reductions as one part each)."""
  if side_copies:
    copies = []
    for x, rows, *scale in side_copies:   # scaled: (copy, its column maxima as one part)
      copy = jnp.pad(x, ((0, max(rows - x.shape[0], 0)), (0, 0)))[:rows]
      copies.append((precision.scaled_f16_operand(copy, scale[0][0]),
                     jnp.max(precision.finite_abs(x), axis=0, keepdims=True)) if scale
                    else copy.astype(a.dtype))
    copies = tuple(copies)
    return _jnp_engine(a, b, transpose_a=transpose_a, out_dtype=out_dtype, epilogue=epilogue,
                       epilogue_operand=epilogue_operand, column_sums=column_sums,
                       line_maxima=line_maxima, row_scale=row_scale, col_scale=col_scale,
                       partial_reductions=partial_reductions, out_rows=out_rows,
                       speculated_copies=speculated_copies, copy_scale=copy_scale), copies
  acc = jnp.matmul((a.T if transpose_a else a).astype(jnp.float32), b.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  if row_scale is not None:
    acc = acc * row_scale[:, None] * col_scale[None, :]
  value = acc
  if epilogue is not None:
    rows = acc.shape[0] - epilogue_operand.shape[0]
    value = epilogue(acc, jnp.pad(epilogue_operand, ((0, rows), (0, 0))))
  out = value.astype(out_dtype or jnp.float32)[:out_rows]   # (out_dtype=None: not returned)
  extra = ()
  if column_sums:
    extra += (jnp.sum(value if column_sums == "unrounded" else out.astype(jnp.float32), 0),)
  if line_maxima:
    extra += (jnp.max(jnp.abs(value), 0), jnp.max(jnp.abs(value), 1))
  if partial_reductions:
    extra = tuple(x[None] for x in extra)
  copies = ((precision.scaled_f16_operand(value, copy_scale)[:out_rows],) * speculated_copies
            if speculated_copies else ())
  stored = () if out_dtype is None else (out,)
  return (*stored, *copies, *extra) if extra or copies else out


@pytest.mark.transcendental
@pytest.mark.parametrize("dtype, precision, pre_gelu_on_xla, beside", [
    (jnp.float32, jax.lax.DotAlgorithmPreset.F16_F16_F32, False, None),
    (jnp.float32, jax.lax.DotAlgorithmPreset.F16_F16_F32, False, "programs"),
    (jnp.float32, jax.lax.DotAlgorithmPreset.F16_F16_F32, False, "warpgroup"),
    (jnp.float32, jax.lax.DotAlgorithmPreset.F16_F16_F32, True, None),
    (jnp.bfloat16, None, False, None)],
    ids=["fp32-f16", "fp32-f16-copy-programs", "fp32-f16-copy-warpgroup",
         "fp32-f16-pre-gelu-on-xla", "bf16"])
def test_plain_products_as_xla_dots_within_bounds(monkeypatch, dtype, precision,
                                                  pre_gelu_on_xla, beside):
  """Where the tables give XLA_DOT, the input and weight gradients are XLA's dots of the
  staged operands (the fused product a jnp stand-in for the engine, or on fp32 inputs
  XLA's dot too, and the staging pass of the GELU derivative): every output within its
  bound at an S not a multiple of 8, and no copy only to pad what only XLA reads. With
  copy programs or a ping-pong copy warpgroup, the fused product's launch makes the
  copies the later products read."""
  side = []

  def engine_recording_side_copies(*args, side_copies=(), **kwargs):
    side.extend((x.shape, rows) for x, rows in side_copies)
    return _jnp_engine(*args, side_copies=side_copies, **kwargs)
  monkeypatch.setattr(mosaic_backward.engine, "matmul", engine_recording_side_copies)
  staged, launch = [], mosaic_backward.staging.launch

  def recording_launch(pairs, **kwargs):
    staged.extend((job.shape, job.out_rows) for job, _ in pairs if getattr(job, "copies", 0))
    return launch(pairs, **kwargs)
  monkeypatch.setattr(mosaic_backward.staging, "launch", recording_launch)
  xla = {name: ((None, mosaic_backward.XLA_DOT),)
         for name in ("fp32_inputs", "sixteen_bit_inputs")}
  config = {None: mosaic_backward.engine.GemmConfig(tile_n=64),
            "programs": mosaic_backward.engine.GemmConfig(tile_n=64, copy_programs=32),
            "warpgroup": mosaic_backward.engine.GemmConfig(
                ping_pong=True, stages=2, copy_warpgroup=True)}[beside]
  copy_programs = config.copies_beside
  fused = {name: ((None, config),) for name in xla}
  tables = dataclasses.replace(mosaic_backward.TABLES, rows=xla, weight_grads=xla,
                               pre_gelu=xla if pre_gelu_on_xla else fused)
  tokens = 61
  inputs = helpers.backward_inputs(tokens, 128, 256, dtype=dtype)
  problem = _problem(tokens, dtype, DotMode.F16 if dtype == jnp.float32 else DotMode.BF16,
                     128, 256)
  fn = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, tables=tables,
                                                   interpret=True))
  outs = fn(*inputs)
  assert [o.shape for o in outs] == [x.shape for x in inputs[1:6]]
  bounds.check_backward(outs, inputs, precision, f"xla dots {dtype.__name__}")
  # Copies: grad_output padded to 64 rows for the engine; on fp32 inputs the casts of the
  # others, hidden_state with its 61 rows (only XLA's dot reads it, beside the S-row
  # pre-GELU gradient), gelu_output padded as grad_output's copy beside it; on 16-bit
  # inputs nothing more (hidden_state and gelu_output only XLA's dots read, as given).
  copies = [((tokens, 128), 64)]
  later = [((tokens, 128), tokens), ((tokens, 256), 64), ((256, 128), 256)]
  if dtype == jnp.float32 and not copy_programs:
    copies += [*later, ((128, 256), 128)]
  elif copy_programs:   # grad_output and fc2_weight staged, the others copied beside
    copies.append(((128, 256), 128))
  if pre_gelu_on_xla:   # then the GELU pass over XLA's product, into S rows
    copies.append(((64, 256), tokens))
  assert staged == copies
  assert side == (later if copy_programs else [])


def test_tf32_refuses_xla_dots():
  xla = {"fp32_inputs": ((None, mosaic_backward.XLA_DOT),)}
  tables = dataclasses.replace(mosaic_backward.TABLES, weight_grads=xla)
  with pytest.raises(ValueError, match="TF32's unscaled products"):
    tables.configs(_problem(4096, mode=DotMode.TF32))


def test_the_pre_gelu_product_on_xla_only_for_fp32_inputs():
  xla = {"sixteen_bit_inputs": ((None, mosaic_backward.XLA_DOT),)}
  tables = dataclasses.replace(mosaic_backward.TABLES, pre_gelu=xla)
  with pytest.raises(ValueError, match="pre-GELU product on 16-bit inputs"):
    tables.configs(_problem(512, jnp.bfloat16, DotMode.BF16))


def _tf32_tables(copy_programs: int):
  """The tables, with `copy_programs` in DEFAULT's pre-GELU config."""
  tables = mosaic_backward.TABLES
  config = dataclasses.replace(tables.config_for(tables.pre_gelu, "tf32_on_f16", 4096),
                               copy_programs=copy_programs)
  return dataclasses.replace(tables, pre_gelu={**tables.pre_gelu,
                                               "tf32_on_f16": ((None, config),)})


@pytest.mark.transcendental
@pytest.mark.parametrize("tokens, copy_programs", [(65, 0), (200, 0), (200, 4)])
def test_tf32_on_the_f16_engine_within_the_tf32_operand_bounds(monkeypatch, tokens,
                                                               copy_programs):
  """DEFAULT on fp32 inputs: the backend's scaling, padding and unscaling around its four
  products (here jnp stand-ins for the engine, exact on their f16 operands), on rows
  scaled by powers of two from 2^-20 to 2^20, against the float64 oracle of TF32-rounded
  operands within `bounds.tf32_on_f16_oracle_and_bounds`. With copy programs, the fused
  product's launch makes the scaled copies of the operands only later products read, and
  the launch after it checks them."""
  side = []

  def engine_recording_side_copies(*args, side_copies=(), **kwargs):
    side.extend((x.shape, rows, len(scale)) for x, rows, *scale in side_copies)
    return _jnp_engine(*args, side_copies=side_copies, **kwargs)
  monkeypatch.setattr(mosaic_backward.engine, "matmul", engine_recording_side_copies)
  inputs = list(helpers.backward_inputs(tokens, 128, 256))
  key = helpers.fresh_key()
  spread = jnp.exp2(jax.random.randint(key, (tokens, 1), -20, 20).astype(jnp.float32))
  inputs[0] = inputs[0] * spread          # grad_output rows far apart in magnitude
  problem = _problem(tokens, jnp.float32, DotMode.TF32, 128, 256)
  tables = _tf32_tables(copy_programs)
  outs = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, tables=tables,
                                                     interpret=True))(*inputs)
  oracle, limits = bounds.tf32_on_f16_oracle_and_bounds(inputs)
  bounds.assert_within_bounds(outs, oracle, limits, jnp.float32, f"tf32 S={tokens}")
  padded = -(-tokens // 8) * 8   # fc1_weight, hidden_state, gelu_output, each with a scale
  assert side == ([((256, 128), 256, 1), ((tokens, 128), padded, 1),
                   ((tokens, 256), padded, 1)] if copy_programs else [])


@pytest.mark.transcendental
@pytest.mark.parametrize("copy_programs", [0, 4])
def test_tf32_on_the_f16_engine_with_lines_off_the_speculated_scale(monkeypatch,
                                                                    copy_programs):
  """DEFAULT on inputs whose lines the speculated scale does not all fit
  (`helpers.off_the_speculated_scale`: the checked launch copies their tiles again),
  within `bounds.tf32_on_f16_oracle_and_bounds`; with copy programs too (the copies they
  make, checked after the fused product)."""
  monkeypatch.setattr(mosaic_backward.engine, "matmul", _jnp_engine)
  inputs = helpers.off_the_speculated_scale(helpers.backward_inputs(200, 128, 256))
  problem = _problem(200, jnp.float32, DotMode.TF32, 128, 256)
  tables = _tf32_tables(copy_programs)
  outs = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, tables=tables,
                                                     interpret=True))(*inputs)
  oracle, limits = bounds.tf32_on_f16_oracle_and_bounds(inputs)
  bounds.assert_within_bounds(outs, oracle, limits, jnp.float32, "tf32 off the window")


def test_tf32_on_the_f16_engine_propagates_nan_and_inf_like_the_reference(monkeypatch):
  """A NaN or Inf in a row or column leaves its scale to the line's finite values (the
  staging launch's maxima) or gives it that of a non-finite maximum (the pre-GELU
  epilogue's); either way the outputs are NaN and Inf where the reference's are."""
  monkeypatch.setattr(mosaic_backward.engine, "matmul", _jnp_engine)
  inputs = list(helpers.backward_inputs(20, 128, 256))
  inputs[0] = inputs[0].at[3, 5].set(jnp.nan)
  inputs[6] = inputs[6].at[7, 2].set(jnp.inf)
  inputs[1] = inputs[1].at[11, 4].set(-jnp.inf)
  inputs[7] = inputs[7].at[13, 9].set(jnp.inf)
  problem = _problem(20, jnp.float32, DotMode.TF32, 128, 256)
  ours = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, interpret=True))(
      *inputs)
  ref = helpers.backward_float64(*inputs)
  for name, a, b in zip(helpers.OUT_NAMES, ours, ref):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
    np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=name)
    assert np.any(~np.isfinite(a)), name


@pytest.mark.transcendental
@pytest.mark.parametrize("tokens, preset, chunk", [(61, "highest", 1024), (61, "highest", 24),
                                                   (64, "high", 16)])
def test_bf16x3_as_one_product_over_the_pieces_within_bounds(monkeypatch, tokens, preset,
                                                             chunk):
  """HIGHEST and HIGH on fp32 inputs: bf16x3 with each product's three one product over
  the inputs' pieces side by side (XLA's dots, as on the GPU; the staging launches in
  interpret mode), the weight gradients in chunks of S (`chunk` rows at most: S = 61 in
  one, or in 3 of 24 rows, 61 padded to 72 with zeros; 64 in 4 of 16). Every output
  within the bound of one fp32 sum of 3K exact products (`bounds.bf16x3_in_one_sum`) and
  within HIGHEST's relative Frobenius error, bit for bit the same on a second call; S = 61
  leaves partial tiles in every staging job."""
  monkeypatch.setattr(mosaic_backward, "WEIGHT_GRAD_CHUNK", chunk)
  inputs = helpers.backward_inputs(tokens, 128, 256)
  problem = _problem(tokens, jnp.float32, precision.canonicalize(preset), 128, 256)
  fn = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, interpret=True))
  outs = fn(*inputs)
  assert [(o.shape, o.dtype) for o in outs] == [(x.shape, x.dtype) for x in inputs[1:6]]
  bounds.check_backward(outs, inputs, preset, f"bf16x3 S={tokens}",
                        model=bounds.bf16x3_in_one_sum(preset))
  for a, b in zip(outs, fn(*inputs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16x3_propagates_nan_and_inf_like_the_reference():
  """A NaN reaches the gradients the reference's NaN reaches, and so does an Inf in
  fc1_output (gelu'(Inf) is NaN, as in the contract's formula). An Inf in a product's
  operand splits into an Inf piece and a NaN one (Inf - Inf), so its gradients are
  non-finite where the reference's are, NaN where those may be Inf."""
  inputs = list(helpers.backward_inputs(20, 128, 256))
  inputs[0] = inputs[0].at[3, 5].set(jnp.nan)
  inputs[6] = inputs[6].at[7, 2].set(jnp.inf)
  problem = _problem(20, jnp.float32, DotMode.HIGHEST, 128, 256)
  run = jax.jit(lambda *a: mosaic_backward.backward(*a, problem=problem, interpret=True))
  ours, ref = run(*inputs), helpers.backward_float64(*inputs)
  for name, a, b in zip(helpers.OUT_NAMES, ours, ref):
    np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=name)
    assert np.any(np.isnan(a)), name
  inputs[1] = inputs[1].at[11, 4].set(-jnp.inf)
  inputs[7] = inputs[7].at[13, 9].set(jnp.inf)
  ours, ref = run(*inputs), helpers.backward_float64(*inputs)
  for name, a, b in zip(helpers.OUT_NAMES, ours, ref):
    np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=name)


@pytest.mark.parametrize("tokens, chunk, expected", [
    (1024, 1024, (1, 1024)), (1025, 1024, (2, 520)), (4096, 1024, (4, 1024)),
    (1, 1024, (1, 1)), (61, 24, (3, 24)), (2500, 1024, (3, 840))])
def test_weight_grad_chunks_cover_s_in_whole_groups_of_8(tokens, chunk, expected):
  chunks, rows = mosaic_backward.weight_grad_chunks(tokens, chunk)
  assert (chunks, rows) == expected
  assert chunks * rows >= tokens and (chunks - 1) * rows < tokens
  assert chunks == 1 or (rows <= chunk and rows % 8 == 0)
