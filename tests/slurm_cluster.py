"""An N-node Slurm cluster on this machine, each node in a network namespace of its own.

    python tests/slurm_cluster.py up --nodes 3 --dir /tmp/cluster   # prints how to use it
    python tests/slurm_cluster.py status [--dir /tmp/cluster]
    python tests/slurm_cluster.py exec 1 [--dir /tmp/cluster] -- hostname   # a command on node 1
    python tests/slurm_cluster.py exec head -- primerl run ...   # here, the nodes' names resolving
    python tests/slurm_cluster.py down [--dir /tmp/cluster]

Tests use :func:`slurm_cluster` (a context manager) or :class:`Cluster` directly, and
:func:`skip_reason` to skip, naming what is missing, where the machine cannot host one.

Layout (docs/slurm.md, "A multi-node cluster on one machine"):

* a bridge ``primerl-br`` in the root namespace holding ``SUBNET.1/24``, the head's address:
  ``munged`` (its socket is a file every node reads) and ``slurmctld`` run there, as on a head
  node, and so do the client commands (``sbatch``, ``squeue``, ``srun``) the tests run;
* node k: network namespace ``primerl-nk``, a veth pair (``primerl-vk`` on the bridge,
  ``eth0`` inside) with ``SUBNET.(10+k)/24``, its own loopback, its own hostname
  ``primerl-nk`` (a UTS namespace of its own) and its own ``/etc/hosts`` (the other nodes'
  names and the head's; its own name at 127.0.1.1, as Debian's installer writes it, so that
  code taking "my hostname's address" for what other nodes reach fails here as there; bound
  over the machine's file in a mount namespace of its own: ``Cluster.node_command``),
  and its ``slurmd -N primerl-nk``. Everything slurmd starts (job steps) inherits all of it, so a
  step sees its node's hostname and address, and 127.0.0.1 is the node's own loopback:
  a process that binds loopback cannot be reached from another node, as on a real cluster.
  The filesystem is shared (the run directory and the Python environment are the same
  paths on every node).

Teardown (:meth:`Cluster.down`, also ``down`` on the command line, also after a failed
``up``): the jobs cancelled, every process of every node's namespace killed (slurmd,
slurmstepd and whatever the jobs started), the namespaces, veths and bridge deleted, then
slurmctld and munged stopped; :func:`leftovers` says what, if anything, is left.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

PREFIX = "primerl"
SUBNET = "10.213.39"  # a private /24: the head .1, node k .(10 + k)
SLURMD_PORT = 6818  # the same on every node: each node has an address (and ports) of its own
CLIENTS = ("sinfo", "srun", "sbatch", "squeue", "scancel", "scontrol")
DAEMONS = ("munged", "slurmctld", "slurmd")
STATE = "cluster.json"


def _run(*cmd: str, check: bool = True, env: dict | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    r = subprocess.run(list(cmd), capture_output=True, text=True, env=env, timeout=timeout)
    if check and r.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}")
    return r


def skip_reason() -> str | None:
    """Why this machine cannot host the cluster (one line naming the package or the
    capability), or None."""
    missing = [c for c in (*DAEMONS, *CLIENTS) if shutil.which(c) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux"), ("nsenter", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` is missing: apt-get install {package}"
    if os.geteuid() != 0:
        return "a namespaced Slurm cluster needs root (network namespaces, SlurmUser=root)"
    probe = f"{PREFIX}-probe{os.getpid()}"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot create network namespaces (`ip netns add`: {r.stderr.strip()})"
    try:
        for what, cmd in (("a bridge", ["ip", "link", "add", "pbr", "type", "bridge"]),
                          ("a veth pair", ["ip", "link", "add", "pva", "type", "veth", "peer", "name", "pvb"])):
            r = _run("ip", "netns", "exec", probe, *cmd, check=False)
            if r.returncode != 0:
                return f"cannot create {what} in a network namespace ({r.stderr.strip()})"
        r = _run("ip", "netns", "exec", probe, "unshare", "--uts", "hostname", "probe", check=False)
        if r.returncode != 0:
            return f"cannot give a namespace a hostname of its own (`unshare --uts`: {r.stderr.strip()})"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


# --------------------------------------------------------------------------------------
# processes
# --------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The process's start time (clock ticks after boot): with the pid, who it is."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, start: int | None) -> bool:
    """The process ``pid`` started at ``start`` is still there (and not a zombie)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z" and (start is None or _start_time(pid) == start)


