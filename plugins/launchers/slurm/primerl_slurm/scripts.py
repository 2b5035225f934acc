"""The job the slurm launcher submits: ``OUT/slurm/primerl.sbatch``, and where its processes go.

One batch script, one job (the reasons are in ``launcher.py``'s docstring). The batch script
holds Slurm's options and one command: ``python -m primerl_slurm.job OUT``, the job's own
process (:mod:`primerl_slurm.job`), which runs on the job's first node, places every process
of the run on the job's nodes as :class:`Layout` says, and runs them as ``srun`` steps under
primerl's one supervisor (:mod:`primerl.supervisor`), as the local launcher runs them on its
machine. The job's nodes, in the order Slurm lists them:

    [orchestrator node, if launcher.orchestrator_node] [inference nodes] [trainer nodes]

With one node every process is on it. ``OUT/slurm/processes.txt`` lists each process with
its node and command (node numbers stand for the nodes Slurm will give).
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

import attrs

from primerl.config import RunConfig
from primerl.rundir import RunDir

BATCH = "primerl.sbatch"
PROCESSES = "processes.txt"


@attrs.frozen
class Layout:
    """Which of the job's nodes run what."""

    nodes: int
    inference_nodes: int
    trainer_nodes: int
    orchestrator_node: bool
    servers: int  # inference servers in all
    per_node: int  # inference servers on each inference node
    # each server's inference.role, in order: "prefill"s then "decode"s with prefill/decode
    # disaggregation, else "both"
    roles: tuple[str, ...] = ()

    @property
    def prefill(self) -> int:
        return self.roles.count("prefill")

    @property
    def shared(self) -> bool:
        return self.nodes == 1

    @property
    def inference_first(self) -> int:
        return 0 if self.shared else int(self.orchestrator_node)

    @property
    def trainer_first(self) -> int:
        return 0 if self.shared else self.inference_first + self.inference_nodes

    def describe(self, cfg: RunConfig) -> str:
        nproc = cfg.trainer.nproc
        if self.shared:
            return (f"1 node: {self.servers} inference server(s), the orchestrator and the trainer "
                    f"({nproc} rank(s)) share it")
        orch = "its own node" if self.orchestrator_node else "the first inference node"
        return (f"{self.nodes} nodes: {self.inference_nodes} inference ({self.servers} server(s), {self.per_node} "
                f"a node), {self.trainer_nodes} trainer ({self.trainer_nodes} x {nproc} = "
                f"{self.trainer_nodes * nproc} ranks), the orchestrator on {orch}")


def layout(cfg: RunConfig) -> Layout:
    """The placement ``cfg`` asks for; ``ValueError`` names the keys of one that cannot be."""
    lc, inf = cfg.launcher, cfg.inference
    if inf.disaggregated():  # prefill/decode: the two pools replace replicas
        roles = ("prefill",) * inf.prefill_replicas + ("decode",) * inf.decode_replicas
        keys = f"inference.prefill_replicas + decode_replicas ({inf.prefill_replicas} + {inf.decode_replicas})"
    else:
        n = lc.inference_nodes if inf.replicas == 1 and lc.nodes > 1 else inf.replicas  # default: one a node
        roles = ("both",) * n
        keys = f"inference.replicas ({inf.replicas})"
    servers = len(roles)
    if lc.nodes == 1:
        return Layout(1, 1, 1, False, servers, servers, roles)
    if servers % lc.inference_nodes:
        raise ValueError(f"{keys} must be a multiple of launcher.inference_nodes ({lc.inference_nodes}): servers "
                         f"are spread evenly over the inference nodes")
    return Layout(lc.nodes, lc.inference_nodes, lc.trainer_nodes, lc.orchestrator_node, servers,
                  servers // lc.inference_nodes, roles)


def _q(value: object) -> str:
    return shlex.quote(str(value))


def sbatch_header(cfg: RunConfig, run_dir: RunDir, cwd: Path) -> list[str]:
    lc = cfg.launcher
    lines = [f"--job-name={lc.job_name}", f"--nodes={lc.nodes}", "--ntasks-per-node=1"]
    if lc.exclusive:
        lines.append("--exclusive")
    if lc.gpus_per_node:
        lines.append(f"--gpus-per-node={lc.gpus_per_node}")
    for key, opt in (("partition", "--partition"), ("account", "--account"), ("time_limit", "--time")):
        if getattr(lc, key):
            lines.append(f"{opt}={getattr(lc, key)}")
    # a requeued job (launcher.requeue) appends to its log and resumes the run
    lines += [f"--output={run_dir.logs}/slurm-%j.out", "--open-mode=append", f"--chdir={cwd}",
              "--requeue" if lc.requeue else "--no-requeue", *lc.sbatch_args]
    for line in lines:
        if any(c in line for c in "\n\r"):
            raise ValueError(f"an sbatch option cannot hold a line break: {line!r}")
    return [f"#SBATCH {line}" for line in lines]


def batch_script(cfg: RunConfig, run_dir: RunDir, lay: Layout, cwd: Path) -> str:
    """``OUT/slurm/primerl.sbatch``: Slurm's options, then the job's own process."""
    header = "\n".join(sbatch_header(cfg, run_dir, cwd))
    return f"""#!/bin/bash
{header}
#
# A primerl run as one Slurm job, written by `primerl run --launcher slurm` (primerl_slurm;
# docs/slurm.md). {lay.describe(cfg)}.
# Submitting it again (sbatch {run_dir.root / "slurm" / BATCH}) resumes the run from its newest checkpoint.
# primerl_slurm.job, on the job's first node, starts every process of the run on its node as
# an srun step ({run_dir.root / "slurm" / PROCESSES}) and supervises them (primerl.supervisor).
export PYTHONUNBUFFERED=1
exec {_q(sys.executable)} -m primerl_slurm.job {_q(run_dir.root)}
"""


def write_scripts(cfg: RunConfig, run_dir: RunDir, lay: Layout, cwd: Path) -> list[Path]:
    """Write the batch script and the list of processes into ``OUT/slurm/``; returns their
    paths (the batch script first)."""
    from primerl_slurm.job import describe_processes

    slurm = run_dir.root / "slurm"
    slurm.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text, mode in [(BATCH, batch_script(cfg, run_dir, lay, cwd), 0o755),
                             (PROCESSES, describe_processes(cfg, run_dir, lay), 0o644)]:
        path = slurm / name
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.chmod(mode)
        tmp.replace(path)
        written.append(path)
    for stale in ("inference.sh", "orchestrator.sh", "trainer.sh", "mooncake.sh"):  # an earlier version's
        (slurm / stale).unlink(missing_ok=True)
    return written
