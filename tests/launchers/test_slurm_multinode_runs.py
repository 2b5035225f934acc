"""Whole runs through `primerl run --launcher slurm` on the multi-node harness
(tests/slurm_cluster.py): every node a network namespace with its own address and hostname,
so anything bound to or aimed at loopback, or a hostname resolved on the wrong machine, fails
here as on a cluster. Where each process runs is read from the process itself (its network
namespace and its hostname), never from the launcher's record.

* two nodes (inference and orchestrator on the first, the trainer on the second): node 1 lost
  at step 5 (its slurmd and every process on it SIGKILLed) ends the run with one line naming
  it; the node back, the same command resumes, every step once (the CI version);
* three nodes, the trainer on two (a c10d rendezvous across nodes, `auto` picks fsdp);
* three nodes, two inference nodes with `--inference.kv_store mooncake`: the master on the
  first node, a prefix computed on either server restored from the pool by the other.

Skipped, naming what is missing, where Slurm, iproute2 or network namespaces are not there."""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import slurm_cluster as sc

pytestmark = pytest.mark.slow

KEY = "multinode-test-key"
SMALL = ["--model", "glm5", "--env", "reverse-text", "--sft.steps", "0", "--orchestrator.batch_size", "8",
         "--orchestrator.group_size", "4", "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]
ENV = {"PRIMERL_THREADS": "1", "PRIMERL_API_KEY": KEY}  # the nodes share this machine's cores
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture
def cluster(request, tmp_path_factory):
    reason = sc.skip_reason()
    if reason:
        pytest.skip(reason)
    nodes, timeout = request.param
    root = tmp_path_factory.mktemp("cluster")
    with sc.slurm_cluster(root, nodes, slurmd_timeout=timeout) as c:
        yield c
    assert sc.leftovers(root) == []


def start(c: sc.Cluster, out: Path, *args: str) -> subprocess.Popen:
    """`primerl run --launcher slurm` from the head, as a user on a login node runs it."""
    cmd = c.head_command(sys.executable, "-m", "primerl.cli", "run", *SMALL, "--launcher", "slurm",
                         "--output-dir", str(out), *args)
    return subprocess.Popen(cmd, env={**c.env, **ENV}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def steps(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def wait_for_steps(out: Path, proc: subprocess.Popen, n: int, timeout: float = 400) -> None:
    deadline = time.time() + timeout
    while len(steps(out)) < n:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"no {n} steps in {timeout} s"
        time.sleep(0.5)


def run_processes(out: Path) -> list[tuple[int, str]]:
    """(pid, what) of every live `primerl <kind>` process of the run in ``out`` (not the srun
    steps or their scripts): "inference:<port>", "orchestrator", "trainer" (torchrun's and its
    ranks'), "kv_service" (the KV store's run service: Mooncake's master)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        line = " ".join(args)
        if state == "Z" or "python" not in os.path.basename(args[0]) or str(out) not in line:
            continue
        if "-m primerl.kv_service " in line:
            found.append((int(entry.name), "kv_service"))
        elif m := re.search(r"primerl\.cli (inference|orchestrator|trainer)\b", line):
            port = re.search(r"--inference\.port (\d+)", line)
            found.append((int(entry.name), m.group(1) + (f":{port.group(1)}" if port else "")))
    return found


def placement(c: sc.Cluster, out: Path) -> dict[str, set[str]]:
    """Each process kind of the run, and the nodes it runs on, read from each process: the
    node whose network namespace it is in, which must also be its hostname."""
    by_inode = {sc._netns_inode(name): name for name in c.names}
    where: dict[str, set[str]] = {}
    for pid, what in run_processes(out):
        try:
            inode = int(re.fullmatch(r"net:\[(\d+)\]", os.readlink(f"/proc/{pid}/ns/net")).group(1))
        except OSError:
            continue
        hostname = subprocess.run(["nsenter", "-t", str(pid), "-u", "hostname"], capture_output=True,
                                  text=True).stdout.strip()
        node = by_inode.get(inode, f"not a node (netns {inode})")
        assert hostname == node, f"{what} (pid {pid}) is in {node}'s namespace with hostname {hostname!r}"
        where.setdefault(what, set()).add(node)
    return where


def served_versions(out: Path) -> list[int]:
    """Each inference server's policy version, asked at its URL from the head."""
    urls = json.loads((out / "runtime.json").read_text())["inference_urls"]
    return [httpx.get(f"{u}/health", timeout=10, headers=AUTH).json()["policy_version"] for u in urls]


def figure(url: str, name: str) -> float:
    """One figure of a server's Prometheus ``/metrics``, asked at its URL from the head."""
    text = httpx.get(url + "/metrics", timeout=10, headers=AUTH).text
    return float(re.search(rf"^{name} (\S+)$", text, re.M).group(1))


def wait_for_new_weights_everywhere(out: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    """Until every server (each on its node) serves a policy the trainer published (v1 or
    later, loaded from the shared run directory)."""
    deadline = time.time() + timeout
    while min(served_versions(out)) < 1:
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"a server still serves v0 after {timeout} s: {served_versions(out)}"
        time.sleep(0.2)


def nothing_of(out: Path) -> list[tuple[int, str]]:
    deadline = time.time() + 30
    while run_processes(out) and time.time() < deadline:
        time.sleep(0.5)
    return run_processes(out)


@pytest.fixture(scope="module")
def one_node_row(tmp_path_factory) -> dict:
    """Step 1 of a one-node run (the local launcher): the metrics every run writes."""
    out = tmp_path_factory.mktemp("one") / "run"
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", *SMALL, "--max-steps", "1", "--inference.port", "0",
                        "--output-dir", str(out)], capture_output=True, text=True, timeout=600, env={**os.environ, **ENV})
    assert r.returncode == 0, r.stdout + r.stderr
    return steps(out)[0]


@pytest.mark.parametrize("cluster", [(2, 10)], indirect=True)
def test_two_nodes_a_lost_node_ends_the_run_naming_it_and_the_same_command_resumes(cluster, tmp_path):
    c, out = cluster, tmp_path / "run"
    # enough steps that the run is still going when the node is lost (a step takes about a second)
    args = ("--launcher.nodes", "2", "--max-steps", "12", "--trainer.checkpoint_every", "2")
    proc = start(c, out, *args)
    wait_for_steps(out, proc, 2)
    assert placement(c, out) == {"inference:8000": {c.names[0]}, "orchestrator": {c.names[0]},
                                 "trainer": {c.names[1]}}
    wait_for_new_weights_everywhere(out, proc)  # from the trainer's node to the server's (the shared run directory)
    wait_for_steps(out, proc, 5)
    c.kill_node(1)
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 1, stdout + stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"lost node {c.names[1]} (NODE_FAIL" in errors[0], stderr
    lost = re.search(r"after step (\d+); the same command resumes it from its checkpoint at step (\d+)", errors[0])
    assert lost, errors[0]
    after, checkpoint = int(lost[1]), int(lost[2])
    assert 5 <= after < 12 and checkpoint in (after - after % 2, after - after % 2 - 2), errors[0]
    assert nothing_of(out) == []
    c.start_node(1)
    c.wait_idle()
    again = start(c, out, *args)
    stdout, stderr = again.communicate(timeout=600)
    assert again.returncode == 0, stdout + stderr
    assert f"from checkpoints/step_{checkpoint:06d}" in stdout, stdout
    assert [row["step"] for row in steps(out)] == list(range(1, 13))
    assert nothing_of(out) == []


@pytest.mark.parametrize("cluster", [(2, 10)], indirect=True)
def test_with_requeue_a_lost_node_is_named_and_slurm_runs_the_job_again_to_its_end(cluster, tmp_path):
    """``--launcher.requeue true``: Slurm requeues the job when node 1 is lost; the node is
    back in service as soon as Slurm has it down (before primerl's next look, as after a
    quick reboot), and the warning still names it; the requeued job resumes from the
    checkpoint and runs to the end, and the one command ends 0."""
    c, out = cluster, tmp_path / "run"
    proc = start(c, out, "--launcher.nodes", "2", "--max-steps", "12", "--trainer.checkpoint_every", "2",
                 "--launcher.requeue", "true")
    wait_for_steps(out, proc, 5)
    c.kill_node(1)
    deadline = time.time() + 120
    while not c.sinfo().get(c.names[1], "").startswith("down"):
        assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, f"Slurm never set {c.names[1]} down: {c.sinfo()}"
        time.sleep(0.2)
    c.start_node(1)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    said = re.sub(r"\s", "", stdout + stderr)  # the live view wraps its lines, mid-word too
    assert said.count("Slurmrequeuedthejob") == 1, stdout + stderr
    assert re.search(rf"warning:Slurmjob\d+lostnode{re.escape(c.names[1])}\(NODE_FAIL", said), stdout + stderr
    assert [row["step"] for row in steps(out)] == list(range(1, 13))
    assert nothing_of(out) == []


@pytest.mark.parametrize("cluster", [(3, 30)], indirect=True)
def test_three_nodes_the_trainer_spans_two_of_them(cluster, tmp_path, one_node_row):
    c, out = cluster, tmp_path / "run"
    proc = start(c, out, "--launcher.nodes", "3", "--launcher.trainer_nodes", "2", "--max-steps", "3")
    wait_for_steps(out, proc, 1)
    where = placement(c, out)
    assert where == {"inference:8000": {c.names[0]}, "orchestrator": {c.names[0]},
                     "trainer": {c.names[1], c.names[2]}}, where
    wait_for_new_weights_everywhere(out, proc)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    rows = steps(out)
    assert [r["step"] for r in rows] == [1, 2, 3] and set(rows[0]) == set(one_node_row)
    assert rows[0]["mismatch_kl"] < 1e-5 and one_node_row["mismatch_kl"] < 1e-5
    logs = out / "logs"
    assert (logs / "trainer-0.log").exists() and (logs / "trainer-1.log").exists()
    assert "parallelism fsdp on mesh" in (logs / "trainer-0.log").read_text()  # two ranks: `auto` is fsdp
    assert nothing_of(out) == []


def hit_tokens(url: str) -> float:
    return figure(url, "primerl_prefix_cache_hit_tokens_total")


def restored_from_the_pool(first: str, second: str, seed: int) -> bool:
    """A prompt no run sends, served by ``first`` then ``second``: whether ``second`` found
    its blocks (computed on the other node) in the pool."""
    prompt = [5 + (seed * 7 + i) % 200 for i in range(96)]
    before = hit_tokens(second)
    for url in (first, second):
        r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=120,
                       json={"model": "glm5", "prompt": prompt, "max_tokens": 2, "temperature": 0})
        r.raise_for_status()
    return hit_tokens(second) - before >= 80  # 5 of the 6 blocks of 16 tokens (the last is never full)


@pytest.mark.parametrize("cluster", [(3, 30)], indirect=True)
def test_three_nodes_two_inference_nodes_share_one_mooncake_pool(cluster, tmp_path, one_node_row):
    pytest.importorskip("primerl_kv_mooncake", reason="the mooncake KV store plugin is not installed")
    c, out = cluster, tmp_path / "run"
    proc = start(c, out, "--launcher.nodes", "3", "--launcher.inference_nodes", "2", "--max-steps", "8",
                 "--inference.kv_store", "mooncake", "--inference.kv_store_options.block_size", "16",
                 "--inference.kv_store_options.segment_bytes", str(64 << 20),
                 "--inference.kv_store_options.buffer_bytes", str(16 << 20))
    wait_for_steps(out, proc, 1)
    where = placement(c, out)
    assert where == {"kv_service": {c.names[0]}, "inference:8000": {c.names[0], c.names[1]},
                     "orchestrator": {c.names[0]}, "trainer": {c.names[2]}}, where
    runtime = json.loads((out / "runtime.json").read_text())
    a, b = runtime["inference_urls"]
    assert runtime["kv_store_options"]["master"] == f"{c.addresses[0]}:50051"
    assert (a, b) == (f"http://{c.addresses[0]}:8000", f"http://{c.addresses[1]}:8000")
    wait_for_new_weights_everywhere(out, proc)  # both nodes' servers load what the third node's trainer wrote
    assert figure(a, "primerl_requests_total") > 0 and figure(b, "primerl_requests_total") > 0  # the router uses both
    # a policy update between the two requests changes the blocks' keys: a few tries each way
    assert any(restored_from_the_pool(a, b, seed) for seed in range(5)), "node 1 never hit node 0's blocks"
    assert any(restored_from_the_pool(b, a, seed) for seed in range(5, 10)), "node 0 never hit node 1's blocks"
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    rows = steps(out)
    assert [r["step"] for r in rows] == list(range(1, 9)) and set(rows[0]) == set(one_node_row)
    assert rows[0]["mismatch_kl"] < 1e-5 and rows[-1]["inference/servers_up"] == 2
    assert nothing_of(out) == []
