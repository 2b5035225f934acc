"""GLM-5 (HF ``glm_moe_dsa``) in plain torch, with the packed/ragged forward primerl needs.

What this is: our own implementation of the architecture of
``transformers.models.glm_moe_dsa.modeling_glm_moe_dsa`` (GLM-5): DeepSeek-V3 style
Multi-head Latent Attention, DeepSeek Sparse Attention (DSA) with GLM's cross-layer
top-k sharing, and a sigmoid-routed mixture of experts with a shared expert. Parameter
names and shapes are exactly those of ``GlmMoeDsaForCausalLM.state_dict()``, and the
maths follows HF op for op, so logits agree with HF to float32 rounding.

Why not just use the HF model: RL needs one forward that HF does not offer,

* ragged batches: each row has its own number of new tokens (``lengths``), right-padded;
* packed training rows: ``segment_ids`` keep several sequences in one row apart;
* a slot-indexed KV cache for continuous batching: in one call, some rows prefill a
  prompt while others decode one token, each at its own past length, and a prefix can be
  copied from slot to slot;
* router replay ("R3"): the trainer can force the experts the inference engine used,
  while the router still receives gradients through its scores;
* the expert ids every MoE layer picked, returned with the logits.

The architecture, one decoder layer (x: [B, S, hidden])::

    h = x + Attention(RMSNorm(x))      # MLA, keys restricted to the DSA top-k
    y = h + MLP-or-MoE(RMSNorm(h))     # dense MLP in the first layers, MoE after

MLA: queries go hidden -> q_lora_rank -> heads * (nope + rope). Keys and values share one
compressed latent (kv_lora_rank, RMS-normalised) plus one single-head rope key; the cache
stores only these two, and ``kv_b_proj`` expands the latent to per-head k_nope and v.
RoPE is "interleaved": pairs (x0, x1), (x2, x3)... rotate together, and the rotated halves
come out de-interleaved (the same permutation for q and k, so q.k is unchanged).

DSA: a light indexer (its own small multi-head q from the q latent, one shared key)
scores every visible key, sum_h w_h * relu(q_h . k); each query then attends only to its
``index_topk`` best keys. "shared" layers reuse the previous layer's selection. The
indexer is not trained here (HF runs it under no_grad too).

MoE: router scores are sigmoid(W x) in float32; experts are chosen by top-k of
score + e_score_correction_bias (within the top ``topk_group`` of ``n_group`` groups), but
weighted by the bias-free scores, renormalised and multiplied by ``routed_scaling_factor``.
A shared expert always runs. Tokens are grouped by expert and each expert hit runs one
matmul, which is fine on a CPU and for tests; expert parallelism belongs in a plugin.

Differences from HF: the embedding has no ``padding_idx`` (the pad token is also GLM's
eos, so it keeps its gradient); padding tokens skip the routed experts; attention runs
through ``scaled_dot_product_attention`` with a boolean mask; and the DSA top-k breaks
exact score ties in favour of the earlier key. HF's ``torch.topk`` breaks them
arbitrarily, and its pick depends on the padded length, whereas ours is the same whether
a token is scored in a packed row, a padded batch or one decode step at a time. Only
exact ties at the top-k boundary can make the two differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl_glm5.presets import layer_types

# ---------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Glm5Config:
    """The fields of an HF ``glm_moe_dsa`` config.json that the model uses.

    Defaults are transformers' ``GlmMoeDsaConfig`` defaults (GLM-5's sizes).
    """

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 78
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 192
    v_head_dim: int = 256
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    mlp_layer_types: tuple[str, ...] = field(default=())  # "dense" | "sparse" per layer
    indexer_types: tuple[str, ...] = field(default=())  # "full" | "shared" per layer

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.mlp_layer_types) if kind == "sparse"]

    def __post_init__(self) -> None:
        n = self.num_hidden_layers
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types must list 'dense'/'sparse' for each of {n} layers")
        if len(self.indexer_types) != n or set(self.indexer_types) - {"full", "shared"}:
            raise ValueError(f"indexer_types must list 'full'/'shared' for each of {n} layers")
        if n and self.indexer_types[0] != "full":
            raise ValueError("the first layer must run its own indexer ('full'): shared layers reuse it")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError(
                "MLA expands keys and values per query head: num_key_value_heads must equal heads"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (GLM-5 uses silu)")
        if self.n_routed_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(
                "n_routed_experts must split into n_group groups, with 0 < topk_group <= n_group"
            )
        if self.n_group > 1 and self.n_routed_experts // self.n_group < 2:
            raise ValueError("grouped routing scores each group by its two best experts: need >= 2 per group")
        if self.n_routed_experts > torch.iinfo(torch.int16).max:
            raise ValueError("routed expert ids are returned as int16")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Glm5Config:
        """Read an HF config dict, deriving the per-layer lists as ``GlmMoeDsaConfig`` does."""
        names = {f.name for f in fields(cls)} - {"mlp_layer_types", "indexer_types", "rope_theta"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}

        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_type {rope_type!r} is not supported (GLM-5 uses default RoPE)")
        kwargs["rope_theta"] = float(rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta)))

        mlp_types, indexer_types = layer_types(dict(hf))
        kwargs["mlp_layer_types"], kwargs["indexer_types"] = tuple(mlp_types), tuple(indexer_types)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json fields this config determines (token ids are not among them)."""
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf["rope_parameters"] = {"rope_theta": hf.pop("rope_theta"), "rope_type": "default"}
        hf["mlp_layer_types"], hf["indexer_types"] = list(self.mlp_layer_types), list(self.indexer_types)
        n_dense = next(
            (i for i, kind in enumerate(self.mlp_layer_types) if kind == "sparse"), self.num_hidden_layers
        )
        hf["first_k_dense_replace"] = n_dense  # read by loaders that ignore mlp_layer_types
        hf["qk_head_dim"], hf["head_dim"] = self.qk_head_dim, self.qk_rope_head_dim
        hf["model_type"], hf["architectures"] = "glm_moe_dsa", ["GlmMoeDsaForCausalLM"]
        return hf


