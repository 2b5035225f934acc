"""One RL optimizer step over a packed batch, and what it measures about MoE routing.

What: :func:`rl_step` runs the forward over the packed rows a few at a time
(``trainer.micro_batch_rows`` per forward), calls the loss per forward with the step's
totals as normalizers (:class:`StepTotals`), accumulates gradients, clips and steps once.
Per forward, :func:`loss_inputs` makes the loss's record (:class:`primerl.algorithms.LossInputs`)
and :func:`forward_loss` weighs its tokens by the off-policy correction, if any, then calls
the loss (:mod:`primerl.algorithms`). :class:`StepMetrics` gathers the figures over forwards
and ranks, among them how often the trainer's routers pick the experts inference used
(:func:`routing_agreement`, per MoE layer); the routers' loads feed the aux-loss-free
balancer (:class:`RouterBalancer`).

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

from primerl.algorithms import Correction, Loss, LossInputs
from primerl.config import RunConfig, TrainerConfig
from primerl.models.contract import CausalLM
from primerl.parallel import Parallelism, world_size
from primerl.sampling import token_logprobs
from primerl.trainer.packing import PackedBatch, join_rows

__all__ = ["StepMetrics", "rl_step"]


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


@attrs.frozen
class StepTotals:
    """What the loss normalises by, over the whole optimizer step (the batch is whole on
    every rank, so every rank computes the same)."""

    loss_tokens: float  # the step's loss tokens (at least 1): the token normaliser
    per_sample: torch.Tensor  # [S] float32, each sample's loss tokens (the per-sequence normaliser)
    samples: float  # samples with at least one loss token

    @classmethod
    def of(cls, packed: PackedBatch) -> StepTotals:
        loss_index = packed.sample_index[packed.loss_mask]
        per_sample = torch.bincount(loss_index, minlength=int(packed.sample_index.max()) + 1).float()  # [S]
        return cls(loss_tokens=float(max(packed.num_loss_tokens, 1)), per_sample=per_sample,
                   samples=float((per_sample > 0).sum()))


def loss_inputs(row: dict[str, torch.Tensor | None], logprobs: torch.Tensor, mask: torch.Tensor, real: torch.Tensor,
                totals: StepTotals, *, max_tokens: int, corrected: bool) -> LossInputs:
    """One forward's :class:`LossInputs`: its real tokens (``real`` [k, m]) flattened to [N];
    ``logprobs`` [k, m] the trainer's, ``mask`` [k, m] its loss tokens. ``corrected``: a
    correction will weigh the tokens, so the ratio's reference is the trainer's own logprobs
    (detached), not the engine's."""
    own, engine = logprobs[real], row["inference_logprobs"][real]  # [N]
    sample_ids = row["sample_index"][real]  # [N]
    return LossInputs(
        logprobs=own, inference_logprobs=engine, old_logprobs=own.detach() if corrected else engine,
        advantages=row["advantages"][real], loss_mask=mask[real], weights=torch.ones_like(engine),
        sample_ids=sample_ids, sample_loss_tokens=totals.per_sample.to(sample_ids.device)[sample_ids],
        step_loss_tokens=totals.loss_tokens, step_samples=totals.samples, max_tokens=max_tokens,
    )


def forward_loss(x: LossInputs, loss_fn: Loss, correction: Correction | None) -> tuple[torch.Tensor, dict[str, Any]]:
    """The loss of one forward, its tokens weighed by ``correction`` first when there is
    one, and the forward's metrics as token sums: the correction's, ``mismatch_kl`` (k3 = r -
    log r - 1, the KL between engine and trainer on the sampled tokens), the loss's."""
    metrics: dict[str, Any] = {}
    if correction is not None:
        weights, metrics = correction.weights(x)
        x = attrs.evolve(x, weights=weights.detach())
    loss, loss_metrics = loss_fn(x)
    with torch.no_grad():
        lr = torch.where(x.loss_mask, x.logprobs.detach() - x.inference_logprobs, torch.zeros_like(x.logprobs))
        metrics["mismatch_kl"] = (lr.exp() - lr - 1).sum()
    return loss, {**metrics, **loss_metrics}


