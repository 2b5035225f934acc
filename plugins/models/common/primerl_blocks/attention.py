"""Grouped-query attention (Qwen3, Qwen3-MoE, MiniMax-M2, Nemotron-H) over primerl's ragged batch.

``num_key_value_heads`` key/value heads shared by groups of query heads; optional RMSNorm
of q and k before RoPE, per head (Qwen3's ``q_norm``/``k_norm`` [head_dim]) or over the
whole projection (MiniMax-M2's, [heads * head_dim]); RoPE on the halves layout (HF's
``rotate_half``) over the first ``rotary_dim`` dims of each head (all of them, or half in
MiniMax-M2: the rest pass unrotated), or none at all (Nemotron-H's attention layers have
no positional encoding: the Mamba layers carry position). The cache stores k and v per
token, ``[num_slots, max_len, kv_heads, head_dim]`` each.

Names and shapes are HF's ``Qwen3MoeAttention`` / ``MiniMaxM2Attention`` / ``NemotronHAttention``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.batch import Batch
from primerl.models.contract import Mixer
from primerl_blocks.layers import RMSNorm, rope_halves

__all__ = ["GQAttention", "gqa_cache_layout"]


def gqa_cache_layout(kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    return {"k": (kv_heads, head_dim), "v": (kv_heads, head_dim)}


class GQAttention(nn.Module):
    """``forward(x, batch, carry) -> (out, carry)`` (the carry passes through). RoPE angles come
    from ``batch.extra["cos"/"sin"]`` ([B, S, rotary_dim/2]) when ``rope`` is True.
    ``qk_norm_eps`` adds the q/k RMSNorms, over each head (``qk_norm="head"``) or over the
    whole projection (``"layer"``)."""

    mixer_kind = Mixer.GQA

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, layer_idx: int, *,
                 rope: bool = True, qk_norm_eps: float | None = None, qk_norm: str = "head",
                 rotary_dim: int | None = None, bias: bool = False) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        if qk_norm not in ("head", "layer"):
            raise ValueError(f"qk_norm must be 'head' or 'layer', got {qk_norm!r}")
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 0 < self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim ({self.rotary_dim}) must be even and at most head_dim ({head_dim})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layer_idx, self.rope, self.qk_norm_over_layer = layer_idx, rope, qk_norm == "layer"
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        self.qk_normed = qk_norm_eps is not None
        if self.qk_normed:
            self.q_norm = RMSNorm(heads * head_dim if qk_norm == "layer" else head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(kv_heads * head_dim if qk_norm == "layer" else head_dim, qk_norm_eps)
        self.scaling = head_dim**-0.5

    def forward(self, x: Tensor, batch: Batch, carry: Any = None) -> tuple[Tensor, Any]:
        """x: [B, S, hidden]. Returns ([B, S, hidden], carry)."""
        B, S, _ = x.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        q, k = self.q_proj(x), self.k_proj(x)  # [B, S, H*D], [B, S, KV*D]
        normed = self.qk_normed
        if normed and self.qk_norm_over_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(B, S, H, D), k.view(B, S, KV, D)
        v = self.v_proj(x).view(B, S, KV, D)
        if normed and not self.qk_norm_over_layer:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = batch.extra["cos"][:, :, None], batch.extra["sin"][:, :, None]  # [B, S, 1, rotary_dim/2]
            if self.rotary_dim == D:
                q, k = rope_halves(q, cos, sin), rope_halves(k, cos, sin)
            else:  # partial RoPE: the first rotary_dim dims of each head rotate, the rest pass
                r = self.rotary_dim
                q = torch.cat([rope_halves(q[..., :r], cos, sin), q[..., r:]], dim=-1)
                k = torch.cat([rope_halves(k[..., :r], cos, sin), k[..., r:]], dim=-1)
        k = batch.keys(k, self.layer_idx, "k")  # [B, T, KV, D]
        v = batch.keys(v, self.layer_idx, "v")
        T = k.shape[1]
        mask = None if batch.causal else batch.bias(batch.visible, q.dtype)[:, None]  # [B, 1, S, T] additive
        # each kv head serves H/KV consecutive query heads (HF's repeat_kv). On the CPU the
        # kernel shares them itself (enable_gqa: the same outputs, without copying every
        # row's keys and values H/KV times, which cost more than the attention)
        if q.device.type == "cpu":
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, KV, T, D] views of the cache
        else:  # CUDA's memory-efficient kernel (masks) has no GQA: math would run instead
            k = k.transpose(1, 2)[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
            v = v.transpose(1, 2)[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, is_causal=batch.causal, scale=self.scaling,
            enable_gqa=k.shape[1] != H,
        )  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * D)), carry
