"""The routed experts of an MoE layer: their weights as 3D tensors, and their compute.

Why a module of its own, in the core: the core's transforms act on the experts as tensors
(FP8 training swaps in :class:`~primerl.models.fp8_matmul.Fp8Experts`, LoRA adds one
adapter per expert, expert parallel keeps each rank's slice of every ``[E, ...]`` tensor
and dispatches tokens to it), so what an experts module holds and computes is part of the
model contract: a model declares its experts modules in its
:class:`~primerl.models.contract.ParallelPlan` (``MoEPlan.experts``), and each is an
:class:`Experts` (or a subclass). Parameter names are HF's fused layout (``gate_up_proj``
[E, 2I, H], ``down_proj`` [E, H, I]), so HF state dicts load by name. Importing this
module imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.tensors import activation, derived

__all__ = [
    "DENSE_EXPERTS_MAX_RATIO",
    "DENSE_EXPERTS_MAX_TOKENS",
    "DENSE_GROUPED_MAX_TOKENS",
    "GROUPED_MM",
    "Experts",
]


class Experts(nn.Module):
    """The routed experts' weights as 3D tensors (HF's fused layout).

    gated: ``gate_up_proj`` [E, 2I, H] (gate rows first) and ``down_proj`` [E, H, I];
    not gated (Nemotron-H): ``up_proj`` [E, I, H] and ``down_proj`` [E, H, I].
    """

    def __init__(self, n_experts: int, hidden: int, intermediate: int, *, act: str = "silu",
                 gated: bool = True) -> None:
        super().__init__()
        self.gated, self.act = gated, activation(act)
        E, H, I = n_experts, hidden, intermediate  # noqa: E741 - the shapes read as in the papers
        if gated:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        else:
            self.up_proj = nn.Parameter(torch.empty(E, I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    @property
    def projections(self) -> tuple[str, str]:
        """The names of the two 3D weights: the in-projection, then ``down_proj``."""
        return ("gate_up_proj" if self.gated else "up_proj", "down_proj")

    @property
    def in_proj(self) -> Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

    def init_weights_(self, normal_: Callable[[Tensor], None]) -> None:
        """HF's init: both projections drawn by ``normal_`` (normal(0, std)), in-projection first."""
        normal_(self.in_proj)
        normal_(self.down_proj)

    def _hidden(self, h: Tensor) -> Tensor:
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            return self.act(gate) * up
        return self.act(h)

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """x: [N, hidden]; ids, weights: [N, top_k]; valid: [N] bool. Returns [N, hidden].

        Token-expert pairs are sorted by expert; each expert hit runs once on its tokens,
        and each token sums its experts in increasing expert order, as HF does. Padding
        tokens (``~valid``) skip the experts.
        """
        E, k = self.down_proj.shape[0], ids.shape[1]
        grouped = self._grouped_ok(x)
        per_expert = DENSE_EXPERTS_MAX_TOKENS
        if grouped and not torch.is_grad_enabled():  # decode steps: the grouped GEMM wins sooner
            per_expert = DENSE_GROUPED_MAX_TOKENS
        if E <= DENSE_EXPERTS_MAX_RATIO * k and x.shape[0] * k <= per_expert * E:
            return self._dense(x, ids, weights, valid)
        tok, slot = valid[:, None].expand_as(ids).nonzero(as_tuple=True)  # pairs of valid tokens
        expert = ids[tok, slot]
        order = expert.argsort(stable=True)
        tok, slot, expert = tok[order], slot[order], expert[order]  # [P] each, by expert
        counts = torch.bincount(expert, minlength=E)  # [E] pairs per expert
        if grouped:
            return self._grouped(x, tok, slot, counts, weights)
        out = torch.zeros_like(x)
        counts = counts.tolist()
        w_in = self.in_proj
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t, s = tok[start : start + n], slot[start : start + n]
            start += n
            y = self.linear(self._hidden(self.linear(x[t], w_in[e])), self.down_proj[e]) * weights[t, s, None]
            out.index_add_(0, t, y.to(out.dtype))
        return out

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """One expert's GEMM, ``x @ w.T`` (x: [n, in]; w: [out, in]); FP8 training overrides it."""
        return F.linear(x, w)

    def _grouped_ok(self, x: Tensor) -> bool:
        """Whether :meth:`_grouped` may replace the per-expert loop: torch has a grouped
        GEMM, on the CPU (where it runs one GEMM per group, as the loop does: the same
        numbers on this machine, and tests/models checks it against the dense path), and
        the per-expert GEMM is :meth:`linear`'s own (a subclass that overrides it, FP8
        training, keeps the loop that calls it)."""
        return (x.device.type == "cpu" and GROUPED_MM and x.shape[0] > 0
                and type(self).linear is Experts.linear)

    def _grouped(self, x: Tensor, tok: Tensor, slot: Tensor, counts: Tensor, weights: Tensor) -> Tensor:
        """The per-expert loop as two grouped GEMMs (``torch._grouped_mm``: one op over all
        experts, each on its own run of rows, no padding): on CPU the loop's cost is mostly
        per-op overhead, E times over, and each expert's weight gradient a full [E, ...]
        tensor (the backward of ``w[e]``); here it is a few ops whatever E.

        x: [N, hidden]; tok, slot: [P] the valid token-expert pairs sorted by expert (token
        order within an expert); counts: [E] pairs per expert; weights: [N, top_k].
        Returns [N, hidden], each token's experts summed in increasing expert order."""
        offs = counts.cumsum(0).to(torch.int32)  # [E] end of each expert's rows
        h = torch._grouped_mm(x[tok], self.in_proj.transpose(1, 2), offs=offs)  # [P, 2I] (gated) or [P, I]
        y = torch._grouped_mm(self._hidden(h), self.down_proj.transpose(1, 2), offs=offs)  # [P, hidden]
        y = y * weights[tok, slot, None]
        return torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))

    def _dense(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """Every expert on every token, each expert's hidden state scaled by its routing
        weight (zero for unchosen experts), then one matmul with all experts' down
        projections stacked: y = sum_e w_e * down_e(h_e) = [w_1 h_1, ..., w_E h_E] @ [down_1; ...; down_E].

        With few experts per choice (E <= 8 * top_k: small presets) and few tokens (decode
        steps: at most 64 per expert on average) two large matmuls beat a loop of 3 * E small
        ones, on CPU by far; with more tokens the E / top_k times larger compute costs more
        than the loop (training rows, prefill). The result is the same up to rounding.
        x: [N, hidden]; ids, weights: [N, top_k]; valid: [N]. Returns [N, hidden].
        """
        w_in = self.in_proj
        E, rows, H = w_in.shape
        N = x.shape[0]
        combine = torch.zeros(N, E, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        combine = (combine * valid[:, None]).to(x.dtype)  # [N, E]
        h = self._hidden((x @ w_in.reshape(E * rows, H).t()).view(N, E, rows))  # [N, E, I]
        h = (h * combine[:, :, None]).reshape(N, -1)  # [N, E * I]
        return h @ self._stacked_down()

    def _stacked_down(self) -> Tensor:
        """All experts' down projections stacked, [E * I, hidden]."""
        w = self.down_proj
        return derived(self, "down_stacked", lambda: w.transpose(1, 2).reshape(-1, w.shape[1]), w)


# Use the dense path when E / top_k is at most this and the tokens per expert (on
# average) at most DENSE_EXPERTS_MAX_TOKENS (see Experts._dense; measured on CPU: the
# sparse loop wins from about 64 tokens per expert, 2.2x faster forward + backward at 256).
# Without autograd, where the grouped GEMM replaces the loop, at most
# DENSE_GROUPED_MAX_TOKENS instead (measured on CPU, 8 experts, top-2, hidden 128, both
# cores: dense 140 us vs grouped 207 us at 8 tokens per expert, 198 vs 238 at 16, 281 vs
# 291 at 24, 305 vs 319 at 32; the grouped GEMM runs one small GEMM per expert): decode
# steps of a full batch. With autograd the rule is the same for every subclass (FP8
# training computes the loop's GEMMs itself and makes the same choice).
DENSE_EXPERTS_MAX_RATIO = 8
DENSE_EXPERTS_MAX_TOKENS = 64
DENSE_GROUPED_MAX_TOKENS = 16

# torch's grouped GEMM (``torch._grouped_mm``; forward and backward run on the CPU in torch 2.13):
# Experts.forward uses it on the CPU instead of a loop over experts (Experts._grouped).
GROUPED_MM = hasattr(torch, "_grouped_mm")
