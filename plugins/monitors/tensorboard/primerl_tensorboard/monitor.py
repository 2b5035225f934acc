"""The ``tensorboard`` monitor: TensorBoard event files under ``OUT/tensorboard``.

Every numeric value of every step's record (the exact one appended to ``metrics.jsonl``;
booleans as 0 and 1) becomes a scalar under its own key at that step; the few rollouts of
:class:`primerl.monitors.SampleRow` become a Markdown table under the text tag
``samples`` on step 1 and every ``samples_every`` steps after it. Events are flushed every
step, so a trainer that dies loses none; ``tensorboard --logdir OUT/tensorboard`` shows
them, during the run too.

On a resume the writer starts with ``purge_step`` at the first step trained again, so
TensorBoard hides the earlier attempt's events of the steps redone, as the trainer drops
their ``metrics.jsonl`` lines.

The writer is ``torch.utils.tensorboard`` (it needs the ``tensorboard`` package), imported
only in :meth:`TensorBoardMonitor.start`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from primerl.monitors import COLUMNS, MonitorConfig, RunInfo, SampleRow
from primerl.validators import non_negative


@attrs.define(kw_only=True)
class TensorBoardConfig(MonitorConfig):
    """``[monitors.tensorboard]``: any key switches the monitor on."""

    # the event files' folder; relative paths are under the run directory
    log_dir: str = "tensorboard"
    # a text table of a few rollouts on step 1 and every samples_every steps after it; 0: none
    samples_every: int = attrs.field(default=10, validator=non_negative)


class TensorBoardMonitor:
    """Numeric metrics as TensorBoard scalars, rollout samples as text."""

    Config = TensorBoardConfig

    def __init__(self, options: TensorBoardConfig) -> None:
        self.options = options
        self.writer: Any = None

    def start(self, run: RunInfo) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise RuntimeError(f"TensorBoard's writer does not import ({exc}): pip install tensorboard, or "
                               f"pip install -e 'plugins/monitors/tensorboard[tensorboard]'") from None
        from pathlib import Path

        log_dir = Path(run.output_dir) / self.options.log_dir
        self.writer = SummaryWriter(log_dir=str(log_dir), purge_step=run.start_step + 1 if run.start_step else None)
        run.log(f"monitor tensorboard: events in {log_dir} (tensorboard --logdir {log_dir})")

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        for key, value in metrics.items():
            if isinstance(value, bool | int | float):
                self.writer.add_scalar(key, float(value), global_step=step)
        self.writer.flush()

    def log_samples(self, step: int, rows: Sequence[SampleRow]) -> None:
        self.writer.add_text("samples", markdown_table(rows), global_step=step)
        self.writer.flush()

    def finish(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return " ".join(text.replace("|", "\\|").split()) or " "


def markdown_table(rows: Sequence[SampleRow]) -> str:
    """The rows as a Markdown table (TensorBoard's text plugin renders it), one line each."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(getattr(r, c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
