"""bench/gpu_check.py: refused in one line without CUDA, and its sections run on the CPU
(``--cpu``, the tiny presets) so the script keeps working between GPU loans."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO

SCRIPT = str(REPO / "bench" / "gpu_check.py")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is present: the script runs instead")
def test_without_cuda_it_says_why_in_one_line():
    r = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("gpu_check: needs a CUDA GPU (") and "--cpu runs the same sections" in line


def test_an_unknown_section_is_named():
    r = subprocess.run([sys.executable, SCRIPT, "--cpu", "--only", "trainer,warp"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("gpu_check: unknown sections ['warp']")


@pytest.mark.slow
def test_every_section_runs_on_the_cpu_and_reports_one_json_line():
    r = subprocess.run([sys.executable, SCRIPT, "--cpu"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["bench"] == "gpu_check" and out["ok"] and out["device"] == "cpu"
    for name in ("engine_dense", "engine_moe"):
        assert out[name]["tokens_per_s"] > 0 and out[name]["logprobs_finite"], out[name]
    for name in ("trainer", "fsdp", "fp8"):
        assert out[name]["step_s"] > 0 and out[name]["loss"] == out[name]["loss"], out[name]
    assert out["trainer"]["loss"] == pytest.approx(out["fsdp"]["loss"], rel=1e-4)  # one rank: the same step
    assert out["fp8"]["fp8"] and out["fp8"]["bf16_over_fp8"] > 0
    assert out["run"]["returncode"] == 0 and out["run"]["trainer_tokens_per_s"] > 0, out["run"]
