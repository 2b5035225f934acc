"""The ``wandb`` monitor: a run in Weights & Biases.

``wandb.init`` once at the trainer's start with the whole resolved config (``run.config``),
then every step's record, the exact one appended to ``metrics.jsonl``, as
``wandb.log(record, step=step)``, and a ``wandb.Table`` of a few rollouts (prompt,
completion, reward, advantage, source; :class:`primerl.monitors.SampleRow`) under
``samples`` on step 1 and every ``samples_every`` steps after it.

``mode = "offline"`` needs no network and no account: the run is written to
``OUT/wandb/offline-run-*/run-*.wandb``, which ``wandb sync`` uploads later; ``"online"``
needs ``WANDB_API_KEY`` (or ``wandb login``) and the network, and otherwise fails at start,
which the trainer reports once and trains on. A resumed run is a new W&B run (same name and
group) whose steps start after the checkpoint's.

This module imports wandb only in :meth:`WandbMonitor.start`: the config check imports it
for :class:`WandbConfig`, and ``primerl plugins list`` not at all.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from primerl.monitors import COLUMNS, MonitorConfig, RunInfo, SampleRow
from primerl.validators import non_negative


@attrs.define(kw_only=True)
class WandbConfig(MonitorConfig):
    """``[monitors.wandb]``: any key switches the monitor on."""

    project: str = "primerl"  # the W&B project the run is logged to
    entity: str | None = None  # the W&B user or team; None: the API key's default entity
    name: str | None = None  # the run's name in W&B; None: the run directory's name
    # "online" (needs WANDB_API_KEY or `wandb login`), "offline" (OUT/wandb/offline-run-*,
    # uploaded later by `wandb sync`; no network) or "disabled" (wandb does nothing)
    mode: Literal["online", "offline", "disabled"] = "online"
    tags: list[str] = attrs.Factory(list)  # the run's tags in W&B
    group: str | None = None  # W&B's run group (runs of one sweep, or a run and its resumptions)
    # a wandb.Table of a few rollouts on step 1 and every samples_every steps after it; 0: none
    samples_every: int = attrs.field(default=10, validator=non_negative)


class WandbMonitor:
    """Every step's metrics, the run's config and rollout sample tables in W&B."""

    Config = WandbConfig

    def __init__(self, options: WandbConfig) -> None:
        self.options = options
        self.run: Any = None
        self.wandb: Any = None

    def start(self, run: RunInfo) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise RuntimeError(f"the wandb package is not installed ({exc}): pip install wandb, or "
                               f"pip install -e 'plugins/monitors/wandb[wandb]'") from None
        o = self.options
        self.wandb = wandb
        self.run = wandb.init(project=o.project, entity=o.entity, name=o.name or run.name, group=o.group,
                              tags=list(o.tags) or None, mode=o.mode, dir=str(run.output_dir), config=run.config,
                              settings=wandb.Settings(console="off", silent=True))
        where = getattr(self.run, "dir", None)
        if o.mode == "offline" and where:
            run.log(f"monitor wandb: offline run in {_run_folder(where)}; `wandb sync {_run_folder(where)}` "
                    f"uploads it")
        elif o.mode == "online":
            run.log(f"monitor wandb: {getattr(self.run, 'url', None) or o.project}")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(dict(metrics), step=step)

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        table = self.wandb.Table(columns=list(COLUMNS), data=[[getattr(r, c) for c in COLUMNS] for r in rows])
        self.run.log({"samples": table}, step=step)

    def finish(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()


def _run_folder(files_dir: str) -> str:
    """The offline run's folder (``OUT/wandb/offline-run-*``) from its ``files`` folder."""
    from pathlib import Path

    path = Path(files_dir)
    return str(path.parent if path.name == "files" else path)
