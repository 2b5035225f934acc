"""``metrics.jsonl``: one JSON object per trainer step (the orchestrator's batch metrics
merged with the trainer's own), appended one write per line so a reader (the launcher's
live view, the reward plot) never sees half a record.

The file is the built-in ``file`` monitor's (:class:`FileMonitor`, registered by the
core's own plugin, always on): the trainer hands each step's record to its monitors
(:class:`primerl.monitors.MonitorSet`), this one first. It also draws ``reward.png`` from
the whole file when the trainer finishes. Light: imports no torch (the config check
imports it for its options).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from primerl.monitors import MonitorConfig, RunInfo, SampleRow, json_record
from primerl.rundir import RunDir, write_atomically


def append_metrics(run: RunDir, record: Mapping[str, Any]) -> None:
    line = json_record(record) + "\n"
    with open(run.metrics, "a") as f:  # one write per line
        f.write(line)


class FileMonitor:
    """``metrics.jsonl`` (one line per step) and ``reward.png`` at the end: the run directory's
    own record, which the live view and resume read (always on)."""

    Config = MonitorConfig  # no keys of its own; it shows no samples

    def __init__(self, options: MonitorConfig) -> None:
        self.options = options
        self.run: RunDir | None = None

    def start(self, run: RunInfo) -> None:
        self.run = RunDir(run.output_dir)

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        append_metrics(self.run, metrics)

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        pass  # metrics.jsonl holds metrics only

    def finish(self) -> None:
        if self.run is None:
            return
        from primerl.trainer import log

        try:
            from primerl.runview import plot_rewards, read_metrics

            rows = [r for r in read_metrics(self.run.metrics) if "reward/mean" in r]
            if rows:
                plot_rewards(rows, self.run.reward_plot)
        except Exception as exc:  # noqa: BLE001 - a plot is no reason to fail a finished run
            log(f"warning: monitor file: {self.run.reward_plot.name} not drawn ({type(exc).__name__}: {exc})")


def truncate_metrics(run: RunDir, last_step: int) -> None:
    """Drop metric lines of steps after ``last_step`` (redone after a resume), atomically."""
    path = run.metrics
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                kept.append(line + "\n")
        except (ValueError, AttributeError):
            continue
    write_atomically(path, lambda tmp: tmp.write_text("".join(kept)))
