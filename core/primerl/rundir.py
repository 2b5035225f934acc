"""Names inside a run directory, shared by the processes that write and read them.

See docs/architecture.md for the layout. Keeping the names here means the trainer (which
writes ``weights/step_n``) and the orchestrator (which loads it into inference) cannot
drift apart.
"""

from __future__ import annotations

STABLE = "STABLE"  # written last into weights/step_n: the step is complete
SHM_LINK = "shm.safetensors"  # in weights/step_n when the trainer used the shm channel


def step_name(n: int) -> str:
    return f"step_{n:06d}"
