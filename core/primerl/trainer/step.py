"""One RL optimizer step over a packed batch, and what it measures about MoE routing.

What: :func:`rl_step` runs the forward over the packed rows a few at a time
(``trainer.micro_batch_rows`` per forward), calls the loss per forward with the step's
loss-token count as normalizer, accumulates gradients, clips and steps once. Along the
way it measures how often the trainer's routers pick the experts inference used
(:func:`routing_agreement`, per MoE layer) and feeds the routers' loads to the
aux-loss-free balancer (:class:`RouterBalancer`).

Why several rows per forward: on CPU most of the time is per-op overhead, so fewer,
larger ops win; packing keeps the rows apart (segment ids), so this changes no result.
Logprobs come from ``primerl.sampling.token_logprobs``, the engine's own function, so the
importance ratio is 1 when trainer and engine hold the same weights.
"""

from __future__ import annotations

from typing import Any

import torch

from primerl.config import RunConfig
from primerl.sampling import token_logprobs
from primerl.trainer.loss import LossFn
from primerl.trainer.packing import PackedBatch


def row_forward(model: torch.nn.Module, row: dict[str, torch.Tensor | None], replay: bool) -> tuple[torch.Tensor, Any]:
    """Trainer logprobs of packed rows' targets ([k, m]; row tensors are [k, m, ...]) and the
    model output (for its routing)."""
    out = model(
        row["input_ids"],
        row["positions"],
        row["lengths"],
        segment_ids=row["segment_ids"],
        replay_experts=row["replay_experts"] if replay else None,
        logits_for="all",
    )
    # logits [k, m, V]; temperature per position [k, m]
    return token_logprobs(out.logits, row["targets"], row["temperatures"]), out


def routing_agreement(own: torch.Tensor, inference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per MoE layer, how many valid tokens the trainer's routers send to exactly the experts
    inference used (as sets). own, inference: [k, m, L, top_k]; valid: [k, m] bool. Returns [L]."""
    same = (own.sort(-1).values == inference.to(own.dtype).sort(-1).values).all(-1)  # [k, m, L]
    return (same & valid[..., None]).sum((0, 1))


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, every sigmoid
    router's ``e_score_correction_bias`` moves by ``rate`` towards its under-loaded experts
    (+rate) and away from its over-loaded ones (-rate), counted over the step's tokens.

    The bias steers which experts are chosen, never their weights, so it needs no
    gradient. ``rate`` 0 (the default for RL from a pretrained checkpoint) leaves routing
    alone; pretraining-style runs use about 1e-3.
    """

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]
        self.loads: torch.Tensor | None = None  # [L, E] tokens per expert this step

    def observe(self, router_experts: torch.Tensor, valid: torch.Tensor) -> None:
        """router_experts: [k, m, L, top_k] the routers' own choice; valid: [k, m] bool."""
        if not self.rate or not self.routers:
            return
        ids = router_experts[valid].long().permute(1, 0, 2).flatten(1)  # [L, n * top_k]
        E = self.routers[0].e_score_correction_bias.shape[0]
        loads = torch.zeros(ids.shape[0], E).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32))
        self.loads = loads if self.loads is None else self.loads + loads

    @torch.no_grad()
    def step(self) -> None:
        if self.loads is not None:
            for router, load in zip(self.routers, self.loads, strict=True):
                bias = router.e_score_correction_bias
                bias += self.rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
        self.loads = None


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    packed: PackedBatch,
    loss_fn: LossFn,
    cfg: RunConfig,
) -> dict[str, float]:
    """One optimizer step over every packed row (gradients accumulated over forwards of
    ``trainer.micro_batch_rows`` rows each). Returns the step's stats for metrics.jsonl."""
    t = cfg.trainer
    n_loss = packed.num_loss_tokens
    normalizer = float(max(n_loss, 1))
    replay = t.router_replay and packed.replay_experts is not None
    optimizer.zero_grad(set_to_none=True)
    total_loss = 0.0
    sums: dict[str, float] = {}
    agreed, routed_tokens = None, 0  # per-layer token counts of trainer/inference routing agreement
    balancer = RouterBalancer(model, t.router_bias_update_rate)
    # several rows per forward: fewer, larger ops (CPU time is mostly per-op overhead)
    for r in range(0, packed.num_rows, t.micro_batch_rows):
        row = packed.rows(r, min(r + t.micro_batch_rows, packed.num_rows))
        k, m = row["input_ids"].shape
        valid = (torch.arange(m)[None, :] < row["lengths"][:, None]).flatten()  # [k*m]
        mask = row["loss_mask"].flatten()[valid]  # [n]
        if not bool(mask.any()):
            continue  # nothing to learn from these rows
        lp, out = row_forward(model, row, replay)
        balancer.observe(out.router_experts, valid.view(k, m))
        lp = lp.flatten()[valid]  # [n]
        if t.routing_metrics and row["replay_experts"] is not None and out.router_experts.shape[2]:
            agree = routing_agreement(out.router_experts, row["replay_experts"], valid.view(k, m))
            agreed = agree if agreed is None else agreed + agree
            routed_tokens += int(valid.sum())
        loss, metrics = loss_fn(
            lp,
            row["inference_logprobs"].flatten()[valid],
            row["advantages"].flatten()[valid],
            mask,
            config=t,
            normalizer=normalizer,
        )
        loss.backward()
        total_loss += float(loss.detach())
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    params = [p for p in model.parameters() if p.grad is not None]
    grad_norm = float(torch.nn.utils.clip_grad_norm_(params, t.max_grad_norm)) if params else 0.0
    optimizer.step()
    balancer.step()
    out = {k: v / normalizer for k, v in sums.items()}
    out.setdefault("mismatch_kl", 0.0)
    out.setdefault("masked_fraction", 0.0)
    out.update(loss=total_loss, grad_norm=grad_norm)
    if agreed is not None and routed_tokens:
        per_layer = (agreed.double() / routed_tokens).tolist()
        out["routing_agreement"] = sum(per_layer) / len(per_layer)
        out.update({f"routing_agreement/layer_{i}": v for i, v in enumerate(per_layer)})
    return out
