"""RL losses: the contract, the built-ins, and how a name and its options become one.

What: ``trainer.loss`` names a loss registered through the ``register_losses`` hook (the
core's own plugin, :mod:`primerl.builtin_plugin`, registers every loss below) or any
importable factory as ``"module:attr"``; ``[trainer.loss_options]`` are its options. The
registered target is the loss's class: called with the options as keywords it returns the
loss (:class:`Loss`), so each loss types and checks its own options (an attrs class with
validators, :mod:`primerl.algorithms.options`) and the config check finds a bad one before a
run starts.

Why one record in (:class:`LossInputs`): the field's objectives differ in three places only,
the per-token term (clipped, soft-gated, masked, REINFORCE-weighted), whether the ratio is a
token's or its sequence's, and how the sum is normalised (per token of the step, per
sequence, by a constant). Everything any of them needs is in the record, so a new loss is a
page of formula, never a change to the trainer (:func:`primerl.trainer.step.rl_step` builds
the record for every forward and calls the loss).

Composition with an off-policy correction (``trainer.correction``, :mod:`primerl.algorithms.corrections`):
without one, a loss's ratio is against the sampling policy, the engine's logprobs (one
optimizer step per batch, so the engine's policy is the only "old" policy there is). With
one, the ratio is against the trainer's own logprobs, detached (``old_logprobs``: 1 in value,
the policy gradient in its gradient) and the correction's weight of the trainer/engine
mismatch multiplies every token's term (``weights``): the decoupled form of TIS, MIS and
IcePop that verl, TRL and slime use. Every loss multiplies its per-token term by ``weights``.

Metrics (the second return value) are token sums; the trainer adds them over forwards and
ranks and divides by the step's loss tokens. A key ending in ``/max`` is a maximum instead.
``mismatch_kl`` is the trainer's own, whatever the loss.

Importing this module imports no torch (the orchestrator and the config check import it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, Protocol

import attrs

from primerl.algorithms.options import below_one, non_negative, normalization, option, optional_float, positive
from primerl.registry import resolve_component

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

__all__ = [
    "MAX_LOG_RATIO", "CISPOLoss", "DAPOLoss", "DefaultLoss", "DrGRPOLoss", "GRPOClipLoss", "GSPOLoss", "IPOLoss", "Loss",
    "LossInputs", "Normalize", "SAPOLoss", "build_loss", "reduce",
]

MAX_LOG_RATIO = 20.0  # log-ratios are clamped to +-this before exp: a far-off token cannot overflow to inf


@attrs.frozen(kw_only=True)
class LossInputs:
    """One forward's loss tokens and the step's totals (N: this forward's real tokens)."""

    logprobs: Tensor  # [N] float32, the trainer's log p(token), requires grad
    inference_logprobs: Tensor  # [N] float32, the engine's log p(token)
    old_logprobs: Tensor  # [N] float32, the ratio's reference: inference_logprobs, or logprobs detached under a correction
    advantages: Tensor  # [N] float32, the token's sample's advantage
    loss_mask: Tensor  # [N] bool, tokens that train
    weights: Tensor  # [N] float32, the correction's weight (detached; ones without a correction)
    sample_ids: Tensor  # [N] long, the token's sample (its index in the batch)
    sample_loss_tokens: Tensor  # [N] float32, loss tokens of the token's sample in the whole step
    step_loss_tokens: float  # loss tokens of the whole optimizer step (every rank)
    step_samples: float  # samples with at least one loss token in the step
    max_tokens: int  # orchestrator.max_tokens: the generation budget per turn (Dr. GRPO's constant)

    def log_ratio(self) -> Tensor:
        """[N] log(pi_theta / pi_old) on loss tokens (0 elsewhere), clamped to +-MAX_LOG_RATIO."""
        import torch

        lr = torch.where(self.loss_mask, self.logprobs - self.old_logprobs, torch.zeros_like(self.logprobs))
        return lr.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)

    def sequence_sum(self, values: Tensor) -> Tensor:
        """[N]: on every token, the sum of ``values`` over its sample's loss tokens in this
        forward (a sample's tokens are all in one forward unless context parallel splits
        them, which sequence-level losses refuse). Differentiable."""
        import torch

        dense, inverse = torch.unique(self.sample_ids, return_inverse=True)
        per_sample = torch.zeros(dense.shape[0], dtype=values.dtype, device=values.device)
        per_sample = per_sample.index_add(0, inverse, torch.where(self.loss_mask, values, torch.zeros_like(values)))
        return per_sample[inverse]

    def sequence_mean_log_ratio(self) -> Tensor:
        """[N]: the mean log-ratio of the token's sample (GSPO's log s_i), clamped."""
        lr = self.log_ratio()
        count = self.sequence_sum(self.loss_mask.to(lr.dtype)).clamp_min(1.0)
        return (self.sequence_sum(lr) / count).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


