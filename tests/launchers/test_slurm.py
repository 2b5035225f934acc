"""The slurm launcher: the job scripts it writes (everywhere), and whole runs through a real
one-node Slurm (munged, slurmctld and slurmd started here as root; skipped, saying why,
where Slurm or munge is not installed). Nothing of Slurm is mocked."""

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs
import pytest

from primerl.config import dump_toml, read_toml
from primerl.inference import InferenceConfig

SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
         "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "glm5-swe" / "config.toml"
DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol", "srun")


def primerl(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "primerl.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=timeout)


# --------------------------------------------------------------------------------------
# the scripts (no Slurm needed)
# --------------------------------------------------------------------------------------


def processes(out: Path) -> dict[str, tuple[str, str]]:
    """``OUT/slurm/processes.txt``: each process's node and command, by name."""
    lines = (out / "slurm" / "processes.txt").read_text().splitlines()
    rows = [re.fullmatch(r"(\S+)\ton (\S+): (.*)", line) for line in lines if not line.startswith("#")]
    return {m.group(1): (m.group(2), m.group(3)) for m in rows}


def test_dry_run_writes_job_scripts_bash_accepts(tmp_path):
    out = tmp_path / "run"
    r = primerl("run", "--model", "glm5", "--env", "swe", "--launcher", "slurm", "--launcher.nodes", "28",
                "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "nothing submitted" in r.stdout
    assert {p.name for p in (out / "slurm").iterdir()} == {"primerl.sbatch", "processes.txt"}
    batch = out / "slurm" / "primerl.sbatch"
    check = subprocess.run(["bash", "-n", str(batch)], capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    text = batch.read_text()
    assert "#SBATCH --nodes=28" in text and "#SBATCH --no-requeue" in text
    # the batch script holds no policy: it runs the job's own process, which supervises
    assert text.strip().splitlines()[-1] == f"exec {sys.executable} -m primerl_slurm.job {out}"
    # default split: 14 inference nodes (one server each), 14 trainer nodes under a c10d rendezvous
    procs = processes(out)
    assert [procs[f"inference-{i}"][0] for i in range(14)] == [f"node{i}" for i in range(14)]
    assert procs["orchestrator"][0] == "node0"
    assert [procs[f"trainer-{k}"][0] for k in range(14)] == [f"node{14 + k}" for k in range(14)]
    trainer = procs["trainer-3"][1]
    assert "--nnodes=14" in trainer and "--rdzv-backend=c10d" in trainer
    assert "'--rdzv-endpoint=<address of node 14>:29500'" in trainer
    assert "--inference.host 0.0.0.0 --inference.port 8000" in procs["inference-5"][1]
    config = (out / "config.toml").read_text()
    assert 'name = "slurm"' in config and "trainer_nodes = 14" in config and "dry_run = false" in config
    assert not list(out.glob("slurm/job-*"))  # nothing was submitted


def test_glm5_swe_example_resolves_to_its_layout(tmp_path):
    """The example's layout, checked here: vLLM is not installed in this environment and its
    backend's checks want CUDA on the submitting machine, so the run is resolved with the
    embedded backend's keys (every vLLM-only key of [inference] dropped); everything the
    launcher reads is the example's own."""
    example = read_toml(EXAMPLE)
    shared = attrs.fields_dict(InferenceConfig)
    example["inference"] = {k: v for k, v in example["inference"].items() if k in shared} | {"backend": "embedded"}
    example["trainer"]["weight_channel"] = "filesystem"
    cfg = tmp_path / "glm5-swe.toml"
    cfg.write_text(dump_toml(example))
    out = tmp_path / "run"
    r = primerl("run", "@", str(cfg), "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "28 nodes: 12 inference (12 server(s), 1 a node), 16 trainer (16 x 8 = 128 ranks)" in r.stdout
    batch = (out / "slurm" / "primerl.sbatch").read_text()
    assert "#SBATCH --nodes=28" in batch and "#SBATCH --gpus-per-node=8" in batch
    assert "#SBATCH --time=7-00:00:00" in batch and "#SBATCH --job-name=glm5-swe" in batch
    trainer = processes(out)["trainer-15"]
    assert trainer[0] == "node27" and "--nnodes=16" in trainer[1] and "--nproc-per-node=8" in trainer[1]
    assert subprocess.run(["bash", "-n", str(out / "slurm" / "primerl.sbatch")]).returncode == 0
    # and the trainer's layout fits an H200, as `primerl plan` counts it
    par = example["trainer"]["parallel"]
    plan = primerl("plan", "--model", "glm5", "--preset", "full", "--nodes", "16", "--gpus-per-node", "8",
                   "--seq-len", str(example["trainer"]["seq_len"]), "--fp8", "--dp-replicate", str(par["dp_replicate"]),
                   "--dp-shard", str(par["dp_shard"]), "--cp", str(par["cp"]), "--ep", str(par["ep"]), "--json")
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["fits"]


def test_layout_errors_name_the_keys(tmp_path):
    r = primerl("run", "--launcher", "slurm", "--launcher.nodes", "4", "--launcher.trainer_nodes", "4", "--dry-run",
                "--output-dir", str(tmp_path / "a"))
    assert r.returncode == 2 and "launcher.inference_nodes" in r.stderr and "launcher.nodes (4)" in r.stderr
    r = primerl("run", "--launcher", "slurm", "--launcher.nodes", "3", "--inference.replicas", "3",
                "--launcher.inference_nodes", "2", "--dry-run", "--output-dir", str(tmp_path / "b"))
    assert r.returncode == 2 and "inference.replicas (3) must be a multiple of launcher.inference_nodes (2)" in r.stderr
    # a trainer over two nodes is two ranks: `single` is refused when the config loads, `auto` is fsdp
    r = primerl("run", "--launcher", "slurm", "--launcher.nodes", "3", "--launcher.trainer_nodes", "2",
                "--trainer.parallelism", "single", "--dry-run", "--output-dir", str(tmp_path / "c"))
    assert r.returncode == 2 and "trainer.parallelism 'single'" in r.stderr, r.stderr
    assert "the trainer has 2 (trainer.nproc 1 x 2 trainer node(s)): use trainer.parallelism fsdp" in r.stderr
    from primerl.config import load_config, split_args

    cfg = load_config(split_args(["--launcher.name", "slurm", "--launcher.nodes", "3", "--launcher.trainer_nodes", "2"]))
    assert cfg.trainer.resolved_parallelism(cfg.trainer_world_size()) == "fsdp"
    # the local launcher keeps its one key
    r = primerl("run", "--launcher.nodes", "2", "--dry-run")
    assert r.returncode == 2 and "unknown key 'launcher.nodes'" in r.stderr


def test_dry_run_places_prefill_decode_servers_and_the_kv_stores_service(tmp_path):
    out = tmp_path / "run"
    r = primerl("run", "--launcher", "slurm", "--launcher.nodes", "3", "--launcher.inference_nodes", "2",
                "--inference.prefill_replicas", "2", "--inference.decode_replicas", "2",
                "--inference.kv_store", "mooncake", "--dry-run", "--output-dir", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    procs = processes(out)
    # the store's declared run service (Mooncake's master) first, on the first node at its
    # address, its ports from launcher.kv_service_port; two servers a node, each pool's role
    assert list(procs)[0] == "kv_service" and procs["kv_service"][0] == "node0"
    service = shlex.split(procs["kv_service"][1])
    assert service[1:] == ["-m", "primerl.kv_service", str(out / "config.toml"),
                           "--options", str(out / "slurm" / "job-<job id>.kv.json"),
                           "--host", "<address of node 0>", "--port", "50051", "--launch", "<job id>"]
    assert {name: procs[name][0] for name in procs if name.startswith("inference")} == {
        "inference-prefill-0": "node0", "inference-prefill-1": "node0",
        "inference-decode-0": "node1", "inference-decode-1": "node1"}
    assert "--inference.port 8001 --inference.role decode" in procs["inference-decode-1"][1]
    assert procs["trainer"][0] == "node2" and "torch.distributed.run" not in procs["trainer"][1]


def test_the_job_places_each_layout_and_names_servers_by_address(tmp_path):
    """primerl_slurm.job.place on three named nodes, for the two layouts of the multi-node
    runs: the trainer on two nodes, or two inference nodes; the URLs and the rendezvous use
    the nodes' addresses."""
    from primerl_slurm.job import Node, place, server_urls, step, threads_of
    from primerl_slurm.scripts import layout

    from primerl.config import load_config, split_args
    from primerl.rundir import RunDir

    nodes = [Node(f"n{k}", f"10.0.0.{10 + k}") for k in range(3)]

    def placed(*flags: str):
        cfg = load_config(split_args(["--model.name", "glm5", "--env.name", "reverse-text", "--launcher.name", "slurm",
                                      "--launcher.nodes", "3", *flags]))
        lay = layout(cfg)
        cfg.inference.replicas = lay.servers
        return cfg, lay, place(cfg, RunDir(tmp_path), lay, nodes, [8000], python="py", job_id="7")

    cfg, lay, procs = placed("--launcher.trainer_nodes", "2", "--trainer.parallelism", "fsdp")
    assert [(p.name, p.node.name) for p in procs] == [("inference", "n0"), ("orchestrator", "n0"),
                                                      ("trainer-0", "n1"), ("trainer-1", "n2")]
    assert "--rdzv-endpoint=10.0.0.11:29500" in procs[2].command and "--rdzv-id=7" in procs[3].command
    # the first trainer node hosts the rendezvous's store, whatever its hostname resolves to
    assert "--rdzv-conf=is_host=1" in procs[2].command and "--rdzv-conf=is_host=0" in procs[3].command
    assert "--local-addr=10.0.0.11" in procs[2].command and "--local-addr=10.0.0.12" in procs[3].command
    assert server_urls(cfg, lay, nodes, [8000]) == ["http://10.0.0.10:8000"]
    cfg, lay, procs = placed("--launcher.inference_nodes", "2")
    assert [(p.name, p.node.name) for p in procs] == [("inference-0", "n0"), ("inference-1", "n1"),
                                                      ("orchestrator", "n0"), ("trainer", "n2")]
    assert server_urls(cfg, lay, nodes, [8000]) == ["http://10.0.0.10:8000", "http://10.0.0.11:8000"]
    assert step(procs[1], 8, tmp_path / "s.sh") == [
        "srun", "--overlap", "--nodes=1", "--ntasks=1", "--nodelist=n1", "--cpus-per-task=8", "--kill-on-bad-exit=0",
        "--input=none", "--job-name=inference-1", "--export=ALL", str(tmp_path / "s.sh")]
    assert threads_of(procs[3], cfg, lay, cpus=8)["OMP_NUM_THREADS"] == "8"  # nodes of their own: all of it


# --------------------------------------------------------------------------------------
# a real one-node Slurm
# --------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tails(root: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                     for p in sorted(root.glob("*.log")))


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    """A one-node Slurm cluster of its own (temp dir, free ports, its own munge key and
    socket): yields the environment its client commands need; at the end cancels what is
    left and stops the daemons it started."""
    missing = [d for d in DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("a one-node Slurm with SlurmUser=root needs root")
    root = tmp_path_factory.mktemp("slurm")
    root.chmod(0o755)  # munged wants its socket's directory reachable
    key = root / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    host = socket.gethostname().split(".")[0]
    probe = subprocess.run(["slurmd", "-C"], capture_output=True, text=True)
    node = next((ln for ln in probe.stdout.splitlines() if ln.startswith("NodeName=")), "")
    cpus = re.search(r"\bCPUs=(\d+)", node)
    memory = re.search(r"\bRealMemory=(\d+)", node)
    if not cpus:
        pytest.fail(f"slurmd -C did not describe this node: {probe.stdout}{probe.stderr}")
    hw = " ".join(re.findall(r"\b(?:CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=\d+", node))
    (root / "spool" / "ctld").mkdir(parents=True)
    (root / "spool" / "d").mkdir(parents=True)
    conf = root / "slurm.conf"
    conf.write_text(f"""\
ClusterName=primerltest
SlurmctldHost={host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
StateSaveLocation={root}/spool/ctld
SlurmdSpoolDir={root}/spool/d
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={host} NodeAddr=127.0.0.1 {hw} RealMemory={int(memory.group(1)) if memory else 1000} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
""")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    procs: list[subprocess.Popen] = []

    def start(*cmd: str, log: str) -> None:
        procs.append(subprocess.Popen(list(cmd), env=env, stdout=open(root / log, "w"),  # noqa: SIM115
                                      stderr=subprocess.STDOUT, start_new_session=True))

    try:
        start("munged", "-F", "-f", f"--socket={root}/munge.socket", f"--key-file={key}",
              f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munged.seed",
              log="munged.out.log")
        for _ in range(50):
            if (root / "munge.socket").exists():
                break
            time.sleep(0.1)
        start("slurmctld", "-D", "-f", str(conf), log="slurmctld.out.log")
        start("slurmd", "-D", "-f", str(conf), log="slurmd.out.log")
        deadline = time.time() + 60
        state = ""
        while time.time() < deadline:
            r = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
            state = r.stdout.strip()
            if state == "idle":
                break
            if any(p.poll() is not None for p in procs):
                break
            time.sleep(0.5)
        if state != "idle":
            pytest.fail(f"the one-node Slurm did not come up (sinfo: {state!r}):\n{_tails(root)}")
        yield {"SLURM_CONF": str(conf)}
    finally:
        jobs = subprocess.run(["squeue", "-h", "-o", "%i"], env=env, capture_output=True, text=True).stdout.split()
        if jobs:
            subprocess.run(["scancel", *jobs], env=env, capture_output=True)
            for _ in range(60):
                if not subprocess.run(["squeue", "-h"], env=env, capture_output=True, text=True).stdout.strip():
                    break
                time.sleep(0.5)
        for p in reversed(procs):  # slurmd, slurmctld, munged: each one we started, by its pid
            p.terminate()
        for p in reversed(procs):
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _job_id(stdout: str) -> str:
    m = re.search(r"submitted Slurm job (\d+)", stdout)
    assert m, stdout
    return m.group(1)


def _queue(env: dict, job: str) -> str:
    """The job's line in the default squeue (pending, running, completing): empty once it is gone."""
    return subprocess.run(["squeue", "-h", "-j", job], env={**os.environ, **env}, capture_output=True,
                          text=True).stdout.strip()


def _processes_of(out: Path) -> list[str]:
    """Live processes whose command line names the run directory (the job's roles do)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if str(out) in cmd and state != "Z":
                found.append(f"{entry.name}: {cmd}")
    return found


@pytest.mark.slow
def test_one_node_run_completes_through_sbatch(slurm, tmp_path):
    out = tmp_path / "run"
    r = primerl("run", "--model", "glm5", "--env", "reverse-text", "--launcher", "slurm", "--launcher.nodes", "1",
                "--max-steps", "3", "--output-dir", str(out), *SMALL, env=slurm, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    job = _job_id(r.stdout)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert "reward curve" in r.stdout and f"Slurm job {job}: COMPLETED" in r.stdout
    status = (out / "slurm" / f"job-{job}.status").read_text()
    assert "rc=0" in status and "role=trainer" in status
    assert _queue(slurm, job) == ""
    assert (out / "logs" / f"slurm-{job}.out").exists()
    for name in ("inference", "orchestrator", "trainer"):
        assert (out / "logs" / f"{name}.log").exists(), name
    time.sleep(1)
    assert _processes_of(out) == []


@pytest.mark.slow
def test_a_third_party_kv_stores_service_runs_in_the_job(slurm, tmp_path):
    """A KV store from outside the repository (tests/third_party_kv.py) declaring a run
    service: the job runs it as its kv_service step until the run ends, and every server's
    store gets the options it set (the run-time record), without primerl naming the store."""
    from third_party_kv import STORE, env_with, write_store

    site = write_store(tmp_path / "third-party")
    out = tmp_path / "run"
    r = primerl("run", "--model", "glm5", "--env", "reverse-text", "--launcher", "slurm", "--launcher.nodes", "1",
                "--max-steps", "2", "--inference.kv_store", STORE, "--output-dir", str(out), *SMALL,
                env={**slurm, "PYTHONPATH": env_with(site)["PYTHONPATH"]}, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    job = _job_id(r.stdout)
    assert json.loads((out / "runtime.json").read_text())["kv_store_options"] == {"pool": "127.0.0.1:0",
                                                                                   "launch": job}
    assert "third-party pool at 127.0.0.1:0" in (out / "logs" / "kv_service.log").read_text()
    assert _queue(slurm, job) == ""
    time.sleep(1)
    assert _processes_of(out) == []


@pytest.mark.slow
def test_failing_role_fails_the_run_with_its_cause(slurm, tmp_path):
    out = tmp_path / "run"
    r = primerl("run", "--model", "glm5", "--env", "reverse-text", "--launcher", "slurm", "--max-steps", "3",
                "--output-dir", str(out), *SMALL, "--trainer.loss", "no_such_module:loss", env=slurm, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr  # the trainer's code (a config error) is the job's and the run's
    assert re.search(r"the trainer process on \S+ exited with code 2", r.stderr) and "no_such_module" in r.stderr
    assert "logs/trainer.log" in r.stderr
    job = _job_id(r.stdout)
    assert _queue(slurm, job) == ""
    time.sleep(1)
    assert _processes_of(out) == []


@pytest.mark.slow
def test_ctrl_c_cancels_the_job(slurm, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--launcher", "slurm", "--max-steps", "1000", "--output-dir", str(out), *SMALL],
                            env={**os.environ, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:  # training under way: every role is running in the job
        if (out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip():
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=150)
    assert proc.returncode == 130, stdout + stderr
    assert "cancelling Slurm job" in stderr
    assert _queue(slurm, _job_id(stdout)) == ""
    deadline = time.time() + 30
    while _processes_of(out) and time.time() < deadline:
        time.sleep(0.5)
    assert _processes_of(out) == []


@pytest.mark.slow
def test_a_lost_inference_server_is_started_again_inside_the_job(slurm, tmp_path):
    """Two servers in the job's inference step; one is SIGKILLed mid-run: its task starts it
    again on its port, the orchestrator readmits it, and the job completes."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--launcher", "slurm", "--inference.replicas", "2", "--max-steps", "200",
                             "--output-dir", str(out), *SMALL],
                            env={**os.environ, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    servers = [p for p in _processes_of(out) if "primerl.cli inference" in p]  # not their tasks' bash
    assert len(servers) == 2, servers
    victim = servers[0]
    port = re.search(r"--inference\.port (\d+)", victim).group(1)
    os.kill(int(victim.split(":", 1)[0]), signal.SIGKILL)
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stdout + stderr
    assert f"Slurm job {_job_id(stdout)}: COMPLETED" in stdout
    logs = "".join((out / "logs" / f"inference-{i}.log").read_text() for i in (0, 1))
    assert "the server exited with code 137; restarting it (1 of at most 3)" in logs
    orchestrator = (out / "logs" / "orchestrator.log").read_text()
    assert f":{port} answers /health: back in routing" in orchestrator, orchestrator[-2000:]
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 201))
    assert rows[-1]["inference/servers_up"] == 2  # serving again by the end
    time.sleep(1)
    assert _processes_of(out) == []


@pytest.mark.slow
def test_a_stalled_job_is_named_and_cancelled(slurm, tmp_path):
    """The trainer stopped (SIGSTOP) inside the job: the job's supervisor, on the node, reads
    the beacons, names the stopped process and stops the job (exit code 3)."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                             "--launcher", "slurm", "--max-steps", "1000", "--output-dir", str(out), *SMALL,
                             "--watchdog.stall_timeout_s", "10"],
                            env={**os.environ, **slurm}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline:  # training under way
        if (out / "metrics.jsonl").exists() and len((out / "metrics.jsonl").read_text().splitlines()) >= 2:
            break
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    (beacon,) = [json.loads(p.read_text()) for p in (out / "progress").glob("trainer-*.json")]
    os.kill(beacon["pid"], signal.SIGSTOP)
    try:
        stdout, stderr = proc.communicate(timeout=10 + 30 + 150)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(beacon["pid"], signal.SIGCONT)
    assert proc.returncode == 3, stdout + stderr
    line = stderr.strip().splitlines()[-1]
    assert "the run made no progress for 10 s: the trainer process" in line and "is stopped" in line, line
    assert "stopped Slurm job" in line
    report = (out / "logs" / "watchdog.log").read_text()
    assert "== orchestrator" in report and "stacks written to orchestrator.log after SIGUSR1" in report
    assert _queue(slurm, _job_id(stdout)) == ""


def test_trainer_threads_reach_the_trainer_locally_and_under_slurm(tmp_path):
    """``trainer.threads`` gives the trainer more than its share of the cores; idle OpenMP
    threads then sleep (OMP_WAIT_POLICY=PASSIVE) in every role, so the overlap costs little."""
    from primerl_local.launcher import child_env

    from primerl.config import load_config, split_args

    base = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cfg = load_config(split_args(["--model.name", "glm5", "--env.name", "reverse-text"]))
    assert child_env("trainer", cfg, base) == base  # default: the share, no wait policy
    cfg = load_config(split_args(["--model.name", "glm5", "--env.name", "reverse-text", "--trainer.threads", "2"]))
    if "OMP_WAIT_POLICY" not in os.environ:
        assert child_env("trainer", cfg, base) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                   "OMP_WAIT_POLICY": "PASSIVE"}
        assert child_env("inference", cfg, base)["OMP_WAIT_POLICY"] == "PASSIVE"
    assert child_env("inference", cfg, base)["OMP_NUM_THREADS"] == "1"
    from primerl_slurm.job import Node, place, threads_of
    from primerl_slurm.scripts import layout

    from primerl.rundir import RunDir

    cfg = load_config(split_args(["--model.name", "glm5", "--env.name", "reverse-text", "--launcher.name", "slurm",
                                  "--trainer.threads", "4", "--trainer.nproc", "2", "--trainer.parallelism", "fsdp"]))
    lay = layout(cfg)
    trainer = place(cfg, RunDir(tmp_path), lay, [Node("n0", "127.0.0.1")], [0], python="py")[-1]
    assert threads_of(trainer, cfg, lay, cpus=16) == {"OMP_NUM_THREADS": "2", "MKL_NUM_THREADS": "2",
                                                      "OMP_WAIT_POLICY": "PASSIVE"}  # 4 over its 2 ranks
