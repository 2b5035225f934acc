"""The multi-node Slurm harness (tests/slurm_cluster.py): N nodes on this machine, each in a
network namespace of its own with its own address and hostname, munged and slurmctld
shared. Jobs span the nodes, each step sees its node's name and address, a node reaches
another's address but not its loopback, and teardown leaves nothing. Skipped, naming what
is missing, where Slurm, iproute2 or network namespaces are not available.

``PRIMERL_SLURM_NODES`` sets the cluster's size (2 to 4; default 3)."""

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster as sc

NODES = int(os.environ.get("PRIMERL_SLURM_NODES", "3"))
SCRIPT = Path(sc.__file__).resolve()


def run(cmd: list[str], env: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{' '.join(cmd)}: {r.returncode}\n{r.stdout}{r.stderr}"
    return r


def by_task(stdout: str) -> dict[int, list[str]]:
    """``srun -l`` output: each task's lines, by task number."""
    lines: dict[int, list[str]] = {}
    for line in stdout.splitlines():
        m = re.match(r"\s*(\d+): (.*)", line)
        if m:
            lines.setdefault(int(m.group(1)), []).append(m.group(2))
    return lines


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = sc.skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("cluster")
    with sc.slurm_cluster(root, NODES) as c:
        yield c
    assert sc.leftovers(root) == []


@pytest.mark.slow
def test_every_node_is_idle_with_its_own_address(cluster):
    assert cluster.sinfo() == {name: "idle" for name in cluster.names}
    for name, address in zip(cluster.names, cluster.addresses):
        shown = run(["scontrol", "show", "node", name], cluster.env).stdout
        assert f"NodeAddr={address} " in shown and f"NodeHostName={name} " in shown, shown


@pytest.mark.slow
def test_srun_runs_one_task_per_node_each_with_its_hostname_and_address(cluster):
    r = run(["srun", f"-N{NODES}", f"-n{NODES}", "-l", "sh", "-c",
             "hostname; ip -4 -o addr show; getent hosts $(hostname); getent hosts " + cluster.names[-1]], cluster.env)
    tasks = by_task(r.stdout)
    assert sorted(tasks) == list(range(NODES)), r.stdout
    for k, lines in tasks.items():
        name, address = cluster.names[k], cluster.addresses[k]
        assert lines[0] == name, lines
        inet = [ln.split()[3] for ln in lines if " inet " in ln]
        assert sorted(inet) == sorted(["127.0.0.1/8", f"{address}/24"]), lines  # loopback and its own, nothing else
        assert lines[-2].split() == ["127.0.1.1", name], lines  # its own name: loopback, as on a Debian node
        if k < NODES - 1:  # another node's name resolves to that node's address
            assert lines[-1].split() == [cluster.addresses[-1], cluster.names[-1]], lines


@pytest.mark.slow
def test_a_trainer_rank_finds_its_interface_towards_another_node(cluster):
    """primerl.parallel.interface_towards, which gloo's ranks bind (its own guess, the
    hostname's address, is 127.0.1.1 here as on a Debian node): on node 1, the interface on
    its route to node 0 is its eth0; towards its own name (loopback) there is none."""
    code = ("import socket; from primerl.parallel import interface_towards as at; "
            f"print(at({cluster.names[0]!r}), at({cluster.addresses[0]!r}), at(socket.gethostname()))")
    r = run(["srun", "-N1", f"--nodelist={cluster.names[1]}", sys.executable, "-c", code], cluster.env)
    assert r.stdout.split() == ["eth0", "eth0", "None"], r.stdout


@pytest.mark.slow
def test_this_python_runs_in_a_step_on_every_node(cluster):
    """The run directory and the Python environment are the same paths on every node; a
    node's own name resolves to loopback there (Debian's 127.0.1.1), never what another
    node reaches it at."""
    r = run(["srun", "-N2", "-n2", "-l", sys.executable, "-c",
             "import socket, sys; h = socket.gethostname(); print(h, socket.gethostbyname(h), sys.prefix)"],
            cluster.env)
    tasks = by_task(r.stdout)
    assert {k: v[0].split() for k, v in tasks.items()} == {
        k: [cluster.names[k], "127.0.1.1", sys.prefix] for k in (0, 1)}, r.stdout


# node B listens on every interface and, separately, on its loopback only; node A reaches
# the first through B's name (its address), and neither 127.0.0.1 nor B's address reaches the
# second: 127.0.0.1 is A's own loopback. B checks its loopback server answers it.
PROBE = r"""
import socket, sys, time
me, server, port, lo_port = socket.gethostname(), sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if me == server:
    lo = socket.create_server(("127.0.0.1", lo_port))
    with socket.create_connection(("127.0.0.1", lo_port), timeout=5):
        print(me, "own loopback: reached")
    pub = socket.create_server(("0.0.0.0", port))
    pub.settimeout(30)
    conn, peer = pub.accept()
    conn.sendall(me.encode())
    conn.recv(10)  # until the client has probed the loopback port and closes
    print(me, "served", peer[0])
else:
    deadline = time.time() + 30
    while True:
        try:
            conn = socket.create_connection((server, port), timeout=5)
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(0.2)
    print(me, "reached", server, conn.getpeername()[0], "answer", conn.recv(100).decode())
    for host in ("127.0.0.1", socket.gethostbyname(server)):
        try:
            socket.create_connection((host, lo_port), timeout=5).close()
            print(me, "loopback port", host, "reached")
        except OSError as exc:
            print(me, "loopback port", host, type(exc).__name__)
    conn.close()
"""


@pytest.mark.slow
def test_a_step_reaches_another_nodes_address_but_not_its_loopback(cluster):
    a, b = (1, 2) if NODES > 2 else (1, 0)
    names, addresses = cluster.names, cluster.addresses
    r = run(["srun", "-N2", "-n2", f"--nodelist={names[a]},{names[b]}", sys.executable, "-c", PROBE,
             names[b], "41000", "41001"], cluster.env)
    said = {name: [ln.split(" ", 1)[1] for ln in r.stdout.splitlines() if ln.startswith(name + " ")] for name in names}
    assert said[names[b]] == ["own loopback: reached", f"served {addresses[a]}"], r.stdout
    assert said[names[a]] == [f"reached {names[b]} {addresses[b]} answer {names[b]}",
                              "loopback port 127.0.0.1 ConnectionRefusedError",
                              f"loopback port {addresses[b]} ConnectionRefusedError"], r.stdout


@pytest.mark.slow
def test_a_batch_job_on_the_first_node_starts_steps_on_every_node(cluster, tmp_path):
    """What the slurm launcher's job does: its batch script, on the first node, lists the
    nodes and starts a step on each; every node writes into the shared directory."""
    tmp_path.chmod(0o755)
    script = tmp_path / "job.sh"
    script.write_text(f"""#!/bin/bash
#SBATCH --nodes={NODES}
#SBATCH --exclusive
#SBATCH --output={tmp_path}/job-%j.out
echo "batch on $(hostname)"
scontrol show hostnames "$SLURM_JOB_NODELIST"
srun --overlap --ntasks-per-node=1 sh -c 'echo "$(hostname) $SLURM_PROCID" > {tmp_path}/step-$(hostname)'
""")
    job = run(["sbatch", "--parsable", str(script)], cluster.env).stdout.strip()
    deadline = time.time() + 60
    while run(["squeue", "-h", "-j", job], cluster.env).stdout.strip() and time.time() < deadline:
        time.sleep(0.3)
    out = (tmp_path / f"job-{job}.out").read_text().splitlines()
    assert out == [f"batch on {cluster.names[0]}", *cluster.names], out
    for k, name in enumerate(cluster.names):
        assert (tmp_path / f"step-{name}").read_text().split() == [name, str(k)]


@pytest.mark.slow
def test_a_failing_with_block_still_tears_everything_down(tmp_path):
    """A test that fails while a job runs on every node (a cluster of another name, beside
    the module's): the context manager leaves nothing."""
    reason = sc.skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path / "c"
    with pytest.raises(RuntimeError, match="the test failed"), \
            sc.slurm_cluster(root, 2, prefix="prlfail", subnet="10.213.41") as c:
        run(["sbatch", "-N2", f"--output={root}/job.out", "--wrap", "srun --overlap -N2 sleep 999"], c.env)
        def sleeps() -> list[str]:  # the step's processes, one a node (srun resolves the path)
            return [line for line in sc.leftovers(root, "prlfail") if re.search(r"\(\S*sleep 999\)", line)]

        deadline = time.time() + 30
        while len(sleeps()) < 2 and time.time() < deadline:
            time.sleep(0.3)
        assert len(sleeps()) == 2, sc.leftovers(root, "prlfail")
        raise RuntimeError("the test failed")
    assert sc.leftovers(root, "prlfail") == []


def test_a_machine_without_iproute2_is_skipped_naming_it(tmp_path, monkeypatch):
    for tool in (*sc.DAEMONS, *sc.CLIENTS):  # Slurm is there, `ip` is not
        (tmp_path / tool).symlink_to("/bin/true")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert sc.skip_reason() == "`ip` is missing: apt-get install iproute2"
    (tmp_path / "srun").unlink()
    assert sc.skip_reason() == "Slurm is not installed (srun missing): apt-get install slurm-wlm munge"


@pytest.mark.slow
def test_the_script_brings_a_cluster_up_and_down_leaving_nothing(tmp_path):
    """``python tests/slurm_cluster.py up`` / ``down`` (a cluster of another name, beside the
    module's), torn down while a job runs on every node, with processes that left the
    job's process group: nothing of it is left."""
    reason = sc.skip_reason()
    if reason:
        pytest.skip(reason)
    prefix, root = "prlcli", tmp_path / "cli"
    up = subprocess.run([sys.executable, str(SCRIPT), "up", "--nodes", "2", "--dir", str(root), "--prefix", prefix,
                         "--subnet", "10.213.40"], capture_output=True, text=True, timeout=120)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        conf = root / "slurm.conf"
        assert f"export SLURM_CONF={conf}" in up.stdout and f"down --dir {root}" in up.stdout
        env = {**os.environ, "SLURM_CONF": str(conf)}
        status = run([sys.executable, str(SCRIPT), "status", "--prefix", prefix], env).stdout
        assert f"{prefix}-n0\tidle" in status and f"{prefix}-n1\tidle" in status, status
        here = run([sys.executable, str(SCRIPT), "exec", "1", "--dir", str(root), "--", "hostname"], env).stdout
        assert here.strip() == f"{prefix}-n1"
        here = run([sys.executable, str(SCRIPT), "exec", "head", "--dir", str(root), "--", "getent", "hosts",
                    f"{prefix}-n1"], env).stdout
        assert here.split() == ["10.213.40.11", f"{prefix}-n1"]  # the head resolves the nodes' names
        again = subprocess.run([sys.executable, str(SCRIPT), "up", "--nodes", "2", "--dir", str(tmp_path / "again"),
                                "--prefix", prefix, "--subnet", "10.213.40"], capture_output=True, text=True, timeout=60)
        assert again.returncode == 1 and f"a cluster named {prefix} is already up" in again.stderr, again.stderr
        assert sc.Cluster(root, 2, prefix=prefix).sinfo() == {f"{prefix}-n0": "idle", f"{prefix}-n1": "idle"}
        run(["sbatch", "-N2", f"--output={root}/job.out", "--wrap",
             'srun --overlap -N2 sh -c "setsid sleep 997 & exec sleep 998"'], env)

        def sleeps() -> list[str]:  # the job's processes, in the nodes' namespaces
            return [line for line in sc.leftovers(root, prefix) if re.search(r"\(\S*sleep 99[78]\)", line)]

        deadline = time.time() + 30
        while len(sleeps()) < 4 and time.time() < deadline:  # on both nodes: sleep 997 (its own session), 998
            time.sleep(0.3)
        assert len(sleeps()) == 4, sc.leftovers(root, prefix)
    finally:
        down = subprocess.run([sys.executable, str(SCRIPT), "down", "--dir", str(root)], capture_output=True,
                              text=True, timeout=120)
    assert down.returncode == 0 and "nothing left" in down.stdout, down.stdout + down.stderr
    assert sc.leftovers(root, prefix) == []
    ps = subprocess.run(["ps", "-eo", "stat,args"], capture_output=True, text=True).stdout
    assert not [ln for ln in ps.splitlines() if not ln.startswith("Z") and (str(root) in ln or "sleep 99" in ln)]
