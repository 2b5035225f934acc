"""The Slurm job's own process: ``python -m primerl_slurm.job OUT``, on the job's first node.

The batch script (``OUT/slurm/primerl.sbatch``) runs this and nothing else. It:

1. prepares the run directory to continue (:func:`primerl.resume.prepare`: a resubmitted or
   requeued job resumes from the newest usable checkpoint; this job's log stays);
2. lists the job's nodes and the address each is reached at (``scontrol``: the node's
   ``NodeAddr``, resolved here), and places the run's processes on them (:func:`place`, as
   :class:`primerl_slurm.scripts.Layout` says): the inference servers spread evenly over the
   inference nodes (``inference.port + i`` on each; on a one-node job free ports, as the
   local launcher picks them), the orchestrator on the first node, the trainer on each
   trainer node (torchrun; across nodes a c10d rendezvous on the first trainer node's address,
   ``launcher.rdzv_port``, whose store that node hosts), and the KV store's run service on the first node when the store
   declares one (:attr:`primerl.kv_stores.KVStoreCapabilities.run_service`, run by
   ``python -m primerl.kv_service``: Mooncake's master, the disk store's shared folder, a
   third party's service; no store is named here);
3. runs each process as an ``srun`` step of its own on its node (``--overlap``: steps share
   a node's CPUs, each asking for its share) under :class:`primerl.supervisor.Supervisor`,
   the policy the local launcher runs too: the KV store's run service first, waited for
   until it wrote its options (``OUT/slurm/job-<id>.kv.json``); then the
   run-time record ``OUT/runtime.json`` (the servers' URLs at their nodes' addresses, each
   pool's with prefill/decode, the KV store's options); then everything else. Each
   process's output goes to its own log, ``OUT/logs/<name>.log``, whichever node it runs on;
4. ends as the supervisor says: why goes to ``OUT/slurm/job-<id>.status`` (``rc``, ``role``,
   ``node``, ``message``), which ``primerl run`` reads, and the supervisor's exit code is
   the job's.

On more than one node the servers bind every interface (the job's API key comes in its
environment, ``PRIMERL_API_KEY``) and everything another node reaches is named by address:
nothing a process on another node needs is bound to loopback.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import attrs

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from primerl.config import RunConfig, load_config, split_args
from primerl.errors import PrimerlError
from primerl.inference import server_url
from primerl.launchers import inference_names, inference_roles, pick_ports, process_command
from primerl.registry import get_registry
from primerl.resume import prepare
from primerl.rundir import RunDir
from primerl.runtime import RunTime
from primerl.supervisor import Child, Duty, Outcome, Supervisor
from primerl_slurm.scripts import Layout, layout

DUTIES = {"inference": Duty.SERVES, "orchestrator": Duty.WORKS, "trainer": Duty.FINISHES, "kv_service": Duty.SUPPORTS}
KV_SERVICE = "kv_service"  # the KV store's run service, as a process of the job (logs/kv_service.log)


@attrs.frozen
class Node:
    """One of the job's nodes: Slurm's name for it (its hostname) and the address the other
    nodes reach it at."""

    name: str
    address: str


@attrs.frozen(kw_only=True)
class Process:
    """One process of the run, placed on one of the job's nodes."""

    name: str  # its log is logs/<name>.log
    kind: str  # inference, orchestrator, trainer, kv_service
    node: Node
    command: tuple[str, ...]  # what runs there
    per_node: int = 1  # processes of its kind on its node (they split the node's CPUs)
    beacon: str = ""  # the role its beacon reports (primerl.watchdog)


# ---- where everything goes ----------------------------------------------------------------


def server_ports(cfg: RunConfig, lay: Layout) -> list[int]:
    """The inference servers' ports on each node: ``inference.port + i`` (8000 + i when it is
    0) on nodes of their own; on a one-node job free ones (the node may be shared)."""
    inf = cfg.inference
    if lay.shared:
        return pick_ports(inf.host, inf.port, lay.per_node)
    first = inf.port or 8000
    return [first + i for i in range(lay.per_node)]


