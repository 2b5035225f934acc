"""``metrics.jsonl``: one JSON object per trainer step (the orchestrator's batch metrics
merged with the trainer's own), appended one write per line so a reader (the launcher's
live view, the reward plot) never sees half a record."""

from __future__ import annotations

import json
from typing import Any

import torch

from primerl.rundir import RunDir, write_atomically


def _json_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if hasattr(v, "item"):  # numpy scalars
        return v.item()
    if hasattr(v, "tolist"):
        return v.tolist()
    return str(v)


def append_metrics(run: RunDir, record: dict[str, Any]) -> None:
    line = json.dumps(record, default=_json_value) + "\n"
    with open(run.metrics, "a") as f:  # one write per line
        f.write(line)


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
