"""The run directory: every path, step name and marker a run writes or reads.

The processes of a run (launcher, inference, orchestrator, trainer) talk through files
under one directory, on one machine or a shared filesystem. This module is the only
place that knows the layout, so a writer and its reader cannot drift apart and no file
parses step names of its own. docs/architecture.md shows the same layout as a table.

Every file is written under a temporary name and renamed into place
(:func:`write_atomically`), so a reader never sees half a file; a directory is complete
once its marker exists (``STABLE`` for published weights, the trainer state file for a
checkpoint). Which checkpoint a run resumes from, and what of an interrupted attempt is set
aside into ``previous-<time>/``, is :mod:`primerl.resume`'s business.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

__all__ = ["RunDir", "write_atomically", "write_dir_atomically"]

STABLE = "STABLE"  # written last into weights/step_n: the step is complete
SHM_LINK = "shm.safetensors"  # in weights/step_n when the trainer used the shm channel
TRAINER_STATE = "trainer_state.pt"  # written into checkpoints/step_n: the checkpoint is complete
OPTIMIZER_DIR = "optimizer"  # in checkpoints/step_n: the optimizer state, a torch.distributed.checkpoint
MANIFEST = "manifest.json"  # in checkpoints/step_n: every file's size, checked before a resume
ORCHESTRATOR_STATE = "orchestrator_state.json"  # in checkpoints/step_n: the data position (primerl.resume)
PREVIOUS_PREFIX = "previous-"  # OUT/previous-<time>/: what an earlier attempt left, set aside
_STEP = re.compile(r"step_(\d{6,})$")
TMP_PREFIX = ".tmp_"


def step_name(n: int) -> str:
    """``step_000012``: the name of step ``n``'s batch file stem and directories."""
    return f"step_{n:06d}"


def parse_step(name: str) -> int | None:
    """The step number of a ``step_NNNNNN`` name (a file's stem or a directory), else None."""
    m = _STEP.match(name)
    return int(m.group(1)) if m else None


class RunDir:
    """The layout of one run directory (``--output-dir``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    # ---- files -------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        """The fully resolved config every process reads (written by the launcher)."""
        return self.root / "config.toml"

    @property
    def runtime(self) -> Path:
        """What the launcher discovered when it started the run (:mod:`primerl.runtime`)."""
        return self.root / "runtime.json"

    @property
    def metrics(self) -> Path:
        """One JSON object per trainer step."""
        return self.root / "metrics.jsonl"

    @property
    def reward_plot(self) -> Path:
        return self.root / "reward.png"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log(self, process: str) -> Path:
        """``logs/<process>.log``: a child's stdout and stderr."""
        return self.logs / f"{process}.log"

    # ---- rollouts: orchestrator -> trainer ---------------------------------------------
    @property
    def rollouts(self) -> Path:
        return self.root / "rollouts"

    def batch(self, n: int) -> Path:
        """``rollouts/step_n.pt``: the samples of trainer step n (see primerl.samples)."""
        return self.rollouts / f"{step_name(n)}.pt"

    def batch_state(self, n: int) -> Path:
        """``rollouts/step_n.state.json``: the orchestrator's data position once batch n was
        written (written just before the batch; the trainer copies it into checkpoint n)."""
        return self.rollouts / f"{step_name(n)}.state.json"

    def batch_steps(self) -> list[int]:
        """Every complete ``rollouts/step_n.pt``, oldest first."""
        if not self.rollouts.is_dir():
            return []
        return sorted(n for f in self.rollouts.glob("step_*.pt") if (n := parse_step(f.stem)) is not None)

    # ---- weights: trainer -> inference -------------------------------------------------
    @property
    def weights(self) -> Path:
        return self.root / "weights"

    def weights_step(self, n: int) -> Path:
        """``weights/step_n/``: policy v(n), complete once its ``STABLE`` file exists."""
        return self.weights / step_name(n)

    def published(self, n: int) -> bool:
        return (self.weights_step(n) / STABLE).exists()

    def published_steps(self) -> list[int]:
        """Every complete ``weights/step_n``, oldest first."""
        return _steps(self.weights, lambda d: (d / STABLE).exists())

    def newest_published(self) -> int | None:
        steps = self.published_steps()
        return steps[-1] if steps else None

    def weights_source(self, n: int) -> Path:
        """What an inference server loads for v(n): the shm file when the trainer used that
        channel, else the HF checkpoint directory."""
        d = self.weights_step(n)
        return d / SHM_LINK if (d / SHM_LINK).exists() else d

    def shm(self) -> Path:
        """Where the shm channel keeps this run's weights: tmpfs, one folder per run directory."""
        digest = hashlib.sha1(str(self.root.resolve()).encode()).hexdigest()[:12]
        return Path("/dev/shm") / f"primerl-{digest}"

    def shm_weights(self, n: int) -> Path:
        """The shm channel's file of v(n), linked from ``weights/step_n/shm.safetensors``."""
        return self.shm() / f"{step_name(n)}.safetensors"

    # ---- checkpoints: trainer's resumable state ----------------------------------------
    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    def checkpoint(self, n: int) -> Path:
        """``checkpoints/step_n/``: HF weights, ``optimizer/``, ``orchestrator_state.json``,
        ``manifest.json`` and ``trainer_state.pt``."""
        return self.checkpoints / step_name(n)

    def checkpoint_steps(self) -> list[int]:
        """Every complete checkpoint (one holding its trainer state), oldest first."""
        return _steps(self.checkpoints, lambda d: (d / TRAINER_STATE).is_file())

    def latest_checkpoint(self) -> tuple[int, Path] | None:
        """The newest complete checkpoint, usable or not (``primerl.resume.usable_checkpoint``
        checks its files)."""
        steps = self.checkpoint_steps()
        return (steps[-1], self.checkpoint(steps[-1])) if steps else None

    def previous(self, stamp: str) -> Path:
        """``previous-<stamp>/``: where an earlier attempt's files are set aside."""
        return self.root / f"{PREVIOUS_PREFIX}{stamp}"

    # ---- housekeeping ------------------------------------------------------------------
    def remove_partial_writes(self) -> None:
        """Delete directories a process left half-written when it died mid-write."""
        for parent in (self.weights, self.checkpoints):
            for stale in parent.glob(f"{TMP_PREFIX}*") if parent.is_dir() else ():
                shutil.rmtree(stale, ignore_errors=True)


def _steps(parent: Path, complete: Callable[[Path], bool]) -> list[int]:
    if not parent.is_dir():
        return []
    return sorted(n for d in parent.iterdir() if (n := parse_step(d.name)) is not None and complete(d))


def write_dir_atomically(final: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_dir)``, then rename the temporary directory to ``final``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    write(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)


def write_atomically(path: Path, write: Callable[[Path], None]) -> None:
    """Call ``write(tmp_path)``, then rename it to ``path`` (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)