def server_urls(cfg: RunConfig, lay: Layout, nodes: list[Node], ports: list[int]) -> list[str]:
    """Every server's URL in :func:`primerl.launchers.inference_names`' order (at its node's
    address; on a one-node job at ``inference.host``)."""
    first = lay.inference_first
    return [server_url(cfg.inference.host if lay.shared else nodes[first + i // lay.per_node].address,
                       ports[i % lay.per_node])
            for i in range(lay.servers)]


def trainer_command(cfg: RunConfig, lay: Layout, config: Path, python: str, rendezvous: str, job_id: str, *,
                    node: Node | None = None, hosts_rendezvous: bool = False) -> list[str]:
    """The trainer on one node: torchrun when it spans nodes (a c10d rendezvous at
    ``rendezvous``) or runs several ranks, else one process. Across nodes each torchrun is
    told its ``node``'s address (``--local-addr``: the first trainer node's becomes the
    ranks' ``MASTER_ADDR``), and the first trainer node (``hosts_rendezvous``) that it hosts
    the rendezvous's store: torchrun's own guesses go through what the node's hostname
    resolves to, which on a node whose ``/etc/hosts`` maps its name to 127.0.1.1 (Debian's)
    no other node reaches, and matches no address, so that no node would host the store."""
    cmd = process_command("trainer", config, python=python)
    nproc = cfg.trainer.nproc
    if lay.trainer_nodes > 1:
        local = [f"--local-addr={node.address}"] if node is not None else []
        return [python, "-m", "torch.distributed.run", f"--nnodes={lay.trainer_nodes}", f"--nproc-per-node={nproc}",
                "--rdzv-backend=c10d", f"--rdzv-endpoint={rendezvous}", f"--rdzv-id={job_id}",
                f"--rdzv-conf=is_host={int(hosts_rendezvous)}", *local, *cmd[1:]]
    if nproc > 1:
        return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *cmd[1:]]
    return cmd


