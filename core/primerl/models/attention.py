"""Grouped-query attention (Qwen3-MoE, Nemotron-H) over primerl's ragged batch.

``num_key_value_heads`` key/value heads shared by groups of query heads; optional
per-head RMSNorm of q and k before RoPE (Qwen3's ``q_norm``/``k_norm``); RoPE on the
halves layout (HF's ``rotate_half``), or none at all (Nemotron-H's attention layers have
no positional encoding: the Mamba layers carry position). The cache stores k and v per
token, ``[num_slots, max_len, kv_heads, head_dim]`` each.

Names and shapes are HF's ``Qwen3MoeAttention`` / ``NemotronHAttention``.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.batch import Batch
from primerl.models.layers import RMSNorm, rope_halves


def gqa_cache_layout(kv_heads: int, head_dim: int) -> dict[str, tuple[int, ...]]:
    return {"k": (kv_heads, head_dim), "v": (kv_heads, head_dim)}


class GQAttention(nn.Module):
    """``forward(x, batch, carry) -> (out, carry)`` (the carry passes through). RoPE angles come from ``batch.extra["cos"/"sin"]``
    ([B, S, head_dim/2]) when ``rope`` is True."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, layer_idx: int, *,
                 rope: bool = True, qk_norm_eps: float | None = None, bias: bool = False) -> None:
        super().__init__()
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layer_idx, self.rope = layer_idx, rope
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=bias)
        if qk_norm_eps is not None:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps)
        self.scaling = head_dim**-0.5

    def forward(self, x: Tensor, batch: Batch, carry: Any = None) -> tuple[Tensor, Any]:
        """x: [B, S, hidden]. Returns ([B, S, hidden], carry)."""
        B, S, _ = x.shape
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        q = self.q_proj(x).view(B, S, H, D)
        k = self.k_proj(x).view(B, S, KV, D)
        v = self.v_proj(x).view(B, S, KV, D)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope:
            cos, sin = batch.extra["cos"][:, :, None], batch.extra["sin"][:, :, None]  # [B, S, 1, D/2]
            q, k = rope_halves(q, cos, sin), rope_halves(k, cos, sin)
        k = batch.keys(k, self.layer_idx, "k")  # [B, T, KV, D]
        v = batch.keys(v, self.layer_idx, "v")
        T = k.shape[1]
        # each kv head serves H/KV consecutive query heads (HF's repeat_kv)
        k = k.transpose(1, 2)[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
        v = v.transpose(1, 2)[:, :, None].expand(B, KV, H // KV, T, D).reshape(B, H, T, D)
        mask = None if batch.causal else batch.bias(batch.visible, q.dtype)[:, None]  # [B, 1, S, T] additive
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=mask, is_causal=batch.causal, scale=self.scaling
        )  # [B, H, S, D]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * D)), carry
