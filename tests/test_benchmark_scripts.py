"""CPU checks of the benchmark scripts added beside `benchmarks.run`: their tables, files and
oracles (the timings themselves are GPU facts; on a CPU the scripts run as demos)."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import (backward_configs, bf16x3_chunks, input_dtypes, precision_errors, timing,
                        training_step)
from tests import bounds, helpers


def test_training_step_demo_writes_its_tables(tmp_path):
  training_step.main(["--seq-lens", "8", "--dtypes", "bf16", "--iterations", "1", "--no-flax",
                      "--size", "16x40", "--out", str(tmp_path)])
  [record] = list(tmp_path.glob("training_step_cpu_demo_*.json"))
  rows = json.loads(record.read_text())["forward_backward"]
  assert [(r["dtype"], r["seq_len"]) for r in rows] == [("bf16", 8)]
  row = rows[0]
  assert row["plain"] > 0 and row["auto"] > 0 and row["triton"] > 0
  assert row["backend"] == "jnp autodiff"   # bf16 where XLA would run: jnp's own autodiff
  assert row["auto_vs_plain"] == row["plain"] / row["auto"]
  assert record.with_suffix(".png").exists()
  assert "| bf16 | 8 |" in record.with_suffix(".md").read_text()


def test_the_plain_model_is_the_one_users_write():
  inputs = helpers.backward_inputs(6, 8, 24)
  x, (w1, b1, w2, b2) = inputs[1], inputs[2:6]
  expected = jax.nn.gelu(x @ w1.T + b1, approximate=True) @ w2.T + b2
  np.testing.assert_array_equal(training_step.plain_mlp(x, w1, b1, w2, b2), expected)


def test_bf16x3_chunks_oracle_is_the_float64_contract():
  inputs = helpers.backward_inputs(9, 16, 40)
  exact = helpers.backward_float64(*inputs)
  for ours, theirs in zip(bf16x3_chunks.weight_grads_float64(inputs), (exact[1], exact[3])):
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_precision_errors_oracle_is_the_float64_contract():
  inputs = helpers.backward_inputs(9, 16, 40)
  for ours, theirs in zip(precision_errors.oracle(inputs), helpers.backward_float64(*inputs)):
    np.testing.assert_allclose(ours, theirs, rtol=1e-12, atol=1e-12)


def test_input_dtypes_table_has_every_column(tmp_path):
  rows = [dict(seq_len=64, **{label: 1.0 + n for n, (label, *_) in
                              enumerate(input_dtypes.COLUMNS)})]
  input_dtypes._write(str(tmp_path / "t"), rows, "20260101-000000", 16, 40,
                      [label for label, *_ in input_dtypes.COLUMNS])
  table = (tmp_path / "t.md").read_text().splitlines()
  assert table[2].count("|") == len(input_dtypes.COLUMNS) + 2
  assert table[-1].startswith("| 64 | 1.0 | 2.0 |")
  assert json.loads((tmp_path / "t.json").read_text())["rows"] == rows
  dtypes = {jnp.dtype(d) for _, d, _, _ in input_dtypes.COLUMNS}
  assert dtypes == {jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)}
  assert bounds.mode_for(None, jnp.bfloat16).operand_dtype == jnp.bfloat16
  runnable = [c[0] for c in input_dtypes.COLUMNS if input_dtypes._runs(c, 16, 40)]
  assert runnable and not any("mosaic" in label for label in runnable)   # Hopper only


def test_backward_configs_times_each_variant_of_one_table_entry(tmp_path, monkeypatch):
  """On a CPU, with jnp stand-ins for the engine (tests/test_mosaic_backend.py) and wall
  clocks: each variant reaches the engine as the config of that product only, and the file
  records it with the bitwise comparison against the first."""
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from tests.test_mosaic_backend import _jnp_engine
  seen = []

  def engine(a, b, *, config, **kw):
    seen.append((kw.get("epilogue") is not None, config))
    return _jnp_engine(a, b, **kw)

  monkeypatch.setattr(backward_sm90.engine, "matmul", engine)
  monkeypatch.setattr(timing, "device_times_us",
                      lambda fn, *a, **_: timing.wall_times_us(fn, *a, warmup=0, iterations=1))
  backward_configs.main(["--table", "tf32_on_f16", "--product", "pre_gelu", "--seq-lens", "8",
                         "--size", "64x128", "--iterations", "1",
                         "--variants", "{}", '{"stages": 3}', "--out", str(tmp_path)])
  [record] = list(tmp_path.glob("backward_configs_*.json"))
  rows = json.loads(record.read_text())["rows"]
  assert [(r["seq_len"], r["variant"], r["bitwise_same_as_first"], r["differing_from_first"])
          for r in rows] == [(8, {}, True, []), (8, {"stages": 3}, True, [])]
  table = backward_sm90.TABLES.pre_gelu["tf32_on_f16"][0][1]
  first, second = seen[:len(seen) // 2], seen[len(seen) // 2:]   # one trace per variant
  assert [config for fused, config in first if fused] == [table]
  assert [config for fused, config in second if fused] == [dataclasses.replace(table, stages=3)]
  assert [c for fused, c in first if not fused] == [c for fused, c in second if not fused]
  # Each row records the whole config it ran, which reads back as that config.
  assert [backward_configs.recorded_config(r, None) for r in rows] == [
      table, dataclasses.replace(table, stages=3)]


def test_epilogue_costs_builds_the_table_products_epilogue_one_piece_at_a_time(
    tmp_path, monkeypatch):
  """On a CPU, with the jnp stand-in for the engine and wall clocks: each step reaches the
  engine with the table's pre-GELU config and one more piece of the epilogue than the step
  before, and the last step of each table is the backward's product itself."""
  from benchmarks import epilogue_costs
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from tests.test_mosaic_backend import _jnp_engine
  seen = []

  def engine(a, b, *, config, **kw):
    seen.append((config, jnp.dtype(kw["out_dtype"]).name, kw.get("epilogue") is not None,
                 kw.get("column_sums"), kw.get("line_maxima", False),
                 kw.get("row_scale") is not None))
    return _jnp_engine(a, b, **kw)

  monkeypatch.setattr(epilogue_costs.engine, "matmul", engine)
  monkeypatch.setattr(timing, "device_times_us",
                      lambda fn, *a, **_: timing.wall_times_us(fn, *a, warmup=0, iterations=1))
  epilogue_costs.main(["--seq-lens", "16", "--size", "64x128", "--iterations", "1",
                       "--out", str(tmp_path)])
  [record] = list(tmp_path.glob("epilogue_costs_*.json"))
  rows = json.loads(record.read_text())["rows"]
  assert [r["step"] for r in rows] == list(epilogue_costs.STEPS)
  tables = backward_sm90.TABLES
  # The product alone, on every SM: without the table's copy programs.
  f16, tf32 = (dataclasses.replace(tables.config_for(tables.pre_gelu, name, 16), copy_programs=0,
                                   copy_warpgroup=False)
               for name in ("fp32_inputs", "tf32_on_f16"))
  assert seen == [
      (f16, "float16", False, None, False, False), (f16, "float16", True, None, False, False),
      (f16, "float16", True, None, False, False),
      (f16, "float16", True, "unrounded", False, False),
      (f16, "float16", True, None, False, False), (f16, "float16", True, None, False, False),
      (tf32, "float32", False, None, False, False), (tf32, "float32", True, None, False, False),
      (tf32, "float32", True, "unrounded", False, False),
      (tf32, "float32", True, "unrounded", True, False),
      (tf32, "float32", True, "unrounded", True, True)]