def _stop(procs: list[tuple[int, int | None]], grace: float = 10) -> None:
    """SIGTERM each process of ``procs`` (pid, start time) that is still the same one, then
    SIGKILL what is left after ``grace`` seconds."""
    for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 5)):
        live = [(p, s) for p, s in procs if _alive(p, s)]
        for pid, _ in live:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while any(_alive(p, s) for p, s in live) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.1)


_CHILDREN: list[subprocess.Popen] = []  # the daemons this process started (a `with` block's)


def _reap() -> None:
    """Collect the exit status of the daemons this process started that have ended (no
    zombies while a test runs); never another child's (a test's own Popen keeps its code)."""
    _CHILDREN[:] = [p for p in _CHILDREN if p.poll() is None]


def _spawn(cmd: list[str], env: dict, log: Path, mode: str = "w") -> subprocess.Popen:
    """A daemon in a session of its own, its output in ``log``."""
    with open(log, mode) as out:
        p = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                             start_new_session=True)
    _CHILDREN.append(p)
    return p


def _netns_inode(name: str) -> int | None:
    try:
        return os.stat(f"/run/netns/{name}").st_ino
    except OSError:
        return None


def _pids_in_netns(inodes: set[int]) -> list[tuple[int, int | None]]:
    """Every live process whose network namespace is one of ``inodes``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            link = os.readlink(entry / "ns" / "net")
        except OSError:
            continue
        m = re.fullmatch(r"net:\[(\d+)\]", link)
        pid = int(entry.name)
        if m and int(m.group(1)) in inodes and _alive(pid, None):
            found.append((pid, _start_time(pid)))
    return found


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _daemons_of(root: Path) -> list[str]:
    """Live munged/slurmctld/slurmd/slurmstepd processes whose command line names ``root``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm in (*DAEMONS, "slurmstepd") and str(root) in _cmdline(int(entry.name)) and _alive(int(entry.name), None):
            found.append(f"{comm} (pid {entry.name}): {_cmdline(int(entry.name)).strip()}")
    return found


def _namespaces(prefix: str) -> list[str]:
    r = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
    return [n for n in names if n.startswith(f"{prefix}-")]


def _links(prefix: str) -> list[str]:
    r = _run("ip", "-o", "link", "show", check=False)
    names = [line.split(":")[1].strip().split("@")[0] for line in r.stdout.splitlines() if ":" in line]
    return [n for n in names if n.startswith(f"{prefix}-")]


def leftovers(root: str | Path | None = None, prefix: str = PREFIX) -> list[str]:
    """What a cluster leaves behind, one line each (empty: nothing): namespaces, links and
    named ``prefix-*``; with ``root`` (the cluster's directory) also
    its daemons (munged, slurmctld, slurmd, slurmstepd naming ``root``) and every process
    still inside one of the network namespaces it made."""
    found = [f"network namespace {n}" for n in _namespaces(prefix)]
    found += [f"network link {n}" for n in _links(prefix)]
    if root is not None:
        root = Path(root).resolve()
        found += _daemons_of(root)
        state = root / STATE
        if state.exists():
            inodes = {n["netns_inode"] for n in json.loads(state.read_text())["nodes"] if n.get("netns_inode")}
            found += [f"process {pid} ({_cmdline(pid).strip()}) in a node's namespace"
                      for pid, _ in _pids_in_netns(inodes)]
    return found


# --------------------------------------------------------------------------------------
# the cluster
# --------------------------------------------------------------------------------------


