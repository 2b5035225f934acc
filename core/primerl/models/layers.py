"""Torch building blocks shared by the model plugins (norms, RoPE, MLPs, routers, experts).

Why here: GLM-5, Kimi K2 (DeepSeek-V3), Qwen3-MoE and Nemotron 3 share most of their
pieces (SwiGLU MLPs, fused 3D experts, sigmoid or softmax top-k routers, RMSNorm,
RoPE), and the properties primerl needs from them — routers that can replay the experts
inference chose while still passing gradients, experts that skip padding, maths that
follows HF op for op so logits agree with ``transformers`` to float rounding — are the
same for all. Each model plugin composes these into its own decoder (torchtitan style:
one folder per model, shared components in one place).

Parameter names match HF's (``gate_proj``/``up_proj``/``down_proj``, the router's
``weight`` and ``e_score_correction_bias``, the experts' fused ``gate_up_proj``), so HF
state dicts load by name.

Importing this module imports torch: only model code (never adapters) imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

# ---------------------------------------------------------------------------------------
# Norms, activations, RoPE
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, as HF does.

    ``weight_in_fp32``: multiply by the weight before casting back (Nemotron-H) rather
    than after (Llama, DeepSeek, Qwen, GLM). Identical in float32; they round differently
    in bf16, and matching HF's order keeps engine and HF logits equal.
    """

    def __init__(self, dim: int, eps: float = 1e-6, *, weight_in_fp32: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.weight_in_fp32 = weight_in_fp32

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:  # one call; same numbers as below
            if FUSED_RMS_NORM and x.device.type == "cpu" and torch.is_grad_enabled():
                return _RMSNormCPU.apply(x, self.weight, self.eps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x * rsqrt(mean(x^2) + eps)
        if self.weight_in_fp32:
            return (self.weight.float() * normed).to(x.dtype)
        return self.weight * normed.to(x.dtype)


# torch's one-kernel RMSNorm forward (``aten::_fused_rms_norm``). Under autograd on the CPU
# ``F.rms_norm`` runs as six ops forward and about fifteen backward (the fused kernel has
# no CPU backward); without autograd it is one kernel already.
FUSED_RMS_NORM = hasattr(torch.ops.aten, "_fused_rms_norm")


class _RMSNormCPU(torch.autograd.Function):
    """``F.rms_norm(x, (D,), w, eps)`` in float32 on the CPU: the forward is torch's fused
    kernel (the same numbers as ``F.rms_norm``), the backward written out in a few ops:
    with r = rsqrt(mean(x^2) + eps), xhat = x r and g = dy w,
    dx = r (g - xhat mean(g xhat)) and dw = sum over tokens of dy xhat."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, eps: float) -> Tensor:
        y, rstd = torch.ops.aten._fused_rms_norm(x, [x.shape[-1]], w, eps)  # [..., D], [..., 1]
        ctx.save_for_backward(x, w, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        x, w, rstd = ctx.saved_tensors
        xhat = x * rstd  # [..., D]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            g = dy * w
            dx = (g - xhat * (g * xhat).mean(-1, keepdim=True)) * rstd
        if ctx.needs_input_grad[1]:
            dw = (dy * xhat).reshape(-1, x.shape[-1]).sum(0)  # [D]
        return dx, dw, None


def without_autocast(device_type: str) -> AbstractContextManager:
    """A region a bf16 trainer's ``torch.autocast`` must not reach (the routers, the head):
    autocast turned off there; nothing at all when it is not on (decode steps pay nothing)."""
    return torch.autocast(device_type, enabled=False) if torch.is_autocast_enabled(device_type) else nullcontext()


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU (Nemotron-H's MLP activation)."""
    return torch.square(F.relu(x))


ACTIVATIONS = {"silu": F.silu, "relu2": relu2}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; choose one of {', '.join(ACTIVATIONS)}") from None


def rope_rotation(cos: Tensor, sin: Tensor) -> Tensor:
    """``cos + i sin`` in complex64: the per-pair rotation :func:`rope_interleaved` applies,
    built once per forward (``DecoderLM.prepare``) for all the layers."""
    return torch.complex(cos.float(), sin.float())


def rope_interleaved(x: Tensor, rot: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3)... of the last dim: pair j by ``rot[..., j]``.

    x: [..., D]; rot: complex, broadcastable to [..., D/2] (:func:`rope_rotation`). Returns
    [..., D] with the pairs still interleaved, where HF's ``apply_rotary_pos_emb_interleave``
    de-interleaves them (evens, then odds). Queries and keys are permuted alike, so every
    q.k is the same sum in another order; keeping the layout spares a copy per call.
    """
    # (x0 + i x1) * (cos + i sin) on complex pairs, in float32 (bf16 inputs round once, at the end)
    pairs = x.float().unflatten(-1, (-1, 2))  # [..., D/2, 2]
    # view_as_complex needs whole complex numbers in place (traced by torch.compile: always
    # copied, as dynamo cannot read the storage offset)
    if torch.compiler.is_compiling() or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    return torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2).to(x.dtype)


def rope_halves(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate (x_i, x_{i+D/2}) pairs: HF's ``x * cos + rotate_half(x) * sin`` (Llama, Qwen).

    x: [..., D]; cos, sin: broadcastable to [..., D/2].
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """An HF config's RoPE parameters in the v5 shape (``rope_parameters`` with ``rope_theta``),
    accepting the older ``rope_scaling`` + top-level ``rope_theta``."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_type", rope.pop("type", "default"))
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    return rope


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq(dim: int, rope: Mapping[str, Any], max_position_embeddings: int) -> tuple[Tensor, float]:
    """(inverse frequencies [dim/2], factor on cos/sin) for ``default``, ``linear``, ``llama3``
    and ``yarn`` RoPE.

    ``linear`` divides every frequency by ``factor``. ``llama3`` (Llama 3.1's long context)
    follows HF's ``_compute_llama3_parameters``: wavelengths beyond the original context /
    ``low_freq_factor`` are interpolated by ``factor``, those below it / ``high_freq_factor``
    kept, with a smooth ramp between. YaRN (Kimi K2 / DeepSeek-V3's long-context RoPE)
    follows HF's ``_compute_yarn_parameters``: low frequencies are interpolated by
    ``factor``, high ones kept, with a linear ramp between the ``beta_fast``/``beta_slow``
    correction dims.
    """
    base = float(rope["rope_theta"])
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)  # not on "meta"
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind == "linear":
        return 1.0 / pos_freqs / float(rope["factor"]), 1.0
    if kind == "llama3":
        return llama3_inv_freq(1.0 / pos_freqs, rope), 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r} is not supported (default, linear, llama3, yarn)")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (high frequency), 0: interpolate
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv_freq, float(attention_factor)


