"""What a launcher shows of a run: the live view (rich), the reward plot drawn at the end
(matplotlib) and the closing summary. Shared by every launcher (local, slurm)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from primerl.config import RunConfig
from primerl.rundir import RunDir

__all__ = ["LiveView", "summarize"]


def read_metrics(path: Path) -> list[dict[str, Any]]:
    rows = []
    try:
        text = path.read_text()
    except OSError:
        return rows
    for line in text.splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # the line being written right now
    return rows


class LiveView:
    """A table of the latest step, refreshed from metrics.jsonl; plain lines when not a TTY."""

    def __init__(self, cfg: RunConfig, run_dir: RunDir):
        self.cfg, self.run_dir = cfg, run_dir
        self.console = Console()
        self.live = Live(console=self.console, refresh_per_second=2, transient=False) if self.console.is_terminal else None
        self.t0 = time.monotonic()
        self.printed = 0

    def __enter__(self) -> LiveView:
        if self.live:
            self.live.start()
        self.console.print(f"primerl run: model {self.cfg.model.name}, env {self._envs()}, "
                           f"{self.cfg.max_steps} steps -> {self.run_dir.root}")
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def stop(self) -> None:
        if self.live and self.live.is_started:
            self.live.stop()

    def note(self, message: str) -> None:
        """One line above the live table (or among the plain lines): an event of the run."""
        self.console.print(message, style="yellow", highlight=False, markup=False)

    def refresh(self) -> None:
        rows = read_metrics(self.run_dir.metrics)
        if self.live:
            self.live.update(self._table(rows))
        else:
            for r in rows[self.printed:]:
                self.console.print(self._line(r), highlight=False)
            self.printed = len(rows)

    def _envs(self) -> str:
        return " + ".join(s.name for s in self.cfg.orchestrator.sources) or self.cfg.env.name

    def _eta(self, rows: list[dict[str, Any]]) -> str:
        if not rows:
            return "-"
        step = rows[-1]["step"]
        per_step = (time.monotonic() - self.t0) / max(step, 1)
        return f"{per_step * (self.cfg.max_steps - step):.0f}s"

    def _line(self, r: dict[str, Any]) -> str:
        return (f"step {r['step']:>4}/{self.cfg.max_steps}  reward {r.get('reward/mean', 0):.3f}{_per_source(r)}  "
                f"tok/s {r.get('throughput/sampled_tokens_per_s', 0):.0f}  staleness {r.get('off_policy/max', 0)}  "
                f"dropped {r.get('dropped_stale', 0)}  failed {_failed(r)}  mismatch_kl {r.get('mismatch_kl', 0):.2e}  "
                f"step {r.get('time/step', 0):.2f}s"
                + (f"  eval {r['eval/reward/mean']:.3f} (v{r['eval/policy_version']})" if "eval/reward/mean" in r else ""))

    def _table(self, rows: list[dict[str, Any]]) -> Table:
        t = Table(title=f"primerl: {self.cfg.model.name} on {self._envs()}  ({time.monotonic() - self.t0:.0f}s)")
        for col in ("step", "reward", "tokens/s", "staleness", "dropped", "failed", "mismatch KL", "step time", "ETA"):
            t.add_column(col, justify="right")
        for r in rows[-8:]:
            t.add_row(f"{r['step']}/{self.cfg.max_steps}", f"{r.get('reward/mean', 0):.3f}{_per_source(r)}",
                      f"{r.get('throughput/sampled_tokens_per_s', 0):.0f}", str(r.get("off_policy/max", 0)),
                      str(r.get("dropped_stale", 0)), str(_failed(r)), f"{r.get('mismatch_kl', 0):.2e}",
                      f"{r.get('time/step', 0):.2f}s", self._eta(rows))
        if not rows:
            t.add_row("starting", "", "", "", "", "", "", "", "")
        return t


def _per_source(r: dict[str, Any]) -> str:
    """Each source's mean reward in a run of several (``reward/<name>/mean``), else nothing."""
    parts = [f"{k[len('reward/'):-len('/mean')]} {v:.3f}" for k, v in r.items()
             if k.startswith("reward/") and k.endswith("/mean") and k.count("/") == 2]
    return f" ({', '.join(parts)})" if parts else ""


def _failed(r: dict[str, Any]) -> int:
    """Rollout groups that failed since the previous step (harness errors and crashed calls)."""
    return int(r.get("errors/task", 0)) + int(r.get("errors/rollout", 0))


def plot_rewards(rows: list[dict[str, Any]], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    reward = [r["reward/mean"] for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps, reward, label="mean reward", color="tab:blue")
    if len(reward) >= 5:
        w = 5
        smooth = [sum(reward[max(0, i - w + 1): i + 1]) / len(reward[max(0, i - w + 1): i + 1]) for i in range(len(reward))]
        ax.plot(steps, smooth, label="5-step average", color="tab:orange")
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("primerl: reward per step")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _newer(path: Path, than: Path) -> bool:
    try:
        return path.stat().st_mtime >= than.stat().st_mtime
    except OSError:
        return False


def summarize(run_dir: RunDir, *, logs_note: str = "", extra: tuple[tuple[str, object], ...] = ()) -> None:
    """What a finished run made: the reward's first and last 10 steps, and where things are
    (``extra``: more ``(label, path)`` lines, e.g. a Slurm job's scripts)."""
    rows = read_metrics(run_dir.metrics)
    png = None
    if rows:  # the file monitor draws it as the trainer finishes; here again when the trainer did not get there
        png = run_dir.reward_plot if _newer(run_dir.reward_plot, run_dir.metrics) else plot_rewards(rows, run_dir.reward_plot)
    print()
    if rows:
        first = [r["reward/mean"] for r in rows[:10]]
        last = [r["reward/mean"] for r in rows[-10:]]
        print(f"reward: first 10 steps {sum(first) / len(first):.3f} -> last 10 steps {sum(last) / len(last):.3f}")
    print(f"run directory:  {run_dir.root}")
    print(f"  metrics:      {run_dir.metrics}")
    if png:
        print(f"  reward curve: {png}")
    print(f"  weights:      {run_dir.weights}")
    print(f"  checkpoints:  {run_dir.checkpoints}")
    print(f"  rollouts:     {run_dir.rollouts}")
    print(f"  logs:         {run_dir.logs}{logs_note}")
    for label, path in extra:
        print(f"  {label + ':':<14}{path}")