class Glm5Output(NamedTuple):
    logits: Tensor  # [B, S, V] (logits_for="all") or [B, V] (logits_for="last")
    routed_experts: Tensor  # [B, S, n_moe_layers, top_k] int16: expert ids each MoE layer used


# ---------------------------------------------------------------------------------------
# KV cache
# ---------------------------------------------------------------------------------------


class KVCache:
    """Preallocated per-layer cache, indexed ``[slot, position, ...]``.

    Per layer it holds what MLA and DSA need to attend to past tokens:

    * ``latent[l]``  [num_slots, max_len, kv_lora_rank]: the RMS-normalised kv latent,
    * ``k_rot[l]``   [num_slots, max_len, qk_rope_head_dim]: the roped shared key,
    * ``index_k[l]`` [num_slots, max_len, index_head_dim]: the indexer key ("full" layers
      only; ``None`` on "shared" layers, which have no indexer).

    A slot is one sequence. The model writes a row's new tokens at positions
    ``past_lens[b] .. past_lens[b] + lengths[b] - 1`` of slot ``slots[b]``; the caller
    owns the bookkeeping of which slot is free and how long each one is. Tensors start at
    zero so that never-written positions are finite (they are always masked out).
    """

    def __init__(
        self, config: Glm5Config, num_slots: int, max_len: int, *, dtype: torch.dtype, device
    ) -> None:
        def alloc(dim: int) -> Tensor:
            return torch.zeros(num_slots, max_len, dim, dtype=dtype, device=device)

        self.num_slots, self.max_len = num_slots, max_len
        layers = range(config.num_hidden_layers)
        self.latent = [alloc(config.kv_lora_rank) for _ in layers]
        self.k_rot = [alloc(config.qk_rope_head_dim) for _ in layers]
        self.index_k = [
            alloc(config.index_head_dim) if config.indexer_types[i] == "full" else None for i in layers
        ]

    def tensors(self) -> list[Tensor]:
        return [t for t in (*self.latent, *self.k_rot, *self.index_k) if t is not None]

    @torch.no_grad()
    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first ``n`` cached positions of ``src_slot`` into ``dst_slot`` (prefix reuse)."""
        if not 0 <= n <= self.max_len:
            raise ValueError(f"prefix length {n} outside [0, {self.max_len}]")
        for t in self.tensors():
            t[dst_slot, :n] = t[src_slot, :n]


@dataclass
class _Batch:
    """What every layer needs about the batch, computed once per forward."""

    cos: Tensor  # [B, S, rope/2] rotary angles of the new tokens
    sin: Tensor  # [B, S, rope/2]
    visible: Tensor  # [B, S, T] bool: key j may be attended by query i (before DSA)
    cache: KVCache | None = None
    write_at: tuple[Tensor, ...] = ()  # (b, i, slot, pos) of every valid new token, [N] each
    read_at: tuple[Tensor, ...] = ()  # (slot, pos) of every key, [B, T] each

    def keys(self, new: Tensor, store: Tensor | None) -> Tensor:
        """Keys seen by the new tokens: ``new`` itself, or the cache after writing ``new`` into it.

        new: [B, S, D]; store: [num_slots, max_len, D]; returns [B, T, D].
        """
        if self.cache is None:
            return new
        b, i, slot, pos = self.write_at
        store[slot, pos] = new[b, i].to(store.dtype)
        slots, positions = self.read_at  # [B, T] each; every row reads positions 0..T-1
        return store[:, : positions.shape[1]].index_select(0, slots[:, 0]).to(new.dtype)  # row copies


# ---------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32, as HF computes it, in one fused op
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps).to(x.dtype)


def rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3)... of the last dim by the given angles.

    x: [..., D]; cos, sin: broadcastable to [..., D/2]. Returns [..., D] laid out as
    (rotated evens, rotated odds), HF's layout.
    """
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Indexer(nn.Module):
    """DSA indexer: picks, for each query, the ``index_topk`` keys it may attend to."""

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.n_heads, self.head_dim = config.index_n_heads, config.index_head_dim
        self.rope_dim, self.topk = config.qk_rope_head_dim, config.index_topk
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    @torch.no_grad()
    def forward(self, x: Tensor, q_latent: Tensor, batch: _Batch, store: Tensor | None) -> Tensor:
        """x: [B, S, hidden]; q_latent: [B, S, q_lora_rank]. Returns the DSA mask [B, S, T] bool."""
        B, S, _ = x.shape
        k = self.k_norm(self.wk(x))  # [B, S, D]
        k = torch.cat(
            [rope_interleaved(k[..., : self.rope_dim], batch.cos, batch.sin), k[..., self.rope_dim :]], -1
        )
        k = batch.keys(k, store)  # [B, T, D], written to the cache even when not scored below
        T = k.shape[1]
        if T <= self.topk:  # every key is in the top-k: DSA changes nothing
            return batch.visible

        q = self.wq_b(q_latent).view(B, S, self.n_heads, self.head_dim)  # [B, S, H, D]
        q_rot = rope_interleaved(q[..., : self.rope_dim], batch.cos[:, :, None], batch.sin[:, :, None])
        q = torch.cat([q_rot, q[..., self.rope_dim :]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5  # [B, S, H]

        # Score queries in chunks: the per-head scores are [B, chunk, H, T] float32.
        chunk = max(1, (1 << 26) // (B * self.n_heads * T))
        selected = torch.zeros(B, S, T, dtype=torch.bool, device=x.device)
        kt = k.float().transpose(1, 2).unsqueeze(1)  # [B, 1, D, T]
        for s in range(0, S, chunk):
            e = min(s + chunk, S)
            scores = F.relu(torch.matmul(q[:, s:e].float(), kt) * self.softmax_scale)  # [B, c, H, T]
            index_scores = torch.matmul(w[:, s:e, None], scores).squeeze(-2)  # [B, c, T]
            index_scores = index_scores.masked_fill(~batch.visible[:, s:e], float("-inf"))
            # Best keys first; equal scores in key order, so that the choice does not depend
            # on T (padding, cache length). torch.topk breaks ties arbitrarily.
            top = index_scores.sort(dim=-1, descending=True, stable=True).indices[..., : self.topk]
            selected[:, s:e].scatter_(-1, top, True)
        return selected & batch.visible


class Attention(nn.Module):
    """Multi-head latent attention restricted to the DSA selection."""

    def __init__(self, config: Glm5Config, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + self.rope_dim, bias=c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.scaling = c.qk_head_dim**-0.5
        self.indexer = Indexer(c) if c.indexer_types[layer_idx] == "full" else None

    def forward(self, x: Tensor, batch: _Batch, prev_mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """x: [B, S, hidden]. Returns the output [B, S, hidden] and this layer's DSA mask [B, S, T]."""
        B, S, _ = x.shape
        H, cache, L = self.n_heads, batch.cache, self.layer_idx

        q_latent = self.q_a_layernorm(self.q_a_proj(x))  # [B, S, q_lora]
        q = self.q_b_proj(q_latent).view(B, S, H, -1).transpose(1, 2)  # [B, H, S, nope+rope]
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = rope_interleaved(q_rot, batch.cos[:, None], batch.sin[:, None])

        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, S, kv_lora]
        k_rot = rope_interleaved(k_rot, batch.cos, batch.sin)  # [B, S, rope], one head shared by all
        latent = batch.keys(latent, cache.latent[L] if cache else None)  # [B, T, kv_lora]
        k_rot = batch.keys(k_rot, cache.k_rot[L] if cache else None)  # [B, T, rope]
        T = latent.shape[1]

        if self.indexer is not None:
            mask = self.indexer(x, q_latent, batch, cache.index_k[L] if cache else None)
        elif prev_mask is not None:
            mask = prev_mask
        else:
            raise ValueError("a 'shared' DSA layer needs the selection of a previous 'full' layer")

        if cache is not None and S == 1:
            out = self._absorbed(q_nope, q_rot, latent, k_rot, mask)  # decode: [B, H, 1, v]
        else:
            kv = self.kv_b_proj(latent).view(B, T, H, -1).transpose(1, 2)  # [B, H, T, nope+v]
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rot[:, None].expand(B, H, T, self.rope_dim)], dim=-1)  # [B, H, T, nope+rope]
            q = torch.cat([q_nope, q_rot], dim=-1)  # [B, H, S, nope+rope]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], scale=self.scaling)  # [B, H, S, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * self.v_dim)), mask

    def _absorbed(self, q_nope: Tensor, q_rot: Tensor, latent: Tensor, k_rot: Tensor, mask: Tensor) -> Tensor:
        """Attention in the latent space, for decode steps (DeepSeek's "weight absorption").

        Expanding every cached latent into per-head keys and values costs
        T * kv_lora * H * (nope + v) per step; folding ``kv_b_proj`` into the query and the
        output instead costs H * T * (kv_lora + rope). Same maths, different rounding.
        q_nope: [B, H, 1, nope]; q_rot: [B, H, 1, rope]; latent: [B, T, kv_lora];
        k_rot: [B, T, rope]; mask: [B, 1, T]. Returns [B, H, 1, v].
        """
        H = self.n_heads
        w = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, kv_lora], [H, v, kv_lora]
        # heads play the role of query rows, so every product is a plain bmm (no broadcast copies)
        q_lat = torch.matmul(q_nope.squeeze(2).transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, kv_lora]
        scores = torch.bmm(q_lat, latent.transpose(1, 2))  # [B, H, T]
        scores = scores + torch.bmm(q_rot.squeeze(2), k_rot.transpose(1, 2))
        scores = (scores * self.scaling).masked_fill(~mask, float("-inf"))  # mask [B, 1, T]
        probs = torch.softmax(scores.float(), dim=-1).to(latent.dtype)
        out_lat = torch.bmm(probs, latent)  # [B, H, kv_lora]
        out = torch.matmul(out_lat.transpose(0, 1), w_uv.transpose(1, 2))  # [H, B, v]
        return out.permute(1, 0, 2).unsqueeze(2)  # [B, H, 1, v]


class MLP(nn.Module):
    """SwiGLU feed-forward (the dense layers and the shared expert)."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores, bias-corrected group-limited top-k choice, bias-free weights."""

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.n_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob, self.scaling = config.norm_topk_prob, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, config.hidden_size, dtype=torch.float32))
        # Load-balancing bias (aux-loss-free): steers the choice only, never the weights.
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x: [N, hidden]; valid: [N] bool; replay: [N, top_k] expert ids to force, or None.

        Returns (weights [N, top_k] float32, expert ids [N, top_k] int64). Replayed ids
        apply to valid tokens; padding keeps the router's own choice.
        """
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [N, E]
        ids = self.choose(scores)
        if replay is not None:
            ids = torch.where(valid[:, None], replay.long(), ids)
        weights = scores.gather(1, ids)  # differentiable w.r.t. the router, replayed or not
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scaling, ids

    @torch.no_grad()
    def choose(self, scores: Tensor) -> Tensor:
        choice = scores + self.e_score_correction_bias  # [N, E]
        if self.topk_group < self.n_group:  # keep the experts of the best topk_group groups
            grouped = choice.view(-1, self.n_group, self.n_experts // self.n_group)  # [N, G, E/G]
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, G]
            best = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(
                ~keep.repeat_interleave(self.n_experts // self.n_group, dim=1), float("-inf")
            )
        return choice.topk(self.top_k, dim=-1, sorted=False).indices  # [N, top_k]


class Experts(nn.Module):
    """The routed experts' weights as 3D tensors (HF's fused layout)."""

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        E, H, I = config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))  # [E, gate;up, hidden]
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """x: [N, hidden]; ids, weights: [N, top_k]; valid: [N] bool. Returns [N, hidden].

        Token-expert pairs are sorted by expert; each expert hit runs once on its tokens.
        Each token sums its experts in increasing expert order, as HF does.
        """
        E = self.gate_up_proj.shape[0]
        if E <= DENSE_EXPERTS_MAX_RATIO * ids.shape[1]:
            return self._dense(x, ids, weights, valid)
        out = torch.zeros_like(x)
        tok, slot = valid[:, None].expand_as(ids).nonzero(as_tuple=True)  # pairs of valid tokens
        expert = ids[tok, slot]
        order = expert.argsort(stable=True)
        tok, slot, expert = tok[order], slot[order], expert[order]
        counts = torch.bincount(expert, minlength=self.gate_up_proj.shape[0]).tolist()
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            t, s = tok[start : start + n], slot[start : start + n]
            start += n
            gate, up = F.linear(x[t], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * weights[t, s, None]
            out.index_add_(0, t, y.to(out.dtype))
        return out


    def _dense(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """Every expert on every token, then a routing-weighted sum (zero for unchosen experts).

        With few experts per choice (E <= 8 * top_k: small presets) three large matmuls beat
        a loop of 3 * E small ones, on CPU by far; the result is the same up to rounding.
        x: [N, hidden]; ids, weights: [N, top_k]; valid: [N]. Returns [N, hidden].
        """
        E, two_i, H = self.gate_up_proj.shape
        N = x.shape[0]
        combine = torch.zeros(N, E, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        combine = combine * valid[:, None]  # [N, E]
        gate, up = (x @ self.gate_up_proj.reshape(E * two_i, H).t()).view(N, E, two_i).chunk(2, dim=-1)
        h = (F.silu(gate) * up).transpose(0, 1)  # [E, N, I]
        y = torch.bmm(h, self.down_proj.transpose(1, 2))  # [E, N, hidden]
        return (y * combine.t()[:, :, None].to(y.dtype)).sum(0)


# Use the dense path when E / top_k is at most this (see Experts._dense).
DENSE_EXPERTS_MAX_RATIO = 8


class MoE(nn.Module):
    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.experts = Experts(config)
        self.gate = Router(config)
        self.shared_experts = MLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts)

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None) -> tuple[Tensor, Tensor]:
        """x: [N, hidden]; valid: [N] bool; replay: [N, top_k] or None. Returns (out, ids [N, top_k])."""
        weights, ids = self.gate(x, valid, replay)
        return self.experts(x, ids, weights, valid) + self.shared_experts(x), ids


class DecoderLayer(nn.Module):
    def __init__(self, config: Glm5Config, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_idx)
        self.is_moe = config.mlp_layer_types[layer_idx] == "sparse"
        self.mlp = MoE(config) if self.is_moe else MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, x: Tensor, batch: _Batch, valid: Tensor, prev_mask: Tensor | None, replay: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """x: [B, S, hidden]; valid: [B*S]. Returns (x, DSA mask, expert ids [B*S, top_k] or None)."""
        attn, mask = self.self_attn(self.input_layernorm(x), batch, prev_mask)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), mask, None
        y, ids = self.mlp(h.flatten(0, 1), valid, replay)
        return x + y.view_as(x), mask, ids


class Glm5Model(nn.Module):
    """The decoder stack (HF's ``model.`` prefix)."""

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


# ---------------------------------------------------------------------------------------
# The causal LM
# ---------------------------------------------------------------------------------------

# Kept in float32 whatever the model dtype (HF's _keep_in_fp32_modules_strict): routing is
# decided in float32, and a bf16 router weight would flip near-tied expert choices.
FP32_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")


class Glm5ForCausalLM(nn.Module):
    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.config = config
        self.model = Glm5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = config.moe_layers
        self.tie_weights()

    # -- weights ---------------------------------------------------------------------

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.no_grad()
    def init_weights(self, seed: int) -> None:
        """HF's init, reproducible: every tensor is drawn on the CPU from one generator
        seeded with ``seed``, in module order, so the same seed gives bit-identical
        weights on any device and in any process. normal(0, initializer_range) for
        linears, embeddings, experts and the router; ones for norm weights; zeros for
        norm biases and the router's correction bias."""
        gen = torch.Generator(device="cpu").manual_seed(seed)
        std = self.config.initializer_range

        def normal_(p: Tensor) -> None:
            p.copy_(torch.empty(p.shape, dtype=torch.float32).normal_(0.0, std, generator=gen))

        for module in self.modules():
            if isinstance(module, (RMSNorm, nn.LayerNorm)):
                module.weight.fill_(1.0)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Linear):
                if module is self.lm_head and self.config.tie_word_embeddings:
                    continue
                normal_(module.weight)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                normal_(module.weight)
            elif isinstance(module, Router):
                normal_(module.weight)
                module.e_score_correction_bias.zero_()
            elif isinstance(module, Experts):
                normal_(module.gate_up_proj)
                normal_(module.down_proj)

    def cast_(self, dtype: torch.dtype) -> Glm5ForCausalLM:
        """Cast floating tensors to ``dtype`` in place, keeping the router in float32 (as HF
        does for bf16/fp16) and, for fp16, the indexer's head weights too."""
        keep = FP32_SUFFIXES + (("indexer.weights_proj.weight",) if dtype == torch.float16 else ())
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if t.is_floating_point():
                t.data = t.data.to(torch.float32 if name.endswith(keep) else dtype)
        return self

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> KVCache:
        """An empty cache of ``num_slots`` sequences of up to ``max_len`` tokens each."""
        return KVCache(self.config, num_slots, max_len, dtype=dtype or self.dtype, device=self.device)

    # -- forward ---------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        lengths: Tensor,
        *,
        segment_ids: Tensor | None = None,
        cache: KVCache | None = None,
        slots: Tensor | None = None,
        past_lens: Tensor | None = None,
        replay_experts: Tensor | None = None,
        logits_for: str = "all",
    ) -> Glm5Output:
        """One forward over a right-padded batch of new tokens.

        input_ids, positions: [B, S] long (positions drive RoPE only).
        lengths: [B] long, valid new tokens per row; tokens at i >= lengths[b] are padding.
        segment_ids: [B, S] long (no cache): packed rows; a token sees only earlier tokens
            of its own segment.
        cache, slots [B], past_lens [B]: row b's tokens are written to slot ``slots[b]`` at
            positions ``past_lens[b]...`` and attend to everything cached before them.
        replay_experts: [B, S, n_moe_layers, top_k] expert ids to force in each MoE layer
            (ignored at padding); weights still come from the router's own scores.
        logits_for: "all" -> logits [B, S, V]; "last" -> [B, V] at each row's last valid token.
        """
        B, S = input_ids.shape
        device = input_ids.device
        if logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all' or 'last', got {logits_for!r}")
        if replay_experts is not None and replay_experts.shape != (
            B,
            S,
            len(self.moe_layers),
            self.config.num_experts_per_tok,
        ):
            raise ValueError(
                f"replay_experts must be [B, S, {len(self.moe_layers)}, {self.config.num_experts_per_tok}]"
            )

        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        batch = self._batch(positions, lengths, segment_ids, cache, slots, past_lens, x.dtype)
        valid = (torch.arange(S, device=device) < lengths[:, None]).flatten()  # [B*S]

        mask, routed = None, []
        for layer in self.model.layers:
            replay = None
            if replay_experts is not None and layer.is_moe:
                replay = replay_experts[:, :, len(routed)].flatten(0, 1)  # [B*S, top_k]
            x, mask, ids = layer(x, batch, valid, mask, replay)
            if ids is not None:
                routed.append(ids.view(B, S, -1))

        if logits_for == "last":
            x = x[torch.arange(B, device=device), (lengths - 1).clamp(min=0)]  # [B, hidden]
        logits = self.lm_head(self.model.norm(x))
        if routed:
            routed_experts = torch.stack(routed, dim=2).to(torch.int16)
        else:
            routed_experts = torch.zeros(
                B, S, 0, self.config.num_experts_per_tok, dtype=torch.int16, device=device
            )
        return Glm5Output(logits, routed_experts)

    def _batch(self, positions, lengths, segment_ids, cache, slots, past_lens, dtype) -> _Batch:
        """RoPE angles, key visibility and cache addressing shared by all layers."""
        B, S = positions.shape
        device = positions.device
        c = self.config
        dim = c.qk_rope_head_dim
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float, device=device) / dim))
        angles = positions[..., None].float() * inv_freq  # [B, S, rope/2]
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)

        i = torch.arange(S, device=device)
        valid = i < lengths[:, None]  # [B, S]
        if cache is None:
            if slots is not None or past_lens is not None:
                raise ValueError("slots and past_lens need a cache")
            T = S
            j = i
            visible = (j[None, :] <= i[:, None]).expand(B, S, T)  # causal
            if segment_ids is not None:
                visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
            batch = _Batch(cos, sin, visible)
        else:
            if slots is None or past_lens is None:
                raise ValueError("a cache needs slots and past_lens")
            if segment_ids is not None:
                raise ValueError("segment_ids (packed rows) cannot be combined with a cache")
            ends = past_lens + lengths
            T = int(ends.max())
            if T > cache.max_len:
                raise ValueError(f"sequence of {T} tokens does not fit the cache (max_len {cache.max_len})")
            j = torch.arange(T, device=device)
            visible = j[None, None, :] <= (past_lens[:, None] + i[None, :])[:, :, None]  # [B, S, T]
            b_idx, i_idx = valid.nonzero(as_tuple=True)
            write_at = (b_idx, i_idx, slots[b_idx], past_lens[b_idx] + i_idx)
            read_at = (slots[:, None].expand(B, T), j[None, :].expand(B, T))
            batch = _Batch(cos, sin, visible, cache, write_at, read_at)
        # Padding queries look at key 0 only: finite outputs, no all-masked softmax rows.
        batch.visible = torch.where(valid[:, :, None], batch.visible, j[None, None, :] == 0)
        return batch