def test_epilogue_costs_runs_each_step_in_each_variants_config(tmp_path, monkeypatch):
  """`--variants`: every step reaches the engine once per variant, in the variant's fields
  over the table's config, and each row records the variant and the config it ran."""
  from benchmarks import epilogue_costs
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from tests.test_mosaic_backend import _jnp_engine
  seen = []

  def engine(a, b, *, config, **kw):
    seen.append(config)
    return _jnp_engine(a, b, **kw)

  monkeypatch.setattr(epilogue_costs.engine, "matmul", engine)
  monkeypatch.setattr(timing, "device_times_us",
                      lambda fn, *a, **_: timing.wall_times_us(fn, *a, warmup=0, iterations=1))
  steps = ["f16: plain product", "f16: + GELU derivative"]
  epilogue_costs.main(["--seq-lens", "16", "--size", "64x128", "--iterations", "1",
                       "--steps", *steps, "--variants", "{}", '{"stages": 3}',
                       "--out", str(tmp_path)])
  [record] = list(tmp_path.glob("epilogue_costs_*.json"))
  rows = json.loads(record.read_text())["rows"]
  tables = backward_sm90.TABLES
  table = dataclasses.replace(tables.config_for(tables.pre_gelu, "fp32_inputs", 16),
                              copy_programs=0, copy_warpgroup=False)
  varied = dataclasses.replace(table, stages=3)
  assert seen == [table, table, varied, varied]
  assert [(r["step"], r["variant"]) for r in rows] == [
      (steps[0], {}), (steps[1], {}), (steps[0], {"stages": 3}), (steps[1], {"stages": 3})]
  assert [backward_sm90.parse_product(r["config"]) for r in rows] == seen


