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

from collections.abc import Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import attrs
import torch

from primerl.config import RunConfig, TrainerConfig
from primerl.models.contract import CausalLM
from primerl.parallel import Parallelism, world_size
from primerl.sampling import token_logprobs
from primerl.trainer.corrections import Correction
from primerl.trainer.loss import Loss, LossInputs
from primerl.trainer.packing import PackedBatch, join_rows


def compute_precision(t: TrainerConfig) -> AbstractContextManager:
    """The trainer's forwards under ``trainer.precision``: bf16 matmuls through
    ``torch.autocast`` (weights stay float32; the routers and the head opt out of it,
    softmaxes and the loss run in float32), or float32 as the weights are."""
    if t.resolved_precision() != "bfloat16":
        return nullcontext()
    return torch.autocast(t.resolved_device(), dtype=torch.bfloat16)


def row_forward(model: torch.nn.Module, row: dict[str, torch.Tensor | None], replay: bool,
                precision: AbstractContextManager | None = None, only: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, Any]:
    """Trainer logprobs of packed rows' targets ([k, m]; row tensors are [k, m, ...]) and the
    model output (for its routing), the forward under ``precision`` (:func:`compute_precision`).
    ``only``: a bool [k, m] mask of the positions whose logprobs are needed (the loss's): the
    head runs there alone and the other positions' logprobs are 0, with no gradient."""
    with precision or nullcontext():
        out = model(
            row["input_ids"],
            row["positions"],
            row["lengths"],
            segment_ids=row["segment_ids"],
            prefix_ids=row["prefix_ids"],
            replay_experts=row["replay_experts"] if replay else None,
            logits_for="all" if only is None else only,
        )
    if only is None:  # logits [k, m, V]; temperature per position [k, m]
        return token_logprobs(out.logits, row["targets"], row["temperatures"]), out
    chosen = token_logprobs(out.logits, row["targets"][only], row["temperatures"][only])  # logits [N, V] -> [N]
    return chosen.new_zeros(only.shape).masked_scatter(only, chosen), out


def routing_agreement(own: torch.Tensor, inference: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per MoE layer, how many valid tokens the trainer's routers send to exactly the experts
    inference used (as sets). own, inference: [k, m, L, top_k]; valid: [k, m] bool. Returns [L]."""
    same = (own.sort(-1).values == inference.to(own.dtype).sort(-1).values).all(-1)  # [k, m, L]
    return (same & valid[..., None]).sum((0, 1))


class RouterBalancer:
    """Aux-loss-free load balancing (DeepSeek-V3): after each optimizer step, every MoE
    layer's correction bias (the buffers the model's plan declares, ``router_biases``:
    sigmoid routers' ``e_score_correction_bias``) moves by ``rate`` towards its under-loaded
    experts (+rate) and away from its over-loaded ones (-rate), counted over the step's tokens.

    The bias steers which experts are chosen, never their weights, so it needs no
    gradient. ``rate`` 0 (the default for RL from a pretrained checkpoint) leaves routing
    alone; pretraining-style runs use about 1e-3.
    """

    def __init__(self, model: CausalLM, rate: float, parallelism: Parallelism | None = None) -> None:
        self.rate, self.parallelism = rate, parallelism
        # [E] each, in MoE-layer order; found by name on the model as it is (FSDP keeps the names)
        self.biases = [model.get_buffer(name) for name in model.parallel_plan().router_biases] if rate else []
        self.loads: torch.Tensor | None = None  # [L, E] tokens per expert this step

    def observe(self, router_experts: torch.Tensor, valid: torch.Tensor) -> None:
        """router_experts: [k, m, L, top_k] the routers' own choice; valid: [k, m] bool."""
        if not self.rate or not self.biases:
            return
        ids = router_experts[valid].long().permute(1, 0, 2).flatten(1)  # [L, n * top_k]
        E = self.biases[0].shape[0]
        loads = torch.zeros(ids.shape[0], E).scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32))
        self.loads = loads if self.loads is None else self.loads + loads

    @torch.no_grad()
    def step(self) -> None:
        if self.loads is not None:
            if self.parallelism is not None:  # every rank moves its biases by the same, global loads
                self.loads = self.parallelism.sum_over_ranks(self.loads.double()).float()
            for bias, load in zip(self.biases, self.loads, strict=True):
                bias += self.rate * torch.sign(load.mean() - load).to(bias.device, bias.dtype)
        self.loads = None


def micro_batches(packed: PackedBatch, parallelism: Parallelism, rows_per_forward: int,
                  device: torch.device | None = None, *, join: bool = False) -> Iterator[dict[str, torch.Tensor | None]]:
    """This rank's share of the packed rows, ``rows_per_forward`` rows per forward, cut to
    its share of their tokens, on ``device``. Every rank yields as many as the others
    (empty rows pad the last ones): the forward's collectives need every rank. ``join``:
    each forward's rows as one row without padding (:func:`join_rows`; the model's
    ``varlen_rows``)."""
    mine = parallelism.local_rows(packed.num_rows)
    for i in range(0, len(mine), rows_per_forward):
        rows = packed.select(mine[i : i + rows_per_forward])
        rows = parallelism.local_tokens(join_rows(rows) if join else rows)
        yield rows if device is None or device.type == "cpu" else {k: v if v is None else v.to(device) for k, v in rows.items()}


