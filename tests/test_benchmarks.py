"""CPU tests of the benchmark: floors, the correctness rule, timing loop, writers, CPU demo."""

import dataclasses
import functools
import json
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import cases, correctness, floors, report, run, timing

# (S, floor TF32 µs, floor f16 µs): max(FLOPs / datasheet peak, bytes / 4.8 TB/s) on the H200.
ANCHOR_FLOORS = [
    (64, 15.9, 15.9), (128, 16.5, 16.5), (131, 16.5, 16.5), (211, 17.2, 17.2),
    (256, 19.0, 17.6), (293, 21.7, 18.0), (449, 33.3, 19.4), (512, 38.0, 20.0),
    (768, 56.9, 28.5), (773, 57.3, 28.7), (997, 73.9, 37.0), (1163, 86.2, 43.2),
    (1423, 105.5, 52.8), (1973, 146.3, 73.2), (2048, 151.8, 76.0), (4096, 303.7, 152.0)]


@pytest.mark.parametrize("seq_len,tf32,f16", ANCHOR_FLOORS)
def test_floors_reproduce_anchor_table(seq_len, tf32, f16):
  assert round(floors.floor_us(seq_len, 1280, 3584, "default"), 1) == tf32
  assert round(floors.floor_us(seq_len, 1280, 3584, "highest"), 1) == tf32
  assert round(floors.floor_us(seq_len, 1280, 3584, "f16"), 1) == f16
  assert round(floors.floor_us(seq_len, 1280, 3584, "bf16"), 1) == f16


def test_floor_means_and_overrides():
  assert round(np.mean([floors.floor_us(s, 1280, 3584, "default") for s in cases.SEQ_LENS]),
               1) == 72.5
  assert round(np.mean([floors.floor_us(s, 1280, 3584, "f16") for s in cases.SEQ_LENS]), 1) == 39.5
  slow = floors.Machine(peak_tf32=247.5e12, bandwidth=2.4e12)
  assert floors.floor_us(4096, 1280, 3584, "default", slow) == pytest.approx(
      2 * floors.floor_us(4096, 1280, 3584, "default"))
  # S=64 is bandwidth bound: bytes = 4·(3SH + 2SI + 4HI + I + H).
  assert floors.bytes_moved(64, 1280, 3584) == 4 * (3 * 64 * 1280 + 2 * 64 * 3584
                                                    + 4 * 1280 * 3584 + 3584 + 1280)


def test_cases_match_the_contract():
  """The vendored contract is the one the benchmark reads: 16 cases, H=1280, I=3584."""
  with open(cases.CONTRACT_PATH) as f:
    contract = json.load(f)
  assert cases.CONTRACT_PATH.is_relative_to(pathlib.Path(run.REPO_ROOT))
  assert len(cases.CASES) == 16 and cases.CASES[0] == (64, 0.021) and cases.CASES[-1] == (4096, 0.13)
  assert cases.CASES == tuple((c["seq_len"], c["atol"]) for c in contract["cases"])
  assert (cases.HIDDEN, cases.INTERMEDIATE) == (1280, 3584)
  assert "tanh" in contract["semantics"]["gelu"]


def test_inputs_are_drawn_as_the_contract_says():
  import jax
  inputs = cases.make_inputs(jax.random.key(0), 512, 256, 1024)
  named = dict(zip(cases.INPUT_NAMES, inputs))
  assert all(x.dtype == np.float32 for x in inputs)
  assert named["fc1_weight"].shape == (1024, 256) and named["fc2_weight"].shape == (256, 1024)
  assert np.std(named["gelu_output"]) == pytest.approx(1.0, rel=0.02)
  assert np.std(named["fc1_weight"]) == pytest.approx(1 / 16, rel=0.02)
  assert np.std(named["fc2_weight"]) == pytest.approx(1 / 32, rel=0.02)


# --- the correctness rule -----------------------------------------------------------------

ATOL = 0.05