def test_backward_configs_varies_the_staging_launches(tmp_path, monkeypatch):
  """`--product staging`: each variant's block and parts reach every Cast job of the
  backward, its `sum_rows` fields every SumRows job, its warps every staging launch."""
  from vision_mlp_bwd.backends import staging
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from tests.test_mosaic_backend import _jnp_engine
  launches, real = [], staging.grouped_launch

  def spy(jobs, operands, **kw):
    launches.append(([(job.block, job.parts) for job in jobs if isinstance(job, staging.Cast)],
                     [(job.block, job.group) for job in jobs if isinstance(job, staging.SumRows)],
                     kw.get("num_warps", 4)))
    return real(jobs, operands, **kw)

  monkeypatch.setattr(staging, "grouped_launch", spy)
  monkeypatch.setattr(backward_sm90.engine, "matmul", _jnp_engine)
  monkeypatch.setattr(timing, "device_times_us",
                      lambda fn, *a, **_: timing.wall_times_us(fn, *a, warmup=0, iterations=1))
  backward_configs.main(["--table", "fp32_inputs", "--product", "staging", "--seq-lens", "8",
                         "--size", "64x128", "--iterations", "1", "--variants", "{}",
                         '{"block": [16, 64], "parts": 2, "num_warps": 8, '
                         '"sum_rows": {"block": 32, "group": 3}}',
                         "--out", str(tmp_path)])
  [record] = list(tmp_path.glob("backward_configs_*.json"))
  rows = json.loads(record.read_text())["rows"]
  assert [r["variant"] for r in rows] == [{}, {"block": [16, 64], "parts": 2, "num_warps": 8,
                                               "sum_rows": {"block": 32, "group": 3}}]
  default, sums = staging.Cast((8, 64), None), staging.SumRows((1, 1))
  # Each trace: the staging launch, then the last launch (the bias sums, the split tails).
  # With copy programs the fused product's launch copies three of the five inputs.
  pre_gelu = backward_sm90.Tables.config_for(backward_sm90.TABLES.pre_gelu, "fp32_inputs", 8)
  casts = 2 if pre_gelu.copies_beside else 5
  sums_then = [(sums.block, sums.group)] * 2   # the two bias gradients' partial rows
  assert launches == [([(default.block, default.parts)] * casts, [], 4), ([], sums_then, 4),
                      ([((16, 64), 2)] * casts, [], 8), ([], [(32, 3)] * 2, 8)]


def test_timeline_measures_what_overlaps_in_a_programs_warpgroups():
  """A made-up trace of one program: warpgroup 0's epilogue [10, 14) runs while warpgroup
  1's mainloop [10, 20) does (hidden); warpgroup 1's epilogue [20, 26) while warpgroup 0's
  mainloop [21, 31) does for 5 of its 6 us; between 20 and 21 no mainloop runs."""
  from benchmarks import timeline
  regions = {(0, "mainloop"): [(0, 10), (21, 31)], (0, "epilogue"): [(10, 14)],
             (1, "mainloop"): [(10, 20)], (1, "epilogue"): [(20, 26)],
             (2, "load"): [(0, 31)]}
  events = []
  for (wg, name), spans in regions.items():
    for start, end in spans:
      events += [dict(name=name, ph="B", ts=start, pid=1, tid=1 + wg),
                 dict(name=name, ph="E", ts=end, pid=1, tid=1 + wg)]
  s = timeline.summary({"traceEvents": sorted(events, key=lambda e: e["ts"])})
  assert s["span_us"] == 31 and s["programs"] == 1 and s["blocks"] == 3
  assert s["mainloop_us"] == 10 and s["epilogue_us"] == 5
  assert s["epilogue_hidden"] == 9 / 10
  assert s["no_mainloop_share"] == 1 / 31


