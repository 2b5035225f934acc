"""Torch building blocks shared by the model plugins: norms, RoPE, MLPs, the HF-style init.

Why here: GLM-5, Kimi K2 (DeepSeek-V3), Qwen3-MoE, MiniMax-M2, Nemotron 3, Qwen3 and
Llama share most of their pieces (SwiGLU MLPs, RMSNorm, RoPE), and what primerl needs from
them (maths that follows HF op for op, so logits agree with ``transformers`` to float
rounding) is the same for all. Each model plugin composes these into its own decoder
(torchtitan style: one folder per model, shared components in one place). Routers and MoE
blocks are :mod:`primerl_blocks.moe`; the routed experts themselves are the core's
(:mod:`primerl.models.experts`: the core's transforms act on them).

Parameter names match HF's (``gate_proj``/``up_proj``/``down_proj``, norms' ``weight``),
so HF state dicts load by name.

Importing this module imports torch: only model code (never adapters) imports it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.tensors import activation

__all__ = [
    "FUSED_RMS_NORM",
    "MLP",
    "InitsItself",
    "RMSNorm",
    "init_normal_",
    "llama3_inv_freq",
    "partial_rotation",
    "rope_angles",
    "rope_halves",
    "rope_interleaved",
    "rope_inv_freq",
    "rope_parameters",
    "rope_rotation",
    "without_autocast",
    "yarn_mscale",
]

# ---------------------------------------------------------------------------------------
# Norms, RoPE
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
    as_float = x.dtype == torch.float32
    pairs = (x if as_float else x.float()).unflatten(-1, (-1, 2))  # [..., D/2, 2]
    # view_as_complex needs whole complex numbers in place (traced by torch.compile: always
    # copied, as dynamo cannot read the storage offset)
    if torch.compiler.is_compiling() or pairs.storage_offset() % 2 or any(s % 2 for s in pairs.stride()[:-1]):
        pairs = pairs.contiguous()
    out = torch.view_as_real(torch.view_as_complex(pairs) * rot).flatten(-2)
    return out if as_float else out.to(x.dtype)


def partial_rotation(extra: dict[str, Any], *, before: int = 0, after: int = 0) -> Tensor:
    """``extra["rot"]`` ([B, S, rope/2] complex) with ``before`` pairs of exactly 1 ahead of
    it and ``after`` behind it, [B, S, before + rope/2 + after]: :func:`rope_interleaved`
    then rotates the rope dims of a wider row (an MLA cache row, latent first; a DSA
    indexer key, rope first) in one op, the other pairs unchanged bit for bit, with no
    slicing and concatenating around it. Built once per batch (kept in ``extra``) for
    every layer that asks."""
    key = f"rot_partial_{before}_{after}"
    if key not in extra:
        rot = extra["rot"]  # [B, S, rope/2]
        ones = [torch.ones(*rot.shape[:-1], n, dtype=rot.dtype, device=rot.device) for n in (before, after)]
        extra[key] = torch.cat([ones[0], rot, ones[1]], dim=-1)
    return extra[key]


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


# ---------------------------------------------------------------------------------------
# Init
# ---------------------------------------------------------------------------------------


@runtime_checkable
class InitsItself(Protocol):
    """A module that draws its own initial weights (routers, experts, Mamba-2's per-head
    parameters): :func:`init_normal_` hands it the one ``normal_`` every tensor is drawn by."""

    def init_weights_(self, normal_: Callable[[Tensor], None]) -> None: ...


@torch.no_grad()
def init_normal_(model: nn.Module, seed: int, std: float, *, skip: tuple[nn.Module, ...] = ()) -> None:
    """HF-style init, reproducible: every tensor drawn on the CPU from one generator seeded
    with ``seed``, in module order, so the same seed gives bit-identical weights on any
    device and in any process. normal(0, std) for linears and embeddings; ones for norm
    weights; zeros for biases. Modules in ``skip`` (a tied lm_head) are left alone;
    modules that are :class:`InitsItself` (routers, experts: normal(0, std), a router's
    correction bias at zero) initialise themselves."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def normal_(p: Tensor) -> None:
        p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

    for module in model.modules():
        if any(module is s for s in skip):
            continue
        if isinstance(module, InitsItself):
            module.init_weights_(normal_)
        elif isinstance(module, (RMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)
            if isinstance(module, nn.LayerNorm) and module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Linear):
            normal_(module.weight)
            if module.bias is not None:
                module.bias.zero_()
        elif isinstance(module, nn.Embedding):
            normal_(module.weight)