Normalize = Literal["token", "sequence", "constant"]


def reduce(per_token: Tensor, x: LossInputs, normalize: Normalize) -> Tensor:
    """The step's share of ``per_token`` ([N], zero off the loss tokens) under a
    normalisation: ``token`` sum / the step's loss tokens (DAPO); ``sequence`` each
    sample's token mean, averaged over the step's samples (GRPO); ``constant`` sum /
    (samples x max_tokens) (Dr. GRPO)."""
    import torch

    per_token = torch.where(x.loss_mask, per_token, torch.zeros_like(per_token))
    if normalize == "token":
        return per_token.sum() / max(x.step_loss_tokens, 1.0)
    if normalize == "sequence":
        return (per_token / x.sample_loss_tokens.clamp_min(1.0)).sum() / max(x.step_samples, 1.0)
    return per_token.sum() / max(x.step_samples * x.max_tokens, 1.0)


class Loss(Protocol):
    """What ``trainer.loss`` builds: ``target(**trainer.loss_options)`` returns one."""

    # the loss needs every token of a sample in one forward (a sequence ratio): refused
    # with context parallel, which splits a sample's tokens over ranks
    sequence_level: bool

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        """(the loss, already normalised for the whole step; metrics as token sums)."""
        ...


# ---- the losses ------------------------------------------------------------------------------------

@attrs.frozen(kw_only=True)
class DefaultLoss:
    """``default``: prime-rl's DPPO masking with its log-ratio KL term.

    r = exp(lp - lp_old), dp = p_theta - p_old. A token is masked (no policy gradient)
    once its probability has moved past the trust region in the direction its advantage
    pushes: A > 0 and dp > dppo_mask_high, or A < 0 and dp < -dppo_mask_low. Per token:
    -w * keep * adv_tau * A * r + kl_tau * (log r)^2, summed over the step's loss tokens
    and divided by their number.
    """

    dppo_mask_low: float = option(0.2, positive)
    dppo_mask_high: float = option(0.2, positive)
    adv_tau: float = option(1.0, non_negative)
    kl_tau: float = option(0.0, non_negative)
    sequence_level = False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        lr = x.log_ratio()
        with torch.no_grad():
            dp = x.logprobs.exp() - x.old_logprobs.exp()
            masked = ((x.advantages > 0) & (dp > self.dppo_mask_high)) | ((x.advantages < 0) & (dp < -self.dppo_mask_low))
            keep = x.loss_mask & ~masked
        ratio = torch.where(keep, lr, torch.zeros_like(lr)).exp()  # a masked token's ratio never reaches exp
        per_token = -x.weights * keep * self.adv_tau * x.advantages * ratio + self.kl_tau * lr.square()
        return reduce(per_token, x, "token"), {"masked_fraction": (masked & x.loss_mask).sum().float()}