def place(cfg: RunConfig, run_dir: RunDir, lay: Layout, nodes: list[Node], ports: list[int], *,
          python: str = sys.executable, job_id: str = "0") -> list[Process]:
    """Every process of the run on its node (``nodes`` in Slurm's order), services first."""
    head, config = nodes[0], run_dir.config
    placed: list[Process] = []
    if get_registry().capabilities("kv_store", cfg.inference.kv_store).run_service is not None:
        port = 0 if lay.shared else cfg.launcher.kv_service_port  # one node: free ports; else fixed from this one
        host = cfg.inference.host if lay.shared else head.address
        placed.append(Process(name=KV_SERVICE, kind=KV_SERVICE, node=head, command=(
            python, "-m", "primerl.kv_service", str(config), "--options", str(kv_options_file(run_dir, job_id)),
            "--host", host, "--port", str(port), "--launch", job_id)))
    bind = None if lay.shared else "0.0.0.0"  # reached from the other nodes (an API key is required)
    for i, (name, role) in enumerate(zip(inference_names(cfg), inference_roles(cfg))):
        port = ports[i % lay.per_node]
        placed.append(Process(name=name, kind="inference", node=nodes[lay.inference_first + i // lay.per_node],
                              command=tuple(process_command("inference", config, python=python, host=bind, port=port,
                                                            role=role)),
                              per_node=lay.per_node, beacon=f"inference:{port}"))
    placed.append(Process(name="orchestrator", kind="orchestrator", node=head, beacon="orchestrator",
                          command=tuple(process_command("orchestrator", config, python=python))))
    trainers = nodes[lay.trainer_first:lay.trainer_first + lay.trainer_nodes]
    first = trainers[0].address
    rendezvous = f"{f'[{first}]' if ':' in first else first}:{cfg.launcher.rdzv_port}"  # used across nodes only
    for k, node in enumerate(trainers):
        placed.append(Process(name="trainer" if len(trainers) == 1 else f"trainer-{k}", kind="trainer", node=node,
                              beacon="trainer",
                              command=tuple(trainer_command(cfg, lay, config, python, rendezvous, job_id,
                                                            node=node, hosts_rendezvous=k == 0))))
    return placed


def threads_of(proc: Process, cfg: RunConfig, lay: Layout, cpus: int) -> dict[str, str]:
    """The OpenMP threads of a process: its share of its node's cores (``PRIMERL_THREADS``
    replaces the node's count: on one node half for each role, as the local launcher does;
    nodes of their own, all of it), split between the processes of its kind there; the
    trainer's ranks split ``trainer.threads`` when it is set."""
    base = int(os.environ.get("PRIMERL_THREADS") or (max(1, cpus // 2) if lay.shared else cpus))
    env = {}
    if proc.kind == "trainer":
        total = cfg.trainer.threads or base
        if cfg.trainer.threads:
            env["OMP_WAIT_POLICY"] = "PASSIVE"
        threads = max(1, total // cfg.trainer.nproc)
    else:
        threads = max(1, base // proc.per_node)
    return {**env, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def step(proc: Process, cpus: int, script: Path) -> list[str]:
    """``srun`` running ``proc`` as a step of its own on its node, through ``script`` (its
    command, :func:`write_step`); its output comes back to the supervisor (srun relays it),
    which writes it to the process's log."""
    share = max(1, cpus // proc.per_node)
    return ["srun", "--overlap", "--nodes=1", "--ntasks=1", f"--nodelist={proc.node.name}", f"--cpus-per-task={share}",
            *(["--overcommit"] if proc.per_node > cpus else []), "--kill-on-bad-exit=0", "--input=none",
            f"--job-name={proc.name}", "--export=ALL", str(script)]


def write_step(proc: Process, run_dir: RunDir, job_id: str) -> Path:
    """``OUT/slurm/steps/<name>.sh``: the one command a step runs (so that ``srun``'s own
    command line is not taken for the process's, and a user sees what runs where)."""
    path = run_dir.root / "slurm" / "steps" / f"{proc.name}.sh"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"#!/bin/sh\n# {proc.name} of Slurm job {job_id}, on {proc.node.name} (written by primerl_slurm.job; "
                   f"srun runs it there)\nexec {shlex.join(proc.command)}\n")
    tmp.chmod(0o755)
    tmp.replace(path)
    return path


def describe_processes(cfg: RunConfig, run_dir: RunDir, lay: Layout) -> str:
    """``OUT/slurm/processes.txt``: each process, its node and its command, as a job places
    them (node k stands for the job's k-th node, ``<address of node k>`` for its address)."""
    nodes = [Node(f"node{k}", f"<address of node {k}>") for k in range(lay.nodes)]
    first = cfg.inference.port or (0 if lay.shared else 8000)
    ports = [first + i if first else 0 for i in range(lay.per_node)]
    lines = [f"# the processes of the Slurm job of {run_dir.root} ({lay.describe(cfg)}); each runs as an srun step",
             "# on its node, under primerl's supervisor; its output goes to logs/<name>.log"
             + ("; port 0: a free one, picked on the node" if lay.shared else "")]
    for proc in place(cfg, run_dir, lay, nodes, ports, job_id="<job id>"):
        lines.append(f"{proc.name}\ton {proc.node.name}: {shlex.join(proc.command)}")
    return "\n".join(lines) + "\n"


# ---- the job's nodes ----------------------------------------------------------------------


def _run(*cmd: str) -> str:
    r = subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise PrimerlError(f"`{' '.join(cmd)}` failed: {(r.stderr or r.stdout).strip()}")
    return r.stdout


def _resolve(address: str) -> str:
    """An IPv4 (else IPv6) address of ``address``, or ``address`` when it does not resolve."""
    try:
        ipaddress.ip_address(address)
        return address
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(address, None, type=socket.SOCK_STREAM)
    except OSError:
        return address
    found = sorted(infos, key=lambda info: info[0] != socket.AF_INET)
    return str(found[0][4][0]) if found else address


def job_nodes(nodelist: str) -> list[Node]:
    """The job's nodes in Slurm's order, each with the address Slurm reaches it at (its
    ``NodeAddr``), resolved here: loopback on a node is never what another node must use."""
    names = _run("scontrol", "show", "hostnames", nodelist).split()
    shown = _run("scontrol", "show", "node", "-o", nodelist)
    addresses = {m.group(1): m.group(2) for m in re.finditer(r"NodeName=(\S+) .*?NodeAddr=(\S+)", shown)}
    return [Node(name, _resolve(addresses.get(name, name))) for name in names]


# ---- the run's services and record --------------------------------------------------------


def kv_options_file(run_dir: RunDir, job_id: str) -> Path:
    """Where the job's KV service writes the options every server's store gets
    (:mod:`primerl.kv_service`): ``OUT/slurm/job-<id>.kv.json``."""
    return run_dir.root / "slurm" / f"job-{job_id}.kv.json"


def kv_store_options(run_dir: RunDir, job_id: str) -> dict[str, Any]:
    """What the KV store's run service set up for every server's store (the run-time record's
    ``kv_store_options``), read once it serves; ``{}`` when the store declares no service."""
    try:
        return json.loads(kv_options_file(run_dir, job_id).read_text())
    except FileNotFoundError:
        return {}


class JobLog:
    """The supervisor's reporter in a job: lines in the job's log (``slurm-<id>.out``, which
    ``primerl run`` follows), and the outcome in ``OUT/slurm/job-<id>.status``."""

    def __init__(self, run_dir: RunDir, job_id: str, nodes: dict[str, str | None] | None = None) -> None:
        self.status = run_dir.root / "slurm" / f"job-{job_id}.status"
        self.nodes = nodes or {}  # each process's node

    @staticmethod
    def say(line: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)

    def tick(self) -> None:
        pass

    def note(self, line: str) -> None:
        self.say(line)

    def stopping(self, outcome: Outcome) -> None:
        self.write(outcome)
        self.say(outcome.message)

    def write(self, outcome: Outcome) -> None:
        role = outcome.child or ("watchdog" if outcome.stalled else "job")
        node = self.nodes.get(outcome.child or "") or ""
        text = f"rc={outcome.code}\nrole={role}\nnode={node}\nmessage={outcome.message}\n"
        self.status.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.status.with_name(self.status.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(self.status)


# ---- the job ------------------------------------------------------------------------------


def load(run_dir: RunDir, job_id: str) -> tuple[RunConfig, Layout]:
    """Prepare the run directory to continue and read the run's config; PrimerlError (one
    line) when it must not start."""
    try:
        recorded = tomllib.loads(run_dir.config.read_text())
    except (OSError, ValueError) as exc:
        raise PrimerlError(f"{run_dir.config} is unreadable ({exc}): start the run with `primerl run`") from None
    result = prepare(run_dir, int(recorded.get("max_steps", 100)), keep=[f"logs/slurm-{job_id}.out"])
    for note in result.notes:
        JobLog.say(note)
    cfg = load_config(split_args(["@", str(run_dir.config)]))
    return cfg, layout(cfg)


def children(cfg: RunConfig, run_dir: RunDir, lay: Layout, placed: list[Process], job_id: str) -> list[Child]:
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE") or os.cpu_count() or 1)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return [Child(name=p.name, duty=DUTIES[p.kind], command=tuple(step(p, cpus, write_step(p, run_dir, job_id))),
                  log=run_dir.log(p.name),
                  env={**env, **threads_of(p, cfg, lay, cpus)}, node=p.node.name, beacon=p.beacon,
                  ready=kv_options_file(run_dir, job_id).exists if p.kind == KV_SERVICE else None)
            for p in placed]


def run(run_dir: RunDir, job_id: str, nodelist: str) -> int:
    try:
        cfg, lay = load(run_dir, job_id)
        nodes = job_nodes(nodelist)
        if len(nodes) != lay.nodes:
            raise PrimerlError(f"expected {lay.nodes} node(s), Slurm gave {len(nodes)}: {nodelist}")
        ports = server_ports(cfg, lay)
    except (PrimerlError, ValueError) as exc:
        outcome = Outcome(code=2, message=f"the job could not start the run: {exc}")
        JobLog(run_dir, job_id).stopping(outcome)
        return outcome.code
    placed = place(cfg, run_dir, lay, nodes, ports, job_id=job_id)
    urls = server_urls(cfg, lay, nodes, ports)
    log = JobLog(run_dir, job_id, {p.name: p.node.name for p in placed})
    log.say(f"job {job_id} on {', '.join(f'{n.name} ({n.address})' for n in nodes)}; inference {', '.join(urls)}")
    for p in placed:
        log.say(f"{p.name} on {p.node.name} (log {run_dir.log(p.name)})")
    n = lay.prefill
    kv_options_file(run_dir, job_id).unlink(missing_ok=True)  # a requeued job's service writes its own

    def record() -> None:  # once the services serve: what every process reads beside config.toml
        RunTime(inference_urls=tuple(urls), prefill_urls=tuple(urls[:n]), decode_urls=tuple(urls[n:]) if n else (),
                kv_store_options=kv_store_options(run_dir, job_id)).write(run_dir)

    supervisor = Supervisor(cfg, run_dir, children(cfg, run_dir, lay, placed, job_id), log, urls=lambda: urls,
                            services_ready=record)
    return supervisor.run().code


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m primerl_slurm.job OUTPUT_DIR (inside a Slurm job: primerl.sbatch runs it)",
              file=sys.stderr)
        return 2
    job_id, nodelist = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NODELIST")
    if not job_id or not nodelist:
        print("error: python -m primerl_slurm.job runs inside a Slurm job (sbatch OUT/slurm/primerl.sbatch)",
              file=sys.stderr)
        return 2
    return run(RunDir(Path(args[0]).resolve()), job_id, nodelist)


if __name__ == "__main__":
    sys.exit(main())