def slurmd_spool(prefix: str) -> Path:
    """The nodes' SlurmdSpoolDir (``/tmp/PREFIX-slurmd/NODE``), outside ``root``: slurmstepd
    makes its Unix sockets there (``NODE_JOB.STEP``), and a socket's path may not pass 108
    bytes, which a test's or a CI machine's temporary directory alone can come near."""
    return Path("/tmp") / f"{prefix}-slurmd"


class Cluster:
    """An N-node Slurm cluster in ``root`` (its config, keys, slurmctld state and logs; the nodes' spools in :func:`slurmd_spool`):
    :meth:`up` starts it, :meth:`down` leaves nothing of it. ``env`` is what the Slurm
    client commands need (``SLURM_CONF``); ``names[k]`` and ``addresses[k]`` are node k's
    hostname (also its Slurm node name and its namespace) and IPv4 address."""

    def __init__(self, root: str | Path, nodes: int = 3, *, prefix: str = PREFIX, subnet: str = SUBNET,
                 extra_conf: str = "", slurmd_timeout: int = 30):
        if not 1 <= nodes <= 200:
            raise ValueError(f"nodes must be 1..200, not {nodes}")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,8}", prefix):
            raise ValueError(f"prefix must be a short lowercase name (interface names are at most 15 characters): {prefix!r}")
        if not re.fullmatch(r"(\d{1,3})\.(\d{1,3})\.(\d{1,3})", subnet):
            raise ValueError(f"subnet names a /24 by its first three numbers (like {SUBNET}), not {subnet!r}")
        self.root = Path(root).resolve()
        self.nodes, self.prefix, self.subnet, self.extra_conf = nodes, prefix, subnet, extra_conf
        # seconds a node's slurmd may not answer before Slurm sets it DOWN (and fails its jobs: NODE_FAIL)
        self.slurmd_timeout = slurmd_timeout
        self.names = [f"{prefix}-n{k}" for k in range(nodes)]
        self.addresses = [f"{subnet}.{10 + k}" for k in range(nodes)]
        self.head_address = f"{subnet}.1"
        self.head = socket.gethostname().split(".")[0]
        self.bridge = f"{prefix}-br"
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ----- what tests use

    def node_command(self, k: int, *cmd: str) -> list[str]:
        """``cmd`` as node k runs it, outside Slurm: in its network namespace, with its
        hostname and its ``/etc/hosts`` (a mount namespace of its own binds it; ``/sys`` stays
        the machine's, which slurmd's cgroup code reads)."""
        etc = self.root / "etc" / self.names[k]
        return ["nsenter", f"--net=/run/netns/{self.names[k]}", "unshare", "--mount", "--uts", "--propagation",
                "private", "sh", "-c",
                'mount --bind "$1/hosts" /etc/hosts && { [ ! -e /etc/hostname ] || mount --bind "$1/hostname" '
                '/etc/hostname; } && hostname "$0" && shift && exec "$@"', self.names[k], str(etc), *cmd]

    def head_command(self, *cmd: str) -> list[str]:
        """``cmd`` on the head (the machine's own network namespace, where slurmctld runs and
        ``primerl run`` submits from), resolving the nodes' names as a login node does: the
        machine's ``/etc/hosts`` with the nodes added, bound in a mount namespace of its own
        (the machine's own file is not touched)."""
        return ["unshare", "--mount", "--propagation", "private", "sh", "-c",
                'mount --bind "$0" /etc/hosts && exec "$@"', str(self.root / "etc" / "head" / "hosts"), *cmd]

    def sinfo(self) -> dict[str, str]:
        """Each node's state as ``sinfo`` says it (``idle``, ``alloc``, ``down*``...)."""
        r = _run("sinfo", "-h", "-N", "-o", "%N %T", env=self.env, check=False)
        return dict(line.split() for line in r.stdout.splitlines() if len(line.split()) == 2)

    def kill_node(self, k: int) -> None:
        """Node k lost: its slurmd and every process in its namespace SIGKILLed (the
        namespace stays: :meth:`start_node` brings the node back)."""
        inode = _netns_inode(self.names[k])
        deadline = time.monotonic() + 10
        while inode is not None and (procs := _pids_in_netns({inode})) and time.monotonic() < deadline:
            for pid, start in procs:  # slurmd may fork a step while we kill: until none is left
                if _alive(pid, start):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)
            _reap()

    def start_node(self, k: int) -> int:
        """Start node k's slurmd (in its namespace, with its hostname); returns its pid.
        After :meth:`kill_node`, only once Slurm has set the node down (``sinfo``): every
        node reports the machine's uptime, so a slurmd back sooner is not taken for a
        rebooted node, and a job that had steps on it waits for them (until primerl's
        watchdog reports the stall)."""
        cmd = self.node_command(k, "slurmd", "-D", "-N", self.names[k], "-f", str(self.conf))
        return _spawn(cmd, self.env, self.root / "log" / f"{self.names[k]}.out", "a").pid

    def wait_idle(self, timeout: float = 60) -> None:
        """Until every node is ``idle``; RuntimeError with the daemons' logs if not in time."""
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.sinfo()
            if all(states.get(n) == "idle" for n in self.names):
                return
            _reap()
            time.sleep(0.5)
        raise RuntimeError(f"the nodes are not idle after {timeout:.0f} s (sinfo: {states}):\n{self.log_tails()}")

    def log_tails(self, lines: int = 15) -> str:
        return "\n".join(f"--- {p}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                         for p in sorted((self.root / "log").glob("*")) if p.is_file())

    def usage(self) -> str:
        nodes = f"{self.prefix}-n[0-{self.nodes - 1}]" if self.nodes > 1 else self.names[0]
        me = f"python {Path(__file__).resolve()}"
        return "\n".join([
            f"a {self.nodes}-node Slurm cluster is up: nodes {nodes} at "
            f"{self.addresses[0]}..{self.addresses[-1]}, slurmctld at {self.head} ({self.head_address})",
            f"  export SLURM_CONF={self.conf}",
            "  sinfo -N",
            f"  srun -N{self.nodes} -l hostname",
            f"  {me} exec 0 --dir {self.root} -- ip -4 addr   # on node 0, outside Slurm",
            f"  {me} exec head --dir {self.root} -- primerl run ...   # here, the nodes' names resolving",
            f"  {me} down --dir {self.root}",
            f"logs: {self.root / 'log'}",
        ])

    # ----- up and down

    def up(self, timeout: float = 60) -> Cluster:
        """Start it; on any failure, tear down what was made and raise (RuntimeError, with
        the daemons' logs where one did not come up). A cluster of the same name already up
        is refused, and left alone."""
        reason = skip_reason()
        if reason:
            raise RuntimeError(reason)
        taken = _namespaces(self.prefix) + _links(self.prefix)
        if taken:
            raise RuntimeError(f"a cluster named {self.prefix} is already up ({', '.join(taken)}): "
                               f"python {Path(__file__).resolve()} down [--dir DIR]")
        for line in _run("ip", "-4", "route", "show").stdout.splitlines():
            if line.startswith(f"{self.subnet}.") or f" {self.subnet}." in line:
                raise RuntimeError(f"{self.subnet}.0/24 is in use on this machine ({line.strip()}): pick another "
                                   f"subnet (--subnet)")
        try:
            self._up(timeout)
        except BaseException:
            self.down()
            raise
        return self

    def _up(self, timeout: float) -> None:
        root = self.root
        for d in ("spool/ctld", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        root.chmod(0o755)  # munged wants its socket's directory reachable
        state: dict = {"root": str(root), "prefix": self.prefix, "subnet": self.subnet, "bridge": self.bridge,
                       "nodes": [{"name": n, "address": a} for n, a in zip(self.names, self.addresses)],
                       "daemons": {}}

        def save() -> None:
            (root / f"{STATE}.tmp").write_text(json.dumps(state, indent=1))
            (root / f"{STATE}.tmp").replace(root / STATE)

        save()
        key = root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._write_conf()

        # the network: a bridge holding the head's address, a namespace a node
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        # bridged frames skip the host's iptables (a FORWARD policy of DROP would eat them)
        _run("ip", "link", "set", self.bridge, "type", "bridge", "nf_call_iptables", "0", check=False)
        _run("ip", "addr", "add", f"{self.head_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        cluster_hosts = [f"{a}\t{n}" for n, a in zip(self.names, self.addresses)]

        def node_hosts(k: int) -> str:  # as on a Debian node: its own name at 127.0.1.1, the others' addresses
            others = [line for j, line in enumerate(cluster_hosts) if j != k]
            return "\n".join(["127.0.0.1\tlocalhost", f"127.0.1.1\t{self.names[k]}",
                              f"{self.head_address}\t{self.head}", *others, ""])
        (root / "etc" / "head").mkdir(parents=True, exist_ok=True)
        machine = Path("/etc/hosts").read_text() if Path("/etc/hosts").exists() else "127.0.0.1\tlocalhost\n"
        (root / "etc" / "head" / "hosts").write_text(machine.rstrip("\n") + "\n# the cluster's nodes\n"
                                                     + "\n".join(cluster_hosts) + "\n")
        for k, (name, address) in enumerate(zip(self.names, self.addresses)):
            veth = f"{self.prefix}-v{k}"
            _run("ip", "netns", "add", name)
            state["nodes"][k]["netns_inode"] = _netns_inode(name)
            save()
            etc = root / "etc" / name  # node_command binds these over /etc/hosts and /etc/hostname
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(node_hosts(k))
            (etc / "hostname").write_text(name + "\n")
            (slurmd_spool(self.prefix) / name).mkdir(parents=True, exist_ok=True)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", name)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", f"{address}/24", "dev", "eth0"],
                        ["ip", "link", "set", "eth0", "up"]):
                _run("ip", "netns", "exec", name, *cmd)

        def start(name: str, *cmd: str) -> None:
            p = _spawn(list(cmd), self.env, root / "log" / f"{name}.out")
            state["daemons"][name] = [p.pid, _start_time(p.pid)]
            save()

        # munged and slurmctld on the head (the root namespace), a slurmd in every node's
        start("munged", "munged", "-F", "-f", f"--socket={root}/munge.socket", f"--key-file={key}",
              f"--pid-file={root}/munged.pid", f"--log-file={root}/log/munged.log",
              f"--seed-file={root}/munged.seed")
        self._wait(lambda: (root / "munge.socket").exists(), 10, "munged did not create its socket")
        start("slurmctld", "slurmctld", "-D", "-f", str(self.conf))
        self._wait(lambda: "UP" in _run("scontrol", "ping", env=self.env, check=False).stdout, timeout,
                   "slurmctld does not answer `scontrol ping`")
        for k, name in enumerate(self.names):
            pid = self.start_node(k)
            state["daemons"][f"slurmd-{name}"] = [pid, _start_time(pid)]
            save()
        self.wait_idle(timeout)

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f} s:\n{self.log_tails()}")
            _reap()
            time.sleep(0.2)

    def _write_conf(self) -> None:
        root = self.root
        probe = _run("slurmd", "-C", check=False)
        node = next((ln for ln in probe.stdout.splitlines() if ln.startswith("NodeName=")), "")
        hw = " ".join(re.findall(r"\b(?:CPUs|Boards|SocketsPerBoard|CoresPerSocket|ThreadsPerCore)=\d+", node))
        if "CPUs=" not in hw:
            raise RuntimeError(f"slurmd -C did not describe this machine: {probe.stdout}{probe.stderr}")
        memory = re.search(r"\bRealMemory=(\d+)", node)
        mem = max(100, int(memory.group(1)) // self.nodes) if memory else 1000  # the machine's memory, split
        with socket.socket() as s:  # slurmctld listens on the head (the root namespace)
            s.bind(("", 0))
            ctld_port = s.getsockname()[1]
        node_lines = "\n".join(f"NodeName={n} NodeAddr={a} NodeHostname={n} {hw} RealMemory={mem} State=UNKNOWN"
                               for n, a in zip(self.names, self.addresses))
        all_nodes = f"{self.prefix}-n[0-{self.nodes - 1}]" if self.nodes > 1 else self.names[0]
        self.conf.write_text(f"""\
# a {self.nodes}-node cluster on one machine, written by {Path(__file__).name}: every node a
# network namespace with its own address and hostname (docs/slurm.md)
ClusterName={self.prefix}multi
SlurmctldHost={self.head}({self.head_address})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket
CredType=cred/munge
SlurmctldPort={ctld_port}
SlurmdPort={SLURMD_PORT}
StateSaveLocation={root}/spool/ctld
SlurmdSpoolDir={slurmd_spool(self.prefix)}/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/spool/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
SlurmdTimeout={self.slurmd_timeout}
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
{node_lines}
PartitionName=all Nodes={all_nodes} Default=YES MaxTime=INFINITE State=UP
{self.extra_conf}
""")

    def down(self) -> None:
        """Tear down everything :meth:`up` made (or the part of it a failed ``up`` made),
        whatever state it is in: never raises for what is already gone."""
        down(self.root, self.prefix)


def _lock(prefix: str, timeout: float) -> int:
    """An exclusive lock on the cluster name ``prefix`` (one cluster of a name at a time:
    tests of two sessions wait for each other); returns the fd to close."""
    fd = os.open(f"/run/lock/{prefix}-slurm-cluster.lock" if os.path.isdir("/run/lock")
                 else f"/tmp/{prefix}-slurm-cluster.lock", os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.EACCES) or time.monotonic() > deadline:
                os.close(fd)
                raise RuntimeError(f"another {prefix} cluster is in use for more than {timeout:.0f} s") from exc
            time.sleep(1)


def find_root(prefix: str = PREFIX) -> Path | None:
    """The directory of the cluster named ``prefix`` that is up, from its daemons' command
    lines (``slurmctld``/``slurmd`` ``-f DIR/slurm.conf``), or None."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        m = re.search(r"\bslurm(?:ctld|d) .*-f (\S+)/slurm\.conf\b", _cmdline(int(entry.name)))
        if m:
            with contextlib.suppress(OSError, ValueError):
                if json.loads((Path(m.group(1)) / STATE).read_text()).get("prefix") == prefix:
                    return Path(m.group(1))
    return None


def down(root: str | Path | None = None, prefix: str = PREFIX) -> str:
    """Tear down the cluster in ``root`` (None: the one the namespaces named ``prefix-*``
    say): cancel its jobs, kill every process in its nodes' namespaces, delete the
    namespaces, veths and bridge, stop slurmctld and munged. Returns the cluster's name
    (``root``'s record says it)."""
    if root is None:
        root = find_root(prefix)
    state: dict = {}
    if root is not None:
        root = Path(root).resolve()
        with contextlib.suppress(OSError, ValueError):
            state = json.loads((root / STATE).read_text())
        prefix = state.get("prefix", prefix)
    daemons = state.get("daemons", {})
    env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")} if root else None

    def daemon(name: str) -> list[tuple[int, int | None]]:
        pid, start = daemons.get(name, (None, None))
        return [(pid, start)] if pid and _alive(pid, start) else []

    if env and daemon("slurmctld"):  # the jobs first, while slurmctld can still end them
        jobs = _run("squeue", "-h", "-o", "%i", env=env, check=False, timeout=10).stdout.split()
        if jobs:
            _run("scancel", *jobs, env=env, check=False, timeout=10)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _run("squeue", "-h", env=env, check=False, timeout=10).stdout.strip():
                time.sleep(0.5)
    # every node: slurmd gently (it tells slurmctld), then whatever is left in its namespace
    _stop([p for name in daemons if name.startswith("slurmd-") for p in daemon(name)], grace=5)
    names = sorted(set(_namespaces(prefix)) | {n["name"] for n in state.get("nodes", [])})
    inodes = {i for i in (_netns_inode(n) for n in names) if i} | {
        n["netns_inode"] for n in state.get("nodes", []) if n.get("netns_inode")}
    for _ in range(5):
        procs = _pids_in_netns(inodes)
        if not procs:
            break
        _stop(procs, grace=3)
    for name in names:
        _run("ip", "netns", "del", name, check=False)
    for link in _links(prefix):  # veths die with their namespace's end; the bridge is ours to delete
        _run("ip", "link", "del", link, check=False)
    _stop(daemon("slurmctld"), grace=10)
    _stop(daemon("munged"), grace=5)
    if root is not None:  # daemons a lost state file did not record, found by their command line
        for line in _daemons_of(root):
            pid = int(re.search(r"\(pid (\d+)\)", line).group(1))
            _stop([(pid, _start_time(pid))], grace=5)
    shutil.rmtree(slurmd_spool(prefix), ignore_errors=True)
    return prefix


@contextlib.contextmanager
def slurm_cluster(root: str | Path, nodes: int = 3, *, lock_timeout: float = 600, **kwargs) -> Iterator[Cluster]:
    """A :class:`Cluster` up for the ``with`` block, torn down after it, even when the block
    fails. Clusters of the same prefix wait for each other (a lock) rather than collide."""
    fd = _lock(kwargs.get("prefix", PREFIX), lock_timeout)
    try:
        cluster = Cluster(root, nodes, **kwargs).up()  # a failed up tears down what it made, and only that
        try:
            yield cluster
        finally:
            cluster.down()
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/slurm_cluster.py", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="start a cluster and print how to use it")
    up.add_argument("--nodes", type=int, default=3)
    up.add_argument("--dir", required=True, help="its config, munge key, spools and logs")
    up.add_argument("--subnet", default=SUBNET, help=f"the /24 of its addresses (default {SUBNET})")
    for name, text in (("down", "tear it down: nothing left"), ("status", "its nodes' states, and what is left")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--dir", help="the cluster's directory (default: the one that is up)")
    ex = sub.add_parser("exec", help="run a command on node K (its namespace and hostname), outside Slurm: "
                                     "exec K|head [--dir DIR] -- COMMAND (default: a shell)")
    ex.add_argument("node", help="a node's number, or head (the machine, resolving the nodes' names)")
    ex.add_argument("--dir", help="the cluster's directory (default: the one that is up)")
    for p in sub.choices.values():
        p.add_argument("--prefix", default=PREFIX, help=f"the cluster's name: namespaces PREFIX-nK, links PREFIX-br, "
                                                         f"PREFIX-vK (default {PREFIX}; another one runs beside it)")
    argv = sys.argv[1:] if argv is None else argv
    command = argv[argv.index("--") + 1:] if "--" in argv else []  # exec K ... -- COMMAND
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)

    def which_dir() -> Path | None:
        if args.dir:
            return Path(args.dir)
        return find_root(args.prefix)

    if args.cmd == "up":
        try:
            cluster = Cluster(args.dir, args.nodes, prefix=args.prefix, subnet=args.subnet).up()
        except (RuntimeError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(cluster.usage())
        return 0
    if args.cmd == "down":
        root = which_dir()
        prefix = down(root, args.prefix)
        left = leftovers(root, prefix)
        print("\n".join(["left:", *left]) if left else "down: nothing left", file=sys.stderr if left else sys.stdout)
        return 1 if left else 0
    root = which_dir()
    if root is None or not (root / STATE).exists():
        print(f"error: no {args.prefix} cluster is up (or pass --dir)", file=sys.stderr)
        return 1
    state = json.loads((root / STATE).read_text())
    cluster = Cluster(root, len(state["nodes"]), prefix=state["prefix"], subnet=state["subnet"])
    if args.cmd == "status":
        print(f"SLURM_CONF={cluster.conf}")
        for name, st in cluster.sinfo().items():
            print(f"{name}\t{st}")
        return 0
    command = command or ["bash"]
    if args.node == "head":
        return subprocess.run(cluster.head_command(*command), env=cluster.env).returncode
    if not args.node.isdigit() or int(args.node) >= cluster.nodes:
        print(f"error: no node {args.node!r}: 0..{cluster.nodes - 1} or head", file=sys.stderr)
        return 2
    return subprocess.run(cluster.node_command(int(args.node), *command), env=cluster.env).returncode


if __name__ == "__main__":
    sys.exit(main())