class StepMetrics:
    """The step's figures, gathered over its forwards and then over ranks: the loss, the
    loss's and correction's metrics (token sums, or maxima for keys ending in ``/max``) and
    how often the trainer's routers agree with inference's (per MoE layer)."""

    def __init__(self) -> None:
        self.sums: dict[str, float] = {"loss": 0.0}  # token sums of the metrics, and the loss
        self.maxima: dict[str, float] = {}  # the metrics ending in /max
        self.agreed: torch.Tensor | None = None  # [L] tokens routed as inference did, per MoE layer
        self.routed_tokens = 0  # tokens the agreement was counted over

    def add(self, loss: torch.Tensor, metrics: dict[str, Any]) -> None:
        self.sums["loss"] += float(loss.detach())
        for key, value in metrics.items():
            if key.endswith("/max"):
                self.maxima[key] = max(self.maxima.get(key, float("-inf")), float(value))
            else:
                self.sums[key] = self.sums.get(key, 0.0) + float(value)

    def add_routing(self, own: torch.Tensor, inference: torch.Tensor, real: torch.Tensor) -> None:
        """own, inference: [k, m, L, top_k] experts; real: [k, m] bool."""
        agree = routing_agreement(own, inference, real)
        self.agreed = agree if self.agreed is None else self.agreed + agree
        self.routed_tokens += int(real.sum())

    def totals(self, parallelism: Parallelism, loss_tokens: float, grad_norm: float) -> dict[str, float]:
        """The step's stats for metrics.jsonl, added up over ranks: the sums (one collective,
        the routing counts with them) divided by the step's loss tokens, the maxima, the loss
        and the gradient norm, the routing agreement (its mean and each layer's)."""
        keys = sorted(self.sums)
        agreed = [] if self.agreed is None else self.agreed.tolist()
        vector = parallelism.sum_over_ranks(
            torch.tensor([self.sums[k] for k in keys] + [float(self.routed_tokens)] + agreed, dtype=torch.float64))
        totals = dict(zip(keys, vector[: len(keys)].tolist(), strict=True))
        stats = {k: v / loss_tokens for k, v in totals.items() if k != "loss"}
        if self.maxima:
            keys_max = sorted(self.maxima)
            stats.update(zip(keys_max, parallelism.max_over_ranks(
                torch.tensor([self.maxima[k] for k in keys_max], dtype=torch.float64)).tolist(), strict=True))
        stats.setdefault("mismatch_kl", 0.0)
        stats.setdefault("masked_fraction", 0.0)
        stats.update(loss=totals["loss"], grad_norm=grad_norm)
        routed = float(vector[len(keys)])
        if agreed and routed:
            per_layer = (vector[len(keys) + 1 :] / routed).tolist()
            stats["routing_agreement"] = sum(per_layer) / len(per_layer)
            stats.update({f"routing_agreement/layer_{i}": v for i, v in enumerate(per_layer)})
        return stats


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
    totals = StepTotals.of(packed)
    replay = t.router_replay and packed.replay_experts is not None
    optimizer.zero_grad(set_to_none=True)
    step_metrics = StepMetrics()
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
            step_metrics.add_routing(out.router_experts, row["replay_experts"], real)
        x = loss_inputs(row, lp, mask, real, totals, max_tokens=cfg.orchestrator.max_tokens,
                        corrected=correction is not None)
        loss, metrics = forward_loss(x, loss_fn, correction)
        loss.backward()
        step_metrics.add(loss, metrics)
    grad_norm = parallelism.clip_grad_norm_(model, t.max_grad_norm)
    optimizer.step()
    balancer.step()
    return step_metrics.totals(parallelism, totals.loss_tokens, grad_norm)
