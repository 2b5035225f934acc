"""Filling a batch and writing it: the batch writer's first and last stage.

Batch n is filled source by source, each with its ``quota`` of the first groups to finish
that the filters admit (:mod:`.filters`; a long-tail rollout never holds a batch back, a
refused group's place goes to a fresh one). Once the advantage stage has run and the
metrics are in, the batch is written as ``rollouts/step_n.pt``
(:func:`primerl.samples.write_batch`), its data position (:mod:`.positions`) just before it
as ``rollouts/step_n.state.json``, so a trainer that sees the batch finds its position.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from primerl import watchdog
from primerl.orchestrator.filters import GroupFilter
from primerl.orchestrator.positions import DataPosition
from primerl.orchestrator.sources import Source
from primerl.rundir import RunDir, write_atomically
from primerl.samples import RolloutBatch, write_batch

__all__ = ["fill", "position_record", "write_batch_files"]


async def fill(src: Source, step: int, filters: GroupFilter) -> None:
    """Take ``src``'s finished groups, first come first served, until ``src.batching`` holds
    its quota of admitted ones. Every group taken leaves the pending draws: an admitted one
    is in the batch, a refused one is replaced by a fresh draw."""
    while len(src.batching) < src.quota:
        watchdog.doing(f"filling batch {step}: {len(src.batching)} of {src.quota} groups of {src.name}")
        group = await src.finished.get()
        src.pending.pop(group.draw, None)
        if filters.admit(group, step):
            src.batching.append(group)


def position_record(step: int, sources: Sequence[Source]) -> dict[str, Any]:
    """The data position once batch ``step`` is filled: each source's draws, with the draws
    of the groups in the batch (the JSON object written beside it)."""
    position = DataPosition(step=step, sources={src.name: src.position() for src in sources})
    return position.record({src.name: [g.draw for g in src.batching if g.draw is not None] for src in sources})


def write_batch_files(run_dir: RunDir, batch: RolloutBatch, position: dict[str, Any]) -> None:
    """The data position, then the batch (a trainer that sees the batch finds its position)."""
    write_atomically(run_dir.batch_state(batch.step), lambda tmp: tmp.write_text(json.dumps(position)))
    write_batch(run_dir.batch(batch.step), batch)
