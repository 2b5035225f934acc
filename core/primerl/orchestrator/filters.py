"""Which finished groups train: the batch writer's filters.

* **staleness** - a sample's staleness in batch n is (n - 1) - the oldest policy version
  among its tokens; a group above ``orchestrator.max_off_policy_steps`` is dropped
  (``dropped_stale`` counts its samples) and a fresh group takes its place. An in-flight
  group started so long ago that it could not qualify even for the next batch is
  *hopeless*: the orchestrator cancels it.
* **uniform groups** (``orchestrator.skip_uniform_groups``, DAPO's dynamic sampling) - a
  group whose episodes all have the same reward has a group-relative advantage of 0 for all,
  no signal: it is skipped (``skipped_uniform``), at most :data:`SKIP_UNIFORM_MAX` batches'
  worth of groups per batch, so a task set the policy has mastered cannot stall the run.

Pure Python: no torch.
"""

from __future__ import annotations

import attrs

from primerl.orchestrator.groups import Group

__all__ = ["SKIP_UNIFORM_MAX", "GroupFilter", "staleness", "uniform"]

SKIP_UNIFORM_MAX = 4  # orchestrator.skip_uniform_groups skips at most this many batches' worth of groups per batch


def staleness(group: Group, step: int) -> int:
    """How many versions behind the policy batch ``step`` trains (v(step - 1)) the group's
    oldest token is."""
    return (step - 1) - group.oldest_version


def uniform(group: Group) -> bool:
    """Every episode of the group has the same reward: a group-relative advantage is 0 for all."""
    return len({s.reward for s in group.samples}) <= 1


@attrs.define
class GroupFilter:
    """The filters of one run, with what they turned away since the last batch."""

    max_off_policy_steps: int
    skip_uniform: bool = False
    skip_limit: int = 0  # uniform groups skipped per batch at most
    dropped: int = 0  # samples of stale groups dropped, this batch
    skipped: int = 0  # uniform groups skipped, this batch

    def admit(self, group: Group, step: int) -> bool:
        """Whether a finished group enters batch ``step``; a refused one is counted."""
        if staleness(group, step) > self.max_off_policy_steps:
            self.dropped += len(group.samples)
            return False
        if self.skip_uniform and uniform(group) and self.skipped < self.skip_limit:
            self.skipped += 1
            return False
        return True

    def hopeless(self, group: Group, next_step: int) -> bool:
        """An in-flight group too stale for batch ``next_step`` even if its tokens were all
        sampled by the version it started with."""
        return (next_step - 1) - group.start_version > self.max_off_policy_steps

    def take_metrics(self) -> dict[str, int]:
        """``dropped_stale`` (and ``skipped_uniform`` when on) of the batch, then counting anew."""
        out = {"dropped_stale": self.dropped, **({"skipped_uniform": self.skipped} if self.skip_uniform else {})}
        self.dropped = self.skipped = 0
        return out