def llama3_inv_freq(inv_freq: Tensor, rope: Mapping[str, Any]) -> Tensor:
    """Llama 3's frequency scaling of ``inv_freq`` [dim/2] (HF's ``rope_type = "llama3"``)."""
    factor, low, high = float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"])
    context = float(rope["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return torch.where(medium, smoothed, scaled)


def rope_angles(positions: Tensor, inv_freq: Tensor, factor: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [B, S, D/2] of positions [B, S] (scaled by YaRN's attention factor)."""
    angles = positions[..., None].float() * inv_freq.to(positions.device)  # [B, S, D/2]
    return (angles.cos() * factor).to(dtype), (angles.sin() * factor).to(dtype)


# ---------------------------------------------------------------------------------------
# Feed-forward
# ---------------------------------------------------------------------------------------


class MLP(nn.Module):
    """Feed-forward: SwiGLU ``down(act(gate(x)) * up(x))``, or plain ``down(act(up(x)))``
    when ``gated=False`` (Nemotron-H's relu2 MLP)."""

    def __init__(self, hidden: int, intermediate: int, *, act: str = "silu", gated: bool = True,
                 bias: bool = False) -> None:
        super().__init__()
        self.gated = gated
        self.act = activation(act)
        if gated:
            self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        if self.gated:
            return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
        return self.down_proj(self.act(self.up_proj(x)))


# ---------------------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------------------


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
        if owns_bias:
            self.e_score_correction_bias = nn.Buffer(torch.zeros(n_experts, dtype=torch.float32))

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

    def __init__(self, hidden: int, n_experts: int, top_k: int, *, norm_topk_prob: bool = True) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.norm_topk_prob = n_experts, top_k, norm_topk_prob
        self.weight = nn.Parameter(torch.zeros(n_experts, hidden))

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
    def in_proj(self) -> Tensor:
        return self.gate_up_proj if self.gated else self.up_proj

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


def keeps_derived(*sources: Tensor) -> bool:
    """Whether :func:`derived` may keep a tensor built from ``sources`` between calls: not
    with autograd on (gradients must flow to the sources), not for inference tensors (they
    have no version to notice an update by), not while ``torch.compile`` traces (dynamo
    cannot read versions; the graph rebuilds the tensor instead)."""
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or any(t.is_inference() for t in sources))


def derived(owner: nn.Module, name: str, build: Callable[[], Tensor], *sources: Tensor) -> Tensor:
    """A tensor computed from weights (stacked, concatenated) by ``build``. Rebuilt every
    call unless :func:`keeps_derived` (decode steps): then kept on ``owner`` until a source
    changes: a weight update writes in place, which bumps the tensor's version, or swaps
    its storage."""
    if not keeps_derived(*sources):
        return build()
    key = tuple((t.data_ptr(), t._version, t.dtype) for t in sources)
    cache = owner.__dict__.setdefault("_derived", {})
    if name not in cache or cache[name][0] != key:
        cache[name] = (key, build())
    return cache[name][1]


# Use the dense path when E / top_k is at most this and the tokens per expert (on
# average) at most DENSE_EXPERTS_MAX_TOKENS (see Experts._dense; measured on CPU: the
# sparse loop wins from about 64 tokens per expert, 2.2x faster forward + backward at 256).
# Without autograd, where the grouped GEMM replaces the loop, at most
# DENSE_GROUPED_MAX_TOKENS instead (measured on CPU, 8 experts, top-2: dense 141 us vs
# grouped 173 us at 4 tokens per expert, 342 vs 247 at 16, 1843 vs 626 at 64): decode
# steps of a full batch. With autograd the rule is the same for every subclass (FP8
# training computes the loop's GEMMs itself and makes the same choice).
DENSE_EXPERTS_MAX_RATIO = 8
DENSE_EXPERTS_MAX_TOKENS = 64
DENSE_GROUPED_MAX_TOKENS = 8

# torch's grouped GEMM (``torch._grouped_mm``; forward and backward run on the CPU in torch 2.13):
# Experts.forward uses it on the CPU instead of a loop over experts (Experts._grouped).
GROUPED_MM = hasattr(torch, "_grouped_mm")


class DeepSeekMoE(nn.Module):
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


def cast_(model: nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Cast floating tensors to ``dtype`` in place, keeping names ending in ``keep_fp32``
    in float32."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if keep_fp32 and name.endswith(keep_fp32) else dtype)
    return model


@torch.no_grad()
def init_normal_(model: nn.Module, seed: int, std: float, *, skip: tuple[nn.Module, ...] = ()) -> None:
    """HF-style init, reproducible: every tensor drawn on the CPU from one generator seeded
    with ``seed``, in module order, so the same seed gives bit-identical weights on any
    device and in any process. normal(0, std) for linears, embeddings, experts and routers;
    ones for norm weights; zeros for biases and the routers' correction bias. Modules in
    ``skip`` (a tied lm_head) are left alone; modules with an ``init_weights_(normal_)``
    method initialise themselves."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(p: Tensor) -> None:
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    for module in model.modules():
        if any(module is s for s in skip):
            continue
        if hasattr(module, "init_weights_"):
            module.init_weights_(normal_)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Linear):
            normal_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight)
        elif isinstance(module, (SigmoidRouter, SoftmaxRouter)):
            normal_(module.weight)
            if isinstance(module, SigmoidRouter) and hasattr(module, "e_score_correction_bias"):
                module.e_score_correction_bias.zero_()
        elif isinstance(module, Experts):
            normal_(module.in_proj)
            normal_(module.down_proj)
