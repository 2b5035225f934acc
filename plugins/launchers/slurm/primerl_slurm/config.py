"""The ``[launcher]`` keys of the slurm launcher (``SlurmLauncher.Config``).

``launcher.name = "slurm"`` makes the core validate ``[launcher]`` with this class (a
subclass of primerl's LauncherConfig), so the local launcher keeps its one key and a typo
here is named with where it came from. The node split is resolved when the section is
built: ``RunConfig.trainer_world_size()`` reads ``trainer_nodes_used()`` to check the
trainer's ``[trainer.parallel]`` layout, so it must already be a number, never "auto".
"""

from __future__ import annotations

import re
from typing import Any

import attrs

from primerl.launchers import LauncherConfig

_TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$|^(\d+-\d+)$|^(UNLIMITED|INFINITE)$", re.IGNORECASE)


def _min(low: int):
    def check(_inst: Any, attribute: attrs.Attribute, value: int) -> None:
        if value < low:
            raise ValueError(f"{attribute.name}: must be >= {low}, got {value}")
    return check


def _time(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None and not _TIME.match(value):
        raise ValueError(f"{attribute.name}: {value!r} is not a Slurm time limit (MM, HH:MM:SS, D-HH or D-HH:MM:SS)")


@attrs.define(kw_only=True)
class SlurmConfig(LauncherConfig):
    """``[launcher]`` with ``name = "slurm"``: one Slurm job for the whole run."""

    # nodes of the job; 1 runs every role on that node (srun steps that overlap)
    nodes: int = attrs.field(default=1, validator=_min(1))
    # GPUs requested on every node (sbatch --gpus-per-node); 0 for CPU nodes
    gpus_per_node: int = attrs.field(default=0, validator=_min(0))
    partition: str | None = None  # sbatch --partition; None: the cluster's default
    account: str | None = None  # sbatch --account; None: the user's default
    # sbatch --time (MM, HH:MM:SS, D-HH:MM:SS); None: the partition's limit
    time_limit: str | None = attrs.field(default=None, validator=_time)
    job_name: str = "primerl"  # sbatch --job-name
    # nodes running inference servers (inference.replicas of them, spread evenly); 0: the
    # nodes the trainer and the orchestrator leave
    inference_nodes: int = attrs.field(default=0, validator=_min(0))
    # nodes of the trainer: trainer_nodes x trainer.nproc ranks under torchrun; 0: half of
    # the nodes (rounded down) with more than one, else 1
    trainer_nodes: int = attrs.field(default=0, validator=_min(0))
    # a node of its own for the orchestrator and its env workers (sandboxed SWE episodes);
    # false: they share the first inference node
    orchestrator_node: bool = False
    # sbatch --exclusive: whole nodes (the roles split a node's CPUs among themselves)
    exclusive: bool = True
    # the trainer's c10d rendezvous port on its first node (trainer_nodes > 1)
    rdzv_port: int = attrs.field(default=29500, validator=_min(1))
    # the first port of the KV store's run service on the job's first node, when the store
    # declares one (Mooncake's master: its RPC port, +1 its metadata server, +2 its metrics);
    # a one-node job picks free ports
    kv_service_port: int = attrs.field(default=50051, validator=_min(1))
    # a node lost mid-run (NODE_FAIL): true requeues the job (sbatch --requeue), which resumes
    # the run from its newest checkpoint once Slurm has nodes for it, and primerl run follows
    # it; false ends the run, naming the node, and the same command resumes it
    requeue: bool = False
    # more #SBATCH lines, each an sbatch option: ["--qos=high", "--constraint=h200"]
    sbatch_args: list[str] = attrs.field(factory=list)
    # write OUT/slurm/*.sbatch and the role scripts but submit nothing (primerl run --dry-run)
    dry_run: bool = False

    def trainer_nodes_used(self) -> int:
        return self.trainer_nodes

    def __attrs_post_init__(self) -> None:
        if self.nodes == 1:
            for key in ("inference_nodes", "trainer_nodes"):
                if getattr(self, key) > 1:
                    raise ValueError(f"{key}: {getattr(self, key)} nodes do not fit in launcher.nodes = 1 "
                                     f"(one node runs every role); raise launcher.nodes")
            if self.orchestrator_node:
                raise ValueError("orchestrator_node: needs a node of its own, and launcher.nodes is 1")
            self.inference_nodes = self.trainer_nodes = 1  # every role on the one node
            return
        rest = self.nodes - int(self.orchestrator_node)
        if not self.trainer_nodes:
            self.trainer_nodes = max(1, (rest - self.inference_nodes) if self.inference_nodes else rest // 2)
        if not self.inference_nodes:
            self.inference_nodes = rest - self.trainer_nodes
        if self.inference_nodes < 1 or self.inference_nodes + self.trainer_nodes != rest:
            raise ValueError(
                f"inference_nodes: {self.inference_nodes} inference + {self.trainer_nodes} trainer"
                f"{' + 1 orchestrator' if self.orchestrator_node else ''} nodes must add up to launcher.nodes "
                f"({self.nodes}), each role at least one")

    def shared(self) -> bool:
        """Every role on one node."""
        return self.nodes == 1