@attrs.frozen(kw_only=True)
class IPOLoss:
    """``ipo``: prime-rl's IPO, a symmetric trust region on the probability.

    A token is masked once |p_theta - p_old| > eps, whichever way its advantage points.
    Per token: -w * keep * adv_tau * A * r + kl_tau * (log r)^2, token-normalised.
    """

    eps: float = option(0.1, positive)
    adv_tau: float = option(1.0, non_negative)
    kl_tau: float = option(1e-3, non_negative)
    sequence_level = False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        lr = x.log_ratio()
        with torch.no_grad():
            masked = (x.logprobs.exp() - x.old_logprobs.exp()).abs() > self.eps
            keep = x.loss_mask & ~masked
        ratio = torch.where(keep, lr, torch.zeros_like(lr)).exp()
        per_token = -x.weights * keep * self.adv_tau * x.advantages * ratio + self.kl_tau * lr.square()
        return reduce(per_token, x, "token"), {"masked_fraction": (masked & x.loss_mask).sum().float()}


def _clipped_surrogate(ratio: Tensor, advantages: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """PPO's pessimistic term -min(r A, clip(r, 1 - low, 1 + high) A) and where the clip
    binds (its gradient is zero there)."""
    import torch

    clipped = ratio.clamp(1.0 - low, 1.0 + high)
    term = -torch.minimum(ratio * advantages, clipped * advantages)
    binds = ((advantages > 0) & (ratio > 1.0 + high)) | ((advantages < 0) & (ratio < 1.0 - low))
    return term, binds


@attrs.frozen(kw_only=True)
class GRPOClipLoss:
    """``grpo_clip``: PPO's clipped surrogate with GRPO's normalisation.

    Per token: -w * min(r A, clip(r, 1 - clip_low, 1 + clip_high) A); each sequence's
    token mean, averaged over the step's sequences (``normalize``: ``sequence``; or
    ``token``, or ``constant``).
    """

    clip_low: float = option(0.2, below_one)
    clip_high: float = option(0.2, non_negative)
    normalize: Normalize = attrs.field(default="sequence", validator=normalization)
    sequence_level = False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        term, binds = _clipped_surrogate(x.log_ratio().exp(), x.advantages, self.clip_low, self.clip_high)
        return reduce(x.weights * term, x, self.normalize), {"clipped_fraction": (binds & x.loss_mask).sum().float()}


@attrs.frozen(kw_only=True)
class DAPOLoss(GRPOClipLoss):
    """``dapo``: the clipped surrogate with clip-higher (a wider upper bound, 0.28) and
    token-level normalisation (every token of the step weighs the same). DAPO's dynamic
    sampling and overlong shaping are the orchestrator's: ``orchestrator.skip_uniform_groups``
    (:mod:`primerl.orchestrator.filters`) and ``orchestrator.overlong_buffer``
    (:mod:`primerl.algorithms.shaping`)."""

    clip_low: float = option(0.2, below_one)
    clip_high: float = option(0.28, non_negative)
    normalize: Normalize = attrs.field(default="token", validator=normalization)


@attrs.frozen(kw_only=True)
class DrGRPOLoss(GRPOClipLoss):
    """``dr_grpo``: the clipped surrogate summed and divided by a constant, samples x
    ``orchestrator.max_tokens``, so neither a sequence's length nor the batch's token count
    biases the update (pair it with the ``grpo`` advantage, which does not divide by the std)."""

    normalize: Normalize = attrs.field(default="constant", validator=normalization)


@attrs.frozen(kw_only=True)
class GSPOLoss:
    """``gspo``: the sequence's ratio, clipped.

    s_i = exp(mean over the sequence's tokens of log r); per sequence
    -w * min(s_i A_i, clip(s_i, 1 - clip_low, 1 + clip_high) A_i), averaged over the step's
    sequences. The bounds are GSPO's (3e-4, 4e-4): a sequence ratio moves far less than a
    token's.
    """

    clip_low: float = option(3e-4, below_one)
    clip_high: float = option(4e-4, non_negative)
    sequence_level = True

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        seq_ratio = x.sequence_mean_log_ratio().exp()  # [N] s_i on each token of sequence i
        term, binds = _clipped_surrogate(seq_ratio, x.advantages, self.clip_low, self.clip_high)
        # each of a sequence's tokens carries 1/|o_i| of its term: the sum over them is the term
        loss = reduce(x.weights * term, x, "sequence")
        with torch.no_grad():
            on = x.loss_mask.float()
            metrics = {"clipped_fraction": (binds & x.loss_mask).sum().float(),
                       "sequence_ratio/mean": (seq_ratio * on).sum(),
                       "sequence_ratio/max": torch.where(x.loss_mask, seq_ratio, torch.zeros_like(seq_ratio)).max()}
        return loss, metrics


@attrs.frozen(kw_only=True)
class CISPOLoss:
    """``cispo`` (MiniMax-M1): REINFORCE weighted by the clipped, detached ratio.

    Per token: -w * sg(clip(r, 1 - clip_low, 1 + clip_high)) * A * log p_theta,
    token-normalised. Unlike PPO's clip, no token loses its gradient: the weight is
    bounded, the log-probability still trains. ``clip_low`` unset: no lower bound (MiniMax-M1).
    """

    clip_low: float | None = attrs.field(default=None, converter=optional_float)
    clip_high: float = option(4.0, non_negative)
    sequence_level = False

    def __attrs_post_init__(self) -> None:
        if self.clip_low is not None and not 0 <= self.clip_low < 1:
            raise ValueError(f"clip_low must be in [0, 1) or unset, got {self.clip_low}")

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        with torch.no_grad():
            ratio = x.log_ratio().exp()
            low = 0.0 if self.clip_low is None else 1.0 - self.clip_low
            weight = ratio.clamp(low, 1.0 + self.clip_high)
            binds = x.loss_mask & ((ratio > 1.0 + self.clip_high) | (ratio < low))
        per_token = -x.weights * weight * x.advantages * x.logprobs
        return reduce(per_token, x, "token"), {"clipped_fraction": binds.sum().float()}


@attrs.frozen(kw_only=True)
class SAPOLoss:
    """``sapo`` (Qwen): a soft gate in place of the clip.

    f(r) = 4 / tau * sigmoid(tau * (r - 1)) with tau = tau_pos where A > 0, tau_neg where
    A < 0; per token -w * f(r) * A, each sequence's mean averaged over sequences. Its
    gradient is r * 4 sigmoid(.)(1 - sigmoid(.)) * A: the plain gradient at r = 1, fading
    smoothly as r leaves 1 (faster for negative advantages, tau_neg > tau_pos).
    """

    tau_pos: float = option(1.0, positive)
    tau_neg: float = option(1.05, positive)
    sequence_level = False

    def __call__(self, x: LossInputs) -> tuple[Tensor, dict[str, Any]]:
        import torch

        ratio = x.log_ratio().exp()
        tau = torch.where(x.advantages > 0, torch.full_like(ratio, self.tau_pos), torch.full_like(ratio, self.tau_neg))
        gate = 4.0 / tau * torch.sigmoid(tau * (ratio - 1.0))
        with torch.no_grad():
            s = torch.sigmoid(tau * (ratio - 1.0))
            attenuation = 4.0 * s * (1.0 - s)  # the gate's gradient scale, 1 at r = 1
        return reduce(-x.weights * gate * x.advantages, x, "sequence"), {
            "gate_scale/mean": (attenuation * x.loss_mask).sum()}


# ---- lookup ----------------------------------------------------------------------------------------

def build_loss(name: str, options: dict[str, Any] | None = None) -> Loss:
    """The loss ``trainer.loss`` names, built with ``trainer.loss_options``. A ``TypeError``
    (an option the loss does not take) or ``ValueError`` (a bad value) says which."""
    return resolve_component("loss", name, "trainer.loss")(**dict(options or {}))
