"""RL losses: the built-in, the contract, and lookup by name.

What: ``trainer.loss`` names a component registered by a plugin through the
``register_losses`` hook, like every other component (the core's own plugin,
:mod:`primerl.builtin_plugin`, registers ``default``). A config may also name any
importable function as ``"module:attr"`` (``--trainer.loss my_pkg.losses:clipped``), so
trying an objective needs neither a fork nor a plugin. Advantage estimators, which the
orchestrator runs, live in :mod:`primerl.advantages`.

The loss contract (:class:`LossFn`, what a custom ``trainer.loss`` implements)::

    loss_fn(logprobs, inference_logprobs, advantages, loss_mask, *, config, normalizer)
        -> (loss, metrics)

* ``logprobs`` [N] float32 with grad: the trainer's log p(token) (primerl.sampling.token_logprobs);
* ``inference_logprobs``, ``advantages`` [N] float32; ``loss_mask`` [N] bool;
* ``config``: the ``TrainerConfig``; ``normalizer``: the number of loss tokens in the
  whole optimizer step (the trainer calls the function once per packed row and sums);
* ``loss``: a scalar already divided by ``normalizer``;
* ``metrics``: dict of *token sums* over this call's loss tokens (scalar tensors or
  floats); the trainer adds them over rows and divides by the step's loss tokens.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from primerl.registry import resolve_component

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor


class LossFn(Protocol):
    """What ``trainer.loss`` names (see the module docstring for the meaning of each argument)."""

    def __call__(
        self,
        logprobs: Tensor,  # [N] trainer log p, requires grad
        inference_logprobs: Tensor,  # [N] engine log p
        advantages: Tensor,  # [N]
        loss_mask: Tensor,  # [N] bool
        *,
        config: Any,  # TrainerConfig
        normalizer: float,  # loss tokens of the whole optimizer step
    ) -> tuple[Tensor, dict[str, Any]]: ...


# --------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------


def default_loss(
    logprobs: Tensor,  # [N] trainer log p, requires grad
    inference_logprobs: Tensor,  # [N] engine log p
    advantages: Tensor,  # [N]
    loss_mask: Tensor,  # [N] bool
    *,
    config: Any,
    normalizer: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """prime-rl's importance-ratio loss with probability-difference masking.

    r = exp(lp_train - lp_infer). A token is masked (no gradient) when its probability has
    already moved more than ``mask_threshold`` in the direction its advantage pushes:
    A > 0 and p_train - p_infer > thr, or A < 0 and p_infer - p_train > thr. A kept token
    costs ``-A * r + kl_coef * (log r)^2``. The sum is divided by ``normalizer`` (the loss
    tokens of the step, masked ones included).

    Metrics (token sums): ``mismatch_kl`` (k3 = r - log r - 1, the KL between engine and
    trainer on the sampled tokens) and ``masked_fraction`` (number of masked tokens).
    """
    import torch

    log_ratio = logprobs - inference_logprobs  # [N]
    with torch.no_grad():
        delta = logprobs.exp() - inference_logprobs.exp()  # p_train - p_infer
        thr = config.mask_threshold
        moved = ((advantages > 0) & (delta > thr)) | ((advantages < 0) & (-delta > thr))
        keep = loss_mask & ~moved
    # Zero the log-ratio of dropped tokens *before* exp, so a huge ratio on a masked or
    # prompt token cannot turn into inf * 0 = nan in the backward.
    kept_log_ratio = torch.where(keep, log_ratio, torch.zeros_like(log_ratio))
    ratio = kept_log_ratio.exp()
    per_token = -advantages * ratio + config.kl_coef * kept_log_ratio.square()  # [N]
    loss = torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / normalizer
    with torch.no_grad():
        lr = torch.where(loss_mask, log_ratio, torch.zeros_like(log_ratio))
        k3 = lr.exp() - lr - 1  # 0 where loss_mask is 0
        metrics = {
            "mismatch_kl": k3.sum(),
            "masked_fraction": (moved & loss_mask).sum().float(),
        }
    return loss, metrics


# --------------------------------------------------------------------------------------
# Lookup by name
# --------------------------------------------------------------------------------------


def get_loss(name: str) -> LossFn:
    """The loss ``trainer.loss`` names: a registered loss or a ``"module:attr"`` function."""
    return resolve_component("loss", name, "trainer.loss")
