"""Off-policy corrections for the gap between the sampling engine and the trainer.

What: ``trainer.correction`` names one (``tis``, ``mis``, ``icepop``, registered through
the ``register_corrections`` hook, or a ``"module:attr"`` factory); ``[trainer.correction_options]``
are its options; "" (the default) is none. A correction turns the mismatch ratio
rho = pi_trainer / pi_engine of each loss token into a detached weight; every loss
multiplies its per-token term by it, and its own ratio is then taken against the trainer's
detached logprobs (see :mod:`primerl.algorithms.losses`): the decoupled form that verl's
``rollout_correction``, TRL's ``vllm_importance_sampling_mode`` and slime's ``--use-tis``
implement.

Why: an async run samples with an engine whose numerics (kernels, precision, MoE routing)
and weights (up to ``max_off_policy_steps`` behind) differ from the trainer's. Truncating
the weight (TIS) bounds its variance; masking (MIS, IcePop) drops the tokens or sequences
whose mismatch is too large to trust; the sequence levels correct the whole trajectory's
probability, not each token's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

from primerl.algorithms.losses import MAX_LOG_RATIO, LossInputs
from primerl.algorithms.options import non_negative, positive
from primerl.registry import resolve_component

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

__all__ = ["MIS", "TIS", "Correction", "IcePop", "Level", "build_correction", "mismatch_log_ratio"]

Level = Literal["token", "sequence"]


class Correction(Protocol):
    """What ``trainer.correction`` builds: ``target(**trainer.correction_options)``."""

    sequence_level: bool  # needs a sample's tokens in one forward (refused with context parallel)

    def weights(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        """[N] detached weights (0: the token is dropped) and metrics as token sums (``/max``: maxima)."""
        ...


def mismatch_log_ratio(x: LossInputs, level: str) -> Tensor:
    """[N] log rho on loss tokens: the token's own (``token``), the sum over its sequence
    (``sequence``: log of the product), or the mean over it (``geometric``)."""
    import torch

    lr = torch.where(x.loss_mask, x.logprobs.detach() - x.inference_logprobs, torch.zeros_like(x.inference_logprobs))
    if level == "sequence":
        lr = x.sequence_sum(lr)
    elif level == "geometric":
        lr = x.sequence_sum(lr) / x.sequence_sum(x.loss_mask.float()).clamp_min(1.0)
    return lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _metrics(x: LossInputs, rho: Tensor, w: Tensor) -> dict[str, Any]:
    import torch

    on = x.loss_mask
    zero = torch.zeros_like(w)
    return {"is_weight/mean": torch.where(on, w, zero).sum(),
            "is_weight/max": torch.where(on, w, zero).max() if bool(on.any()) else zero.sum(),
            "is_ratio/max": torch.where(on, rho, zero).max() if bool(on.any()) else zero.sum(),
            "is_masked_fraction": (on & (w == 0)).sum().float()}


_LEVEL = attrs.validators.in_(("token", "sequence"))


class _Leveled:
    """A correction whose ``level`` says whether it weighs tokens or whole sequences."""

    level: str

    @property
    def sequence_level(self) -> bool:
        return self.level != "token"


@attrs.frozen(kw_only=True)
class TIS(_Leveled):
    """``tis``: truncated importance sampling, w = min(rho, cap); rho of the token, or of
    the whole sequence (the product of its tokens' ratios) at ``level = "sequence"``."""

    cap: float = attrs.field(default=2.0, converter=float, validator=positive)
    level: Level = attrs.field(default="token", validator=_LEVEL)

    def weights(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        with torch.no_grad():
            rho = mismatch_log_ratio(x, self.level).exp()
            w = rho.clamp(max=self.cap)
        return w, _metrics(x, rho, w)


@attrs.frozen(kw_only=True)
class MIS(_Leveled):
    """``mis``: masked importance sampling, w = rho where floor <= rho <= cap, else 0 (the
    token, or at ``level = "sequence"`` the whole sequence, is dropped); at ``level =
    "geometric"`` the sequence's geometric-mean ratio decides and a kept sequence weighs 1
    (geometric masking: rejection without reweighting, set a narrow band such as
    floor 0.99, cap 1.01)."""

    cap: float = attrs.field(default=2.0, converter=float, validator=positive)
    floor: float = attrs.field(default=0.0, converter=float, validator=non_negative)
    level: Literal["token", "sequence", "geometric"] = attrs.field(
        default="token", validator=attrs.validators.in_(("token", "sequence", "geometric")))

    def __attrs_post_init__(self) -> None:
        if self.floor >= self.cap:
            raise ValueError(f"floor ({self.floor}) must be below cap ({self.cap})")

    def weights(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        with torch.no_grad():
            rho = mismatch_log_ratio(x, self.level).exp()
            inside = (rho >= self.floor) & (rho <= self.cap)
            kept = torch.ones_like(rho) if self.level == "geometric" else rho
            w = torch.where(inside, kept, torch.zeros_like(rho))
        return w, _metrics(x, rho, w)


@attrs.frozen(kw_only=True)
class IcePop:
    """``icepop`` (Ring-1T): a token's ratio weighs it where low <= rho <= high; outside
    that band the token is dropped (double-sided masking of the training/inference
    mismatch, which MoE routing makes large)."""

    low: float = attrs.field(default=0.5, converter=float, validator=positive)
    high: float = attrs.field(default=5.0, converter=float, validator=positive)
    sequence_level = False

    def __attrs_post_init__(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")

    def weights(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        with torch.no_grad():
            rho = mismatch_log_ratio(x, "token").exp()
            w = torch.where((rho >= self.low) & (rho <= self.high), rho, torch.zeros_like(rho))
        return w, _metrics(x, rho, w)


def build_correction(name: str, options: dict[str, Any] | None = None) -> Correction | None:
    """The correction ``trainer.correction`` names with ``trainer.correction_options``; None for ""."""
    if not name:
        return None
    return resolve_component("correction", name, "trainer.correction")(**dict(options or {}))
