"""Routers and MoE blocks shared by the MoE model plugins.

What primerl needs from them, the same for every MoE family: routers that can replay the
experts inference chose (router replay, R3) while still receiving gradients through their
scores, the routers' own choice reported beside the one used (routing agreement), and
each MoE block declaring its parts (:meth:`MoEBlock.moe_plan`: router, routed experts,
correction bias) so that the model's :class:`~primerl.models.contract.ParallelPlan` names
them and nothing has to find them by attribute. The routed experts are the core's
:class:`~primerl.models.experts.Experts`.

Parameter names match HF's (the router's ``weight`` and ``e_score_correction_bias``, the
block's ``gate`` and ``experts``), so HF state dicts load by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.contract import MoEPlan
from primerl.models.experts import Experts
from primerl_blocks.layers import MLP, without_autocast

__all__ = ["FP32_SUFFIXES", "DeepSeekMoE", "MoEBlock", "Routing", "SigmoidRouter", "SoftmaxRouter"]


class Routing(NamedTuple):
    weights: Tensor  # [N, top_k] the combine weights of the used experts
    ids: Tensor  # [N, top_k] int64: the experts used (replayed ones when replaying)
    own_ids: Tensor  # [N, top_k] int64: the router's own choice (== ids without replay)


class SigmoidRouter(nn.Module):
    """DeepSeek-V3 / GLM-5 / Nemotron-H routing ("noaux_tc").

    Scores are sigmoid(W x) in float32; experts are chosen by top-k of
    score + e_score_correction_bias within the best ``topk_group`` of ``n_group``
    groups, but weighted by the bias-free scores, renormalised and scaled.
    """

    bias_name: str | None  # the correction bias buffer's name, None when the MoE block holds it

    def __init__(self, hidden: int, n_experts: int, top_k: int, *, n_group: int = 1, topk_group: int = 1,
                 norm_topk_prob: bool = True, scaling: float = 1.0, owns_bias: bool = True) -> None:
        """``owns_bias`` False: the correction bias is a buffer of the MoE block around the
        router (MiniMax-M2's ``mlp.e_score_correction_bias``), passed to :meth:`forward`."""
        super().__init__()
        if n_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError("n_routed_experts must split into n_group groups, with 0 < topk_group <= n_group")
        if n_group > 1 and n_experts // n_group < 2:
            raise ValueError("grouped routing scores each group by its two best experts: need >= 2 per group")
        self.n_experts, self.top_k = n_experts, top_k
        self.n_group, self.topk_group = n_group, topk_group
        self.norm_topk_prob, self.scaling = norm_topk_prob, scaling
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden, dtype=torch.float32))
        # Load-balancing bias (aux-loss-free): steers the choice only, never the weights.
        self.bias_name = "e_score_correction_bias" if owns_bias else None
        if owns_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(n_experts, dtype=torch.float32))

    def init_weights_(self, normal_: Callable[[Tensor], None]) -> None:
        """normal(0, std) weights, the correction bias at zero."""
        normal_(self.weight)
        if self.bias_name is not None:
            self.e_score_correction_bias.zero_()

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None = None, bias: Tensor | None = None) -> Routing:
        """x: [N, hidden]; valid: [N] bool; replay: [N, top_k] expert ids to force, or None;
        bias: [E] the block's correction bias (a router that does not own one).

        Replayed ids apply to valid tokens (padding keeps the router's own choice); the
        weights are gathered from the router's scores at the used ids, so the router keeps
        receiving gradients under replay.
        """
        with without_autocast(x.device.type):  # float32 under a bf16 trainer's autocast too
            scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        own = self.choose(scores, self.e_score_correction_bias if bias is None else bias)
        ids = own if replay is None else torch.where(valid[:, None], replay.long(), own)
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return Routing(weights * self.scaling, ids, own)

    @torch.no_grad()
    def choose(self, scores: Tensor, bias: Tensor) -> Tensor:
        choice = scores + bias  # [N, E]
        if self.topk_group < self.n_group:  # keep the experts of the best topk_group groups
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(self.n_experts // self.n_group, dim=1), float("-inf"))
        return choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, top_k]


class SoftmaxRouter(nn.Module):
    """Qwen3-MoE routing: softmax over W x, top-k, optionally renormalised.

    The logits are computed in the model's dtype and the softmax in float32, as HF does.
    """

    bias_name: str | None = None  # no correction bias

    def __init__(self, hidden: int, n_experts: int, top_k: int, *, norm_topk_prob: bool = True) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))

    def init_weights_(self, normal_: Callable[[Tensor], None]) -> None:
        normal_(self.weight)

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None = None) -> Routing:
        """As :meth:`SigmoidRouter.forward`; weights are the (renormalised) softmax probabilities."""
        probs = torch.softmax(F.linear(x, self.weight), dim=-1, dtype=torch.float)  # [N, E]
        with torch.no_grad():
            own = probs.topk(self.top_k, dim=-1).indices
        ids = own if replay is None else torch.where(valid[:, None], replay.long(), own)
        weights = probs.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Routing(weights.to(x.dtype), ids, own)


class MoEBlock(nn.Module):
    """Base of an MoE block: a router ``gate`` and routed ``experts`` (HF's names), declared
    to the model's plan by :meth:`moe_plan`. ``forward(x [N, hidden], valid [N], replay
    [N, top_k] | None) -> (out [N, hidden], Routing)``."""

    gate: SigmoidRouter | SoftmaxRouter
    experts: Experts
    # a correction bias of the block itself rather than of its router (MiniMax-M2's
    # ``mlp.e_score_correction_bias``): its buffer name
    block_bias: ClassVar[str | None] = None

    def moe_plan(self) -> MoEPlan:
        """The block's router, experts and correction bias, named from the block."""
        bias = self.block_bias or (f"gate.{self.gate.bias_name}" if self.gate.bias_name else None)
        return MoEPlan(router="gate", experts="experts", bias=bias)


class DeepSeekMoE(MoEBlock):
    """DeepSeek-V3's MoE block (also GLM-5's and Kimi K2's): SwiGLU routed experts chosen by
    a sigmoid router, plus ``n_shared_experts`` always-on experts as one wide MLP.

    ``config`` needs hidden_size, n_routed_experts, num_experts_per_tok,
    moe_intermediate_size, n_shared_experts, n_group, topk_group, norm_topk_prob and
    routed_scaling_factor (HF's names).
    """

    def __init__(self, config: Any) -> None:
        super().__init__()
        c = config
        self.experts = Experts(c.n_routed_experts, c.hidden_size, c.moe_intermediate_size)
        self.gate = SigmoidRouter(
            c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, n_group=c.n_group,
            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
        )
        self.shared_experts = MLP(c.hidden_size, c.moe_intermediate_size * c.n_shared_experts)

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None) -> tuple[Tensor, Routing]:
        """x: [N, hidden]; valid: [N] bool; replay: [N, top_k] or None."""
        routing = self.gate(x, valid, replay)
        return self.experts(x, routing.ids, routing.weights, valid) + self.shared_experts(x), routing


# Kept in float32 whatever the model dtype (HF's _keep_in_fp32_modules_strict for the
# sigmoid routers): routing is decided in float32, and a bf16 router weight would flip
# near-tied expert choices.
FP32_SUFFIXES = ("gate.weight", "gate.e_score_correction_bias")