def _ref(n=10_000, scale=1.0):
  return np.random.default_rng(0).normal(size=(n // 100, 100)) * scale


def _off_by_two_atol(fraction):
  ref = _ref()
  out = ref.copy()
  flat = out.reshape(-1)
  flat[: round(fraction * flat.size)] += 2 * ATOL
  return out, ref


def test_rule_accepts_close_outputs():
  ref = _ref()
  check = correctness.check_output("x", ref + 0.01, ref, ATOL)
  assert check.passed and check.pass_fraction == 1.0 and check.reason == ""


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_rule_rejects_nan_and_inf(bad):
  out, ref = _ref(), _ref()
  out[3, 4] = bad
  check = correctness.check_output("x", out, ref, ATOL)
  assert not check.passed and "NaN" in check.reason


def test_rule_rejects_all_zero_output():
  ref = _ref(scale=1e-4)  # every zero element is within atol: only the all-zero rule fires
  check = correctness.check_output("x", np.zeros_like(ref), ref, ATOL)
  assert not check.passed and check.reason == "all zero"
  assert correctness.check_output("x", np.zeros(4), np.zeros(4), ATOL).passed


def test_rule_rejects_1_1_percent_and_accepts_0_9_percent_off_by_two_atol():
  rejected = correctness.check_output("x", *_off_by_two_atol(0.011), ATOL)
  accepted = correctness.check_output("x", *_off_by_two_atol(0.009), ATOL)
  assert not rejected.passed and rejected.pass_fraction == pytest.approx(0.989)
  assert accepted.passed and accepted.pass_fraction == pytest.approx(0.991)


def test_rule_counts_the_relative_term():
  ref = _ref() * 1e4
  assert correctness.check_output("x", ref + 0.5 * ATOL + 0.5e-5 * np.abs(ref), ref, ATOL).passed
  assert not correctness.check_output("x", ref + 1.1 * ATOL + 1e-5 * np.abs(ref), ref, ATOL).passed


def test_highest_adds_the_frobenius_bound():
  refs = [_ref()] * 5
  outs = [r * (1 + 3e-5) for r in refs]     # far inside atol, but 3e-5 relative
  assert correctness.gate(outs, refs, 64, "default").passed
  result = correctness.gate(outs, refs, 64, "highest")
  assert not result.passed and "Frobenius" in result.reason
  assert result.max_rel_frobenius == pytest.approx(3e-5)


def test_atol_interpolates_between_cases():
  assert correctness.atol_for(64) == 0.021 and correctness.atol_for(4096) == 0.13
  assert correctness.atol_for(96) == pytest.approx(0.023)
  assert correctness.atol_for(7) == 0.021 and correctness.atol_for(10_000) == 0.13


# --- timing --------------------------------------------------------------------------------

def test_device_timing_loop_with_a_fake_cupti(monkeypatch):
  import jax.numpy as jnp
  calls = []
  def start():
    calls.append("start")
  gemm_ms = iter([0.010, 0.012, 0.020])
  def stop(finalize):
    calls.append(("stop", finalize))
    return [("gemm", next(gemm_ms)), ("epilogue", 0.005)]
  monkeypatch.setattr(timing, "_cupti", lambda: (start, stop))
  monkeypatch.setattr(timing, "l2_bytes", lambda: 1 << 12)
  t = timing.device_times_us(lambda x: x + 1, jnp.ones(4), warmup=2, iterations=3)
  assert (t.median_us, t.kernels, t.kernel_names) == (pytest.approx(17.0), 2, ("gemm", "epilogue"))
  assert t.kernel_median_us == pytest.approx((12.0, 5.0))
  assert t.p10_us < t.median_us < t.p90_us
  assert calls == ["start", ("stop", False), "start", ("stop", False), "start", ("stop", True)]


# --- writers -------------------------------------------------------------------------------

def _record(seq_len, precision, implementation, median_us=None, status="PASS", **extra):
  record = dict(hidden=1280, intermediate=3584, seq_len=seq_len, precision=precision,
                implementation=implementation, status=status, reason="",
                floor_us=floors.floor_us(seq_len, 1280, 3584, precision),
                min_pass_fraction=1.0, max_rel_frobenius=3e-4)
  record.update(extra)
  if median_us is not None:
    record.update(median_us=median_us, p10_us=median_us * 0.9, p90_us=median_us * 1.1, kernels=4)
  return record


def _doc():
  results = [
      _record(64, "default", "triton", 28.0), _record(64, "default", "xla", 56.0),
      _record(64, "default", "auto", 28.0, same_as="triton"),
      _record(4096, "default", "triton", 400.0), _record(4096, "default", "xla", 800.0),
      _record(4096, "default", "auto", 400.0, same_as="triton"),
      _record(64, "f16", "triton", 25.0), _record(64, "f16", "xla", 50.0),
      _record(64, "f16", "auto", 25.0, same_as="triton"),
      _record(4096, "f16", "triton", status="FAIL", reason="grad_fc1_weight: 2.00% beyond"),
      _record(4096, "f16", "xla", 350.0), _record(4096, "f16", "auto", 350.0, same_as="xla"),
  ]
  meta = dict(title="vision_mlp_bwd backward on NVIDIA H200", cpu_demo=False,
              device="NVIDIA H200", date="2026-11-29T12:00:00+00:00", jax_version="0.11.2",
              git_commit="0123456789abcdef", git_dirty=False, warmup=10, iterations=50,
              timing="CUPTI", peak_tf32=495e12, peak_f16=989e12, bandwidth=4.8e12,
              sizes=[[1280, 3584]], seq_lens=[64, 4096], precisions=["default", "f16"],
              implementations=["triton", "auto"])
  return {"meta": meta, "results": results}


def test_markdown_table(tmp_path):
  text = report.markdown(_doc())
  assert "## H=1280, I=3584, precision default" in text
  assert "| 64 | 15.9 | 28.0 | 2.00 | 57 | 28.0 (=triton) | 2.00 | 57 | 56.0 | 28 |" in text
  # Mean over cases: (28 + 400) / 2 = 214 vs XLA (56 + 800) / 2 = 428.
  assert "| **mean** | 159.8 | **214.0** | 2.00 | 75 |" in text
  # The f16 table has a FAIL, so triton's mean is withheld; XLA default is a column there.
  assert "| 4096 | 152.0 | FAIL | — | — | 350.0 (=xla) |" in text
  assert "| **mean** | 83.9 | **—** |" in text and "XLA default µs" in text
  assert "| 1280x3584 | f16 | triton | PASS 1/2 FAIL 1 |" in text
  assert "grad_fc1_weight: 2.00% beyond" in text


def test_write_all_writes_json_markdown_plot_and_latest(tmp_path):
  paths = report.write_all(_doc(), str(tmp_path), "h200_20261129", "h200_latest")
  assert sorted(os.listdir(tmp_path)) == sorted(
      f"{stem}.{ext}" for stem in ("h200_20261129", "h200_latest") for ext in ("json", "md", "png"))
  assert len(paths) == 6
  with open(tmp_path / "h200_latest.json") as f:
    assert json.load(f)["results"][0]["median_us"] == 28.0
  png = (tmp_path / "h200_20261129.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000


# --- the CPU demo, end to end --------------------------------------------------------------

def test_cpu_demo_end_to_end(tmp_path, capsys):
  import jax
  if jax.default_backend() == "gpu":
    pytest.skip("the CPU demo runs only without a GPU")
  doc = run.main(["--out", str(tmp_path), "--seq-lens", "7", "--precisions", "default",
                  "highest"])
  assert doc["meta"]["cpu_demo"] and doc["meta"]["title"] == "CPU demo, not a GPU benchmark"
  by_name = {(r["precision"], r["implementation"]): r for r in doc["results"]}
  assert set(by_name) == {(p, i) for p in ("default", "highest")
                          for i in ("mosaic", "triton", "xla", "auto")}
  hopper_only = [r for r in doc["results"] if r["implementation"] == "mosaic"]
  # DEFAULT (TF32 on the f16 engine) and HIGHEST (bf16x3 on 16-bit products) are refused
  # for the demo's shape (I=160) or platform, not for their precision.
  assert {r["precision"]: (r["status"], "32 bits" in r["reason"]) for r in hopper_only} == {
      "default": ("unsupported", False), "highest": ("unsupported", False)}
  assert all(r["status"] == "PASS" and r["median_us"] > 0 for r in doc["results"]
             if r["implementation"] != "mosaic")
  assert len(os.listdir(tmp_path)) == 6
  assert "CPU demo, not a GPU benchmark" in (tmp_path / "cpu_demo_latest.md").read_text()
  assert "mean over cases" in capsys.readouterr().out


def _table_config(seq_len, mode):
  import jax.numpy as jnp

  from vision_mlp_bwd.backends.triton.config import default_config
  from vision_mlp_bwd.precision import DotMode
  from vision_mlp_bwd.problem import Problem
  return default_config(Problem(seq_len, 1280, 3584, jnp.dtype(jnp.float32), DotMode(mode)))


def test_variant_config_takes_names_and_field_overrides():
  from benchmarks.tune import variant_config
  config = _table_config(64, "f16")
  assert variant_config(config, "default") == config
  assert variant_config(config, "cast_all") == dataclasses.replace(config, cast_inputs=True,
                                                                   cast_weights=True)
  varied = variant_config(config, "weight_grads.block_k=32,cast_inputs=1")
  assert varied.weight_grads == dataclasses.replace(config.weight_grads, block_k=32)
  assert varied.cast_inputs and varied.pre_activation == config.pre_activation
  # Removed variants and fields (benchmarks/NOTES.md, 28) are refused.
  for bad in ("bogus", "weight_grads.bogus=2", "pre_activation.block_m", "separate",
              "fc1_weight_grad.block_k=64", "weight_grads.tiles_per_program=2"):
    with pytest.raises(SystemExit, match="neither a name"):
      variant_config(config, bad)


@pytest.mark.parametrize("mode", ["f16", "tf32"])
def test_config_neighbours_change_one_searched_axis(mode):
  from benchmarks.tune import _LAUNCH_AXES, _role_tile, config_neighbours
  config = _table_config(256, mode)
  neighbours = config_neighbours(config, 256, sixteen_bit=mode == "f16")
  assert len(set(neighbours)) == len(neighbours) > 10
  flags = ({"cast_inputs", "cast_weights", "fused_casts"} if mode == "f16"
           else {"k_major_weight_grads"})
  flags |= {"sum_splits_in_kernel"}
  for other in neighbours:
    changed = [(role, axis) for role in _LAUNCH_AXES
               for axis, value in dataclasses.asdict(getattr(other, role)).items()
               if getattr(_role_tile(config, role), axis) != value]
    flipped = [f for f in flags if getattr(other, f) != getattr(config, f)]
    assert len(changed) + len(flipped) == 1, other
    assert all(axis in _LAUNCH_AXES[role] for role, axis in changed), changed
  assert {f for other in neighbours for f in flags
          if getattr(other, f) != getattr(config, f)} == flags   # every flag flipped once
  if mode == "f16":  # the fused-cast flag is searched only where inputs are cast at all
    assert any(other.fused_casts != config.fused_casts for other in neighbours)
    uncast = dataclasses.replace(config, cast_inputs=False, fused_casts=False)
    assert not any(other.fused_casts
                   for other in config_neighbours(uncast, 256, sixteen_bit=True))


def test_inspect_kernels_counts_instructions_per_ptx_entry():
  from benchmarks.inspect_kernels import count_instructions, kernels_in_ptx
  ptx = """
.visible .entry mlp_backward_1(
  cp.async.cg.shared.global [%r1], [%rd1], 16;
  wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {...};
  wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 {...};
  st.global.v4.f32 [%rd2], {%f1, %f2, %f3, %f4};
}
.visible .entry other(
  mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {...};
  ld.global.nc.v4.f32 {%f1, %f2, %f3, %f4}, [%rd3];
}
"""
  kernels = kernels_in_ptx(ptx)
  assert list(kernels) == ["mlp_backward_1", "other"]
  first, second = (count_instructions(kernels[k]) for k in kernels)
  assert (first["wgmma"], first["cp.async"], first["st.global.v4"], first["mma.sync"]) == (2, 1, 1, 0)
  assert (second["mma.sync"], second["ld.global.v4"], second["wgmma"]) == (1, 1, 0)


def test_mosaic_probe_keeps_only_the_launch_probes(monkeypatch):
  """The GEMM prototypes gave way to the package's engine (benchmarks/NOTES.md, 28); the
  launch 2 prototype did not ship (NOTES.md 24h)."""
  import sys

  from benchmarks import mosaic_probe
  for kernel in ("plain", "persistent", "chained", "transposing", "converting", "launch2"):
    monkeypatch.setattr(sys, "argv", ["mosaic_probe", "--kernels", kernel])
    with pytest.raises(SystemExit):
      mosaic_probe.main()
  for name in ("k_major_matmul", "persistent_k_major_matmul", "transposing_matmul",
               "converting_matmul", "converting_probe", "launch_2_prototype", "launch_2_probe"):
    assert not hasattr(mosaic_probe, name), name


def test_mosaic_probe_launch_1_times_the_package_kernel():
  """`mosaic_probe --kernels launch1` runs `launch_1_sm90.launch_1` (no copy of it); lowers here."""
  import inspect

  from benchmarks import gelu_forms, mosaic_probe
  from vision_mlp_bwd.backends.mosaic import launch_1_sm90
  assert "launch_1_sm90.launch_1" in inspect.getsource(mosaic_probe.launch_1_probe)
  rows = launch_1_sm90.padded_rows(211)
  specs = [jax.ShapeDtypeStruct((rows, 1280), jnp.float16),
           jax.ShapeDtypeStruct((1280, 3584), jnp.float32),
           jax.ShapeDtypeStruct((211, 3584), jnp.float32),
           jax.ShapeDtypeStruct((rows, 3584), jnp.float16)]
  variants = [mosaic_probe._launch_1_variants(text)   # some the probe timed (NOTES 24)
              for text in ("tanh:exact", "one_exp_rsqrt:64x64x64", "tanh:exact:64x128x64:3:4",
                           "one_exp_rsqrt:128x64x64:5:4")]
  assert variants[0] == ("tanh", False, None, None, 4)
  assert variants[2] == ("tanh", False, (64, 128, 64), 3, 4)
  try:
    for form, approx_math, pre_tile, stages, weight_grad_stages in variants:
      gelu_forms.use(form)
      assert launch_1_sm90.gelu_derivative is gelu_forms.FORMS[form]
      fn = functools.partial(launch_1_sm90.launch_1, stages=stages,
                             weight_grad_stages=weight_grad_stages, pre_tile=pre_tile,
                             approx_math=approx_math)
      text = jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",)).as_text()
      assert "mosaic_gpu" in text
  finally:
    gelu_forms.use(None)


# --- cited results -----------------------------------------------------------------------------

def _alternatives(pattern):
  """A path with shell-style {a,b} alternatives -> each path it stands for."""
  import re
  match = re.search(r"\{([^{}]*)\}", pattern)
  if not match:
    return [pattern]
  return [p for alt in match[1].split(",")
          for p in _alternatives(pattern[:match.start()] + alt + pattern[match.end():])]


def test_every_cited_result_exists():
  """Every results/... path that the READMEs, NOTES.md, the scripts, the package's comments and
  the tests cite names files that exist (each {a,b} alternative and wildcard at least one), and
  no result file outside latest/ is cited by its bare name, without its folder."""
  import glob
  import re
  repo = pathlib.Path(run.REPO_ROOT)
  results = repo / "benchmarks" / "results"
  # results/... (from benchmarks/) or benchmarks/results/... (from the root).
  cited_path = re.compile(r"(?:benchmarks/)?results/(?:[\w.*/-]|\{[\w.*,-]*\})*")
  stems = {p.name.split(".")[0] for p in results.rglob("*")
           if p.is_file() and "latest" not in p.relative_to(results).parts
           and p.name != "README.md" and not p.name.startswith(".")}
  bare_name = re.compile(r"(?<![\w.-])(?:" + "|".join(map(re.escape, sorted(stems))) + r")(?![\w-])")
  benchmarks, package = repo / "benchmarks", repo / "vision_mlp_bwd"
  citing = [repo / "README.md", *sorted(benchmarks.glob("*.md")), *sorted(benchmarks.glob("*.py")),
            *sorted(benchmarks.glob("*.sh")), *sorted(package.rglob("*.py")),
            *sorted((repo / "tests").glob("*.py")), *sorted((repo / "examples").glob("*.py"))]
  missing, bare = [], []
  for path in citing:
    text, where = path.read_text(), path.relative_to(repo)
    for match in cited_path.finditer(text):
      cited = match[0].rstrip(".")
      base = repo if cited.startswith("benchmarks/") else benchmarks
      missing += [f"{where}: {cited}" for alternative in _alternatives(cited)
                  if not glob.glob(str(base / alternative))]
    bare += [f"{where}: {m[0]}" for m in bare_name.finditer(cited_path.sub(" ", text))]
  assert not missing, "cited, but no such file:\n" + "\n".join(missing)
  assert not bare, "cited without their folder in benchmarks/results/:\n" + "\n".join(bare)


def test_no_file_names_an_absolute_path_of_a_machine():
  """Tracked files (results and HLO dumps included) speak of paths from the repo's root."""
  import re
  import subprocess
  repo = pathlib.Path(run.REPO_ROOT)
  listed = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True)
  if listed.returncode:
    pytest.skip("not a git checkout")
  home_like = re.compile("(?<![\\w.])/(?:" + "|".join(("work", "root", "home", "Users")) + r")/\w")
  offending = []
  for name in listed.stdout.split():
    path = repo / name
    if path.suffix in (".png",) or not path.is_file() or name == "tests/test_benchmarks.py":
      continue
    text = path.read_text(errors="replace")
    offending += [f"{name}: {m[0]}" for m in home_like.finditer(text)][:3]
  assert not offending, "\n".join(offending)
