"""`primerl run` with prefill/decode disaggregation: one prefill and one decode server
sharing the disk KV store under the run directory, a multi-turn env, three steps."""

import json
import subprocess
import sys

import pytest

from primerl.config import read_toml

pytestmark = pytest.mark.slow

SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4"]  # wordle's own lengths


def test_prefill_and_decode_servers_train_three_steps(tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "wordle",
                        "--inference.prefill_replicas", "1", "--inference.decode_replicas", "1",
                        "--inference.kv_store", "disk", "--max-steps", "3", "--output-dir", str(out), *SMALL],
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    # both servers started with their role; the run-time record says where each pool is and which
    # folder their stores share (no user setting changed: config.toml names none of it)
    runtime = json.loads((out / "runtime.json").read_text())
    assert len(runtime["prefill_urls"]) == 1 and len(runtime["decode_urls"]) == 1
    assert runtime["inference_urls"] == runtime["prefill_urls"] + runtime["decode_urls"]
    assert runtime["kv_store_options"] == {"root": str(out / "kv"), "shared": True}
    assert not read_toml(out / "config.toml")["inference"].get("urls")
    assert (out / "logs" / "inference-prefill-0.log").exists() and (out / "logs" / "inference-decode-0.log").exists()
    # the orchestrator ran every request in two phases over the two pools
    assert all(row["inference/prefill_up"] == 1 and row["inference/decode_up"] == 1 for row in rows)
    assert sum(row["inference/pd_whole"] for row in rows) == 0
    assert (out / "kv").is_dir()  # the shared block directory, under the run directory
