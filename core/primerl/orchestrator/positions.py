"""The data position: how far each source's task draws went when a batch was written.

Tasks are drawn, numbered, from each source's train split, reshuffled each epoch. Just
before ``rollouts/step_n.pt`` the batch writer records ``rollouts/step_n.state.json``: per
source, how many tasks were drawn and which drawn ones are in no batch yet (in flight, or
finished and waiting); the trainer copies it into ``checkpoints/step_n``. A resumed
orchestrator reads it back (:func:`read_position`) and starts the unbatched tasks first,
then the draws after them (:meth:`primerl.orchestrator.sources.Source.task_stream`): the task
order of a run that never stopped (docs/architecture.md, "Checkpoint and resume").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from primerl.orchestrator import log
from primerl.rundir import ORCHESTRATOR_STATE, RunDir, step_name

__all__ = ["POSITION_FORMAT", "POSITION_VERSION", "DataPosition", "SourcePosition", "read_position"]

POSITION_FORMAT = "primerl.orchestrator_state"  # rollouts/step_n.state.json, checkpoints/step_n/orchestrator_state.json
POSITION_VERSION = 2  # 2: a position per source; 1 (read too): the one source's at the top level


@attrs.frozen
class SourcePosition:
    """Where one source's task draws stood."""

    drawn: int  # tasks drawn so far
    pending: tuple[tuple[int, str], ...] = ()  # (draw, task id) of drawn tasks in no batch yet


@attrs.frozen
class DataPosition:
    """Where every source's task draws stood once batch ``step`` was written."""

    step: int
    sources: dict[str, SourcePosition]

    def record(self, batch: dict[str, list[int]]) -> dict[str, Any]:
        """The JSON object written next to the batch (``batch``: each source's groups' draws)."""
        return {"format": POSITION_FORMAT, "version": POSITION_VERSION, "step": self.step,
                "sources": {name: {"drawn": p.drawn, "pending": [list(x) for x in p.pending]}
                            for name, p in self.sources.items()},
                "batch": batch}

    @classmethod
    def read(cls, path: Any, first: str) -> DataPosition:
        """``first``: the run's first source, whose position a version 1 file holds."""
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict) or data.get("format") != POSITION_FORMAT or data.get("version", 0) > 2:
            raise ValueError(f"{path} is not an orchestrator state of format version {POSITION_VERSION} or older")
        listed = data.get("sources", {first: data})
        return cls(step=int(data["step"]), sources={
            name: SourcePosition(drawn=int(p["drawn"]), pending=tuple((int(i), str(t)) for i, t in p["pending"]))
            for name, p in listed.items()})


def read_position(run_dir: RunDir, step: int, quotas: Mapping[str, int]) -> DataPosition:
    """Batch ``step``'s data position: from its checkpoint, else from beside the batch, else
    (a checkpoint of an older primerl) estimated as if no group had failed or been dropped.
    ``quotas``: each source's groups per batch, the first source first."""
    first = next(iter(quotas))
    for path in (run_dir.checkpoint(step) / ORCHESTRATOR_STATE, run_dir.batch_state(step)):
        if path.is_file():
            try:
                position = DataPosition.read(path, first=first)
            except (ValueError, KeyError, TypeError) as exc:
                log(f"warning: {path} is unreadable ({exc})")
                continue
            said = ", ".join(f"{name}: {p.drawn} tasks drawn, {len(p.pending)} of them in no batch yet"
                             for name, p in position.sources.items())
            log(f"resuming after batch {step} ({path}): {said}; those started again first")
            return position
    log(f"resuming after batch {step}: checkpoints/{step_name(step)} has no data position (an older primerl); "
        f"the task order continues from where it stands when no group failed or was dropped")
    return DataPosition(step=step, sources={name: SourcePosition(drawn=step * quota) for name, quota in quotas.items()})