def test_sass_regions_counts_a_made_up_source_page(tmp_path, capsys):
  """ncu's source-page CSV (a title row, then the header): opcodes without predicates or
  modifiers, executions per 32 elements, stall samples by reason, per region of indices."""
  import gzip
  from benchmarks import sass_regions
  header = ["Address", "Source", sass_regions.SAMPLES, sass_regions.EXECUTED,
            "stall_wait", "stall_long_sb", "stall_wait (Not Issued)"]
  body = [["0x0", "  FMUL R1, R2, R3", "4", "64", "3", "1", "9"],
          ["0x10", "@!P2  BRA 0x40", "10", "64", "0", "10", "9"],
          ["0x20", "MUFU.EX2 R4, R1", "2", "32", "2", "0", "9"],
          ["0x30", "FMUL.FTZ R5, R4, R1", "0", "1,024", "0", "0", "9"]]
  path = tmp_path / "source.csv.gz"
  with gzip.open(path, "wt") as f:
    f.write('"Kernel Name","k",\n')
    for row in [header] + body:
      f.write(",".join(f'"{v}"' for v in row) + "\n")
  found = sass_regions.read(str(path))
  assert [i.opcode for i in found] == ["FMUL", "BRA", "MUFU", "FMUL"]
  assert [i.executed for i in found] == [64, 64, 32, 1024]
  assert found[1].stalls == {"wait": 0, "long_sb": 10}
  sass_regions.main([str(path), "--elements", "64", "--regions", "tail=2:4", "--hottest", "1"])
  out = capsys.readouterr().out
  assert "all: 4 static, 1184 executed (592.00 per element), 16 stall samples" in out
  assert "long_sb 11, wait 5" in out and "FMUL 544.00, BRA 32.00, MUFU 16.00" in out
  assert "tail [2, 4): 2 static, 1056 executed (528.00 per element), 2 stall samples" in out
  assert "    2     2 MUFU.EX2 R4, R1" in out


def test_epilogue_costs_profile_calls_run_each_step_untimed(tmp_path, monkeypatch):
  """`--profile-calls N`: each step's product runs N times, nothing is timed and no result
  file is written (a profiler outside the process does the measuring)."""
  from benchmarks import epilogue_costs
  from tests.test_mosaic_backend import _jnp_engine
  calls = []
  monkeypatch.setattr(epilogue_costs.engine, "matmul",
                      lambda a, b, *, config, **kw: _jnp_engine(a, b, **kw))
  step_fn = epilogue_costs.step_fn

  def counted_step_fn(step, *args):
    fn, config = step_fn(step, *args)

    def call(*operands):
      calls.append(step)
      return fn(*operands)
    return call, config

  def timed(*_, **__):
    pytest.fail("--profile-calls timed a step")

  monkeypatch.setattr(epilogue_costs, "step_fn", counted_step_fn)
  monkeypatch.setattr(timing, "device_times_us", timed)
  steps = ["f16: plain product", "f16: + GELU derivative"]
  epilogue_costs.main(["--seq-lens", "16", "--size", "64x128", "--steps", *steps,
                       "--profile-calls", "3", "--out", str(tmp_path)])
  assert calls == [steps[0]] * 3 + [steps[1]] * 3
  assert not list(tmp_path.iterdir())


def test_a_variants_gelu_form_is_what_its_epilogue_traces(tmp_path, monkeypatch):
  """`"gelu_form"` in a variant (epilogue_costs, backward_configs): the fused epilogue is
  traced with that form of the GELU derivative, the other variants with the package's,
  and the package's is back in place afterwards."""
  from benchmarks import epilogue_costs, gelu_forms
  from vision_mlp_bwd import reference
  from vision_mlp_bwd.backends.mosaic import backward_sm90
  from tests.test_mosaic_backend import _jnp_engine
  seen = []

  def engine(a, b, *, config, **kw):
    if kw.get("epilogue") is not None:
      seen.append(reference.gelu_tanh_grad)
    return _jnp_engine(a, b, **kw)

  for module in (epilogue_costs, backward_sm90):
    monkeypatch.setattr(module.engine, "matmul", engine)
  monkeypatch.setattr(timing, "device_times_us",
                      lambda fn, *a, **_: timing.wall_times_us(fn, *a, warmup=0, iterations=1))
  variants = ["{}", '{"gelu_form": "no_cancellation"}']
  epilogue_costs.main(["--seq-lens", "16", "--size", "64x128", "--iterations", "1",
                       "--steps", "f16: + GELU derivative", "--variants", *variants,
                       "--out", str(tmp_path)])
  backward_configs.main(["--table", "tf32_on_f16", "--product", "pre_gelu", "--seq-lens", "8",
                         "--size", "64x128", "--iterations", "1", "--variants", *variants,
                         "--out", str(tmp_path)])
  package, previous = gelu_forms.PACKAGE_FORM, gelu_forms.FORMS["no_cancellation"]
  assert package is not previous
  assert seen == [package, previous, package, previous]
  assert reference.gelu_tanh_grad is package
