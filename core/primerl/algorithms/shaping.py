"""Reward shaping: what an episode's reward becomes before the advantage estimator sees it.

DAPO's soft overlong punishment (``orchestrator.overlong_buffer``, ``orchestrator.overlong_penalty``):
an answer that runs into the generation budget loses reward smoothly instead of being cut
off at full reward, so the policy learns to finish before ``orchestrator.max_tokens``. The
shaped reward feeds the advantage only: ``reward/mean`` and the batch file keep the env's
reward, and ``overlong/penalty_mean`` logs what was taken.

The orchestrator's advantage stage (:mod:`primerl.orchestrator.advantages`) applies it per
episode. Pure Python: no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs

if TYPE_CHECKING:  # pragma: no cover
    from primerl.samples import Sample

__all__ = ["OverlongShaping"]


@attrs.frozen
class OverlongShaping:
    """DAPO's soft overlong punishment of an episode: with L = ``max_tokens`` and B the
    ``buffer``, a model turn of n tokens (the episode's mean) costs 0 up to L - B,
    (L - B - n) / B x ``penalty`` inside the buffer, -``penalty`` at L. ``buffer`` 0: off."""

    max_tokens: int
    buffer: int = 0
    penalty: float = 1.0

    @property
    def enabled(self) -> bool:
        return bool(self.buffer)

    def __call__(self, episode: Sequence[Sample]) -> float:
        """The penalty (<= 0) added to the episode's reward (its samples: one, or an agent
        env's several)."""
        if not self.buffer:
            return 0.0
        turns = sum(s.turns or 1 for s in episode)
        n = sum(s.sampled_tokens for s in episode) / max(turns, 1)
        start = self.max_tokens - self.buffer
        if n <= start:
            return 0.0
        return -self.penalty * min((n - start) / self.buffer, 1.0)