def rl_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    packed: PackedBatch,
    loss_fn: Loss,
    cfg: RunConfig,
    parallelism: Parallelism,
    correction: Correction | None = None,
    *,
    join: bool = False,
) -> dict[str, float]:
    """One optimizer step over every packed row (gradients accumulated over forwards of
    ``trainer.micro_batch_rows`` rows each; with several ranks each runs its share and the
    gradients add up over ranks), the loss's per-token terms weighted by ``correction``'s
    weights when there is one; ``join``: each forward's rows as one row without
    padding (the model's ``varlen_rows``). Returns the step's stats for metrics.jsonl."""
    t = cfg.trainer
    normalizer = float(max(packed.num_loss_tokens, 1))  # the whole batch's, on every rank
    # every sample's loss tokens in the whole step (the batch is whole on every rank), for
    # the losses that normalise per sequence
    loss_index = packed.sample_index[packed.loss_mask]
    per_sample = torch.bincount(loss_index, minlength=int(packed.sample_index.max()) + 1).float()  # [S]
    step_samples = float((per_sample > 0).sum())
    replay = t.router_replay and packed.replay_experts is not None
    optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss": 0.0}  # token sums of the loss's metrics, and the loss
    maxima: dict[str, float] = {}  # the metrics ending in /max
    agreed, routed_tokens = None, 0  # per-layer token counts of trainer/inference routing agreement
    balancer = RouterBalancer(model, t.router_bias_update_rate, parallelism)
    alone = world_size() == 1  # with other ranks, every forward runs: they wait for its collectives
    for row in micro_batches(packed, parallelism, t.micro_batch_rows, torch.device(t.resolved_device()),
                             join=join):
        real = row["sample_index"] >= 0  # [k, m]: tokens of samples (not padding, not an empty row)
        mask = row["loss_mask"] & real  # [k, m]
        if alone and not bool(mask.any()):
            continue  # nothing to learn from these rows
        # the head only where the loss reads it (context parallel returns each rank's own tokens: all of them)
        lp, out = row_forward(model, row, replay, compute_precision(t), only=mask if t.parallel.cp == 1 else None)
        balancer.observe(out.router_experts, real)
        if t.routing_metrics and row["replay_experts"] is not None and out.router_experts.shape[2]:
            agree = routing_agreement(out.router_experts, row["replay_experts"], real)
            agreed = agree if agreed is None else agreed + agree
            routed_tokens += int(real.sum())
        logprobs, inference_logprobs, loss_mask = lp[real], row["inference_logprobs"][real], mask[real]  # [N]
        sample_ids = row["sample_index"][real]  # [N]
        x = LossInputs(
            logprobs=logprobs, inference_logprobs=inference_logprobs,
            old_logprobs=inference_logprobs if correction is None else logprobs.detach(),
            advantages=row["advantages"][real], loss_mask=loss_mask, weights=torch.ones_like(inference_logprobs),
            sample_ids=sample_ids, sample_loss_tokens=per_sample.to(sample_ids.device)[sample_ids],
            step_loss_tokens=normalizer, step_samples=step_samples, max_tokens=cfg.orchestrator.max_tokens,
        )
        metrics: dict[str, Any] = {}
        if correction is not None:
            weights, metrics = correction.weights(x)
            x = attrs.evolve(x, weights=weights.detach())
        loss, loss_metrics = loss_fn(x)
        loss.backward()
        sums["loss"] += float(loss.detach())
        with torch.no_grad():  # k3 = r - log r - 1: the KL between engine and trainer on the sampled tokens
            log_ratio = torch.where(loss_mask, logprobs.detach() - inference_logprobs, torch.zeros_like(logprobs))
            metrics["mismatch_kl"] = (log_ratio.exp() - log_ratio - 1).sum()
        for key, value in {**metrics, **loss_metrics}.items():
            if key.endswith("/max"):
                maxima[key] = max(maxima.get(key, float("-inf")), float(value))
            else:
                sums[key] = sums.get(key, 0.0) + float(value)
    grad_norm = parallelism.clip_grad_norm_(model, t.max_grad_norm)
    optimizer.step()
    balancer.step()
    # add up over ranks: the loss's metrics, then the routing counts (one vector, one collective)
    keys = sorted(sums)
    layers = 0 if agreed is None else agreed.numel()
    vector = torch.tensor([sums[k] for k in keys] + [float(routed_tokens)] + ([] if agreed is None else agreed.tolist()),
                          dtype=torch.float64)
    vector = parallelism.sum_over_ranks(vector)
    totals = dict(zip(keys, vector[: len(keys)].tolist(), strict=True))
    stats = {k: v / normalizer for k, v in totals.items() if k != "loss"}
    if maxima:
        keys_max = sorted(maxima)
        stats.update(zip(keys_max, parallelism.max_over_ranks(
            torch.tensor([maxima[k] for k in keys_max], dtype=torch.float64)).tolist(), strict=True))
    stats.setdefault("mismatch_kl", 0.0)
    stats.setdefault("masked_fraction", 0.0)
    stats.update(loss=totals["loss"], grad_norm=grad_norm)
    routed = float(vector[len(keys)])
    if layers and routed:
        per_layer = (vector[len(keys) + 1 :] / routed).tolist()
        stats["routing_agreement"] = sum(per_layer) / len(per_layer)
        stats.update({f"routing_agreement/layer_{i}": v for i, v in enumerate(per_layer)})
    return stats
