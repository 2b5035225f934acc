"""GLM-5 (HF ``glm_moe_dsa``) in plain torch, with the packed/ragged forward primerl needs.

What this is: our own implementation of the architecture of
``transformers.models.glm_moe_dsa.modeling_glm_moe_dsa`` (GLM-5): DeepSeek-V3 style
Multi-head Latent Attention, DeepSeek Sparse Attention (DSA) with GLM's cross-layer
top-k sharing, and a sigmoid-routed mixture of experts with a shared expert. Parameter
names and shapes are exactly those of ``GlmMoeDsaForCausalLM.state_dict()``, and the
maths follows HF op for op, so logits agree with HF to float32 rounding.

Why not just use the HF model: RL needs the ragged forward of
:mod:`primerl_blocks.decoder` (packed rows, a slot cache for continuous batching, router
replay, the routed experts of every token), which this class gets from ``DecoderLM``.
MLA itself is :mod:`primerl_blocks.mla` (shared with Kimi K2); norms are
:mod:`primerl_blocks.layers`, routers :mod:`primerl_blocks.moe`, the experts
:mod:`primerl.models.experts`.

The architecture, one decoder layer (x: [B, S, hidden])::

    h = x + Attention(RMSNorm(x))      # MLA, keys restricted to the DSA top-k
    y = h + MLP-or-MoE(RMSNorm(h))     # dense MLP in the first layers, MoE after

DSA: a light indexer (its own small multi-head q from the q latent, one shared key)
scores every visible key, sum_h w_h * relu(q_h . k); each query then attends only to its
``index_topk`` best keys. "shared" layers reuse the previous layer's selection. The
indexer is not trained here (HF runs it under no_grad too).

MoE: router scores are sigmoid(W x) in float32; experts are chosen by top-k of
score + e_score_correction_bias (within the top ``topk_group`` of ``n_group`` groups), but
weighted by the bias-free scores, renormalised and multiplied by ``routed_scaling_factor``.
A shared expert always runs.

Differences from HF: the embedding has no ``padding_idx`` (the pad token is also GLM's
eos, so it keeps its gradient); padding tokens skip the routed experts; RoPE'd pairs stay
interleaved in queries and keys alike (same dot products); attention with a DSA
selection adds the mask as a bias and runs eagerly, as HF's eager path does, and without
one uses ``scaled_dot_product_attention``; and the DSA top-k breaks
exact score ties in favour of the earlier key. HF's ``torch.topk`` breaks them
arbitrarily, and its pick depends on the padded length, whereas ours is the same whether
a token is scored in a packed row, a padded batch or one decode step at a time. Only
exact ties at the top-k boundary can make the two differ.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch
from primerl_blocks.decoder import DecoderLM, PreNormLayer
from primerl_blocks.layers import MLP, RMSNorm, partial_rotation, rope_interleaved, rope_inv_freq, rope_parameters
from primerl_blocks.mla import MLAttention, mla_cache_layout
from primerl_blocks.moe import FP32_SUFFIXES, DeepSeekMoE
from torch import Tensor, nn

from primerl.models.batch import Batch, LayerCache
from primerl.models.contract import Mixer
from primerl.models.tensors import cast_
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
        if self.n_routed_experts > torch.iinfo(torch.int16).max:
            raise ValueError("routed expert ids are returned as int16")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Glm5Config:
        """Read an HF config dict, deriving the per-layer lists as ``GlmMoeDsaConfig`` does."""
        names = {f.name for f in fields(cls)} - {"mlp_layer_types", "indexer_types", "rope_theta"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}

        rope = rope_parameters(hf)
        if rope["rope_type"] != "default":
            raise ValueError(f"rope_type {rope['rope_type']!r} is not supported (GLM-5 uses default RoPE)")
        kwargs["rope_theta"] = float(rope["rope_theta"])

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



# ---------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------


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
    def forward(self, x: Tensor, q_latent: Tensor, batch: Batch, layer: int) -> Tensor:
        """x: [B, S, hidden]; q_latent: [B, S, q_lora_rank]. Returns the DSA mask [B, S, T] bool."""
        B, S, _ = x.shape
        # RoPE on the first rope_dim dims of the keys and queries, the rest unchanged: [B, S, D/2]
        rot = partial_rotation(batch.extra, after=(self.head_dim - self.rope_dim) // 2)
        k = rope_interleaved(self.k_norm(self.wk(x)), rot)  # [B, S, D]
        k = batch.keys(k, layer, "index_k")  # [B, T, D], written to the cache even when not scored below
        T = k.shape[1]
        # A query that sees at most topk keys keeps them all: only the queries from the first
        # one that sees more (in any row) on are scored. Exact, and on short sequences (RL
        # prompts and completions below GLM-5's 2048) it skips most or all of the indexer.
        # One query per row (a decode step) that sees more is the query of the row that
        # has T keys. (Traced by torch.compile every query is scored: where the first one
        # is depends on the data.)
        if T <= self.topk:
            return batch.visible
        s0 = 0
        if S > 1 and not torch.compiler.is_compiling():
            crowded = (batch.keys_seen() > self.topk).any(0).nonzero()  # [n, 1] query columns
            if crowded.numel() == 0:
                return batch.visible
            s0 = int(crowded[0, 0])
        if s0:
            x, q_latent, rot = x[:, s0:], q_latent[:, s0:], rot[:, s0:]
            S = S - s0

        q = self.wq_b(q_latent).view(B, S, self.n_heads, self.head_dim)
        q = rope_interleaved(q, rot[:, :, None])  # [B, S, H, D]
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.n_heads**-0.5  # [B, S, H]

        # Score queries in chunks of ~4 MB of per-head scores ([B, chunk, H, T] float32),
        # updated in place: on CPU, passes over fresh tensors of tens of MB are what cost.
        chunk = max(1, (1 << 20) // (B * self.n_heads * T))
        selected = [batch.visible[:, :s0]] if s0 else []
        kt = k.float().transpose(1, 2)  # [B, D, T]
        bias = batch.bias(batch.visible, torch.float32)  # [B, S, T]: -inf where not visible
        if s0:
            bias = bias[:, s0:]
        for s in range(0, S, chunk):
            e = min(s + chunk, S)
            c = e - s
            # one [B, c*H, D] x [B, D, T] product: broadcasting [B, c, H, D] against the keys
            # would copy them once per query
            scores = torch.bmm(q[:, s:e].float().reshape(B, c * self.n_heads, self.head_dim), kt)
            scores = scores.mul_(self.softmax_scale).relu_().view(B * c, self.n_heads, T)  # relu(q.k * scale)
            index_scores = torch.bmm(w[:, s:e].reshape(B * c, 1, self.n_heads), scores).view(B, c, T)
            index_scores += bias[:, s:e]
            selected.append(top_keys(index_scores, self.topk))
        return (selected[0] if len(selected) == 1 else torch.cat(selected, dim=1)) & batch.visible


def top_keys(scores: Tensor, k: int) -> Tensor:
    """The ``k`` best keys of each query, exact ties broken in favour of the earlier key:
    what a stable descending sort would pick, so that the choice does not depend on T
    (padding, cache length); ``torch.topk`` alone breaks ties arbitrarily.
    scores: [B, S, T] (-inf for keys not visible). Returns [B, S, T] bool, k per row."""
    kth = scores.topk(k, dim=-1, sorted=False).values.amin(-1, keepdim=True)  # [B, S, 1]: the k-th best score
    above, tied = scores > kth, scores == kth
    room = k - above.sum(dim=-1, keepdim=True)  # tied keys that still fit, earliest first
    return above | (tied & (tied.cumsum(dim=-1) <= room))


class Attention(MLAttention):
    """MLA whose keys are restricted to the DSA top-k; "shared" layers reuse the previous
    layer's selection (passed along as the layer carry)."""

    mixer_kind = Mixer.MLA_DSA

    def __init__(self, config: Glm5Config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.indexer = Indexer(config) if config.indexer_types[layer_idx] == "full" else None

    def select(self, x: Tensor, q_latent: Tensor | None, batch: Batch, carry: Any) -> tuple[Tensor, Any]:
        if self.indexer is not None:
            mask = self.indexer(x, q_latent, batch, self.layer_idx)
            return mask, mask
        if carry is None:
            raise ValueError("a 'shared' DSA layer needs the selection of a previous 'full' layer")
        return carry, carry


class Glm5Model(nn.Module):
    """The decoder stack (HF's ``model.`` prefix)."""

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            PreNormLayer(
                Attention(config, i),
                DeepSeekMoE(config) if is_moe else MLP(config.hidden_size, config.intermediate_size),
                is_moe=is_moe, hidden=config.hidden_size, eps=config.rms_norm_eps,
            )
            for i, is_moe in enumerate(kind == "sparse" for kind in config.mlp_layer_types)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Glm5ForCausalLM(DecoderLM):
    """GLM-5 with primerl's ragged forward (see :class:`primerl_blocks.decoder.DecoderLM`)."""

    Config = Glm5Config
    keep_fp32 = FP32_SUFFIXES

    def __init__(self, config: Glm5Config) -> None:
        super().__init__()
        self.config = config
        self.model = Glm5Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = config.moe_layers
        self.inv_freq, self.rope_factor = rope_inv_freq(
            config.qk_rope_head_dim, {"rope_theta": config.rope_theta}, config.max_position_embeddings
        )
        self.tie_weights()

    def cast_(self, dtype: torch.dtype) -> Glm5ForCausalLM:
        """Cast to ``dtype`` keeping the router in float32 (as HF does for bf16/fp16) and,
        for fp16, the indexer's head weights too."""
        keep = self.keep_fp32 + (("indexer.weights_proj.weight",) if dtype == torch.float16 else ())
        return cast_(self, dtype, keep)

    def cache_layout(self) -> list[LayerCache]:
        """Per layer: the MLA latent and rope key, plus the indexer key on "full" DSA layers."""
        c = self.config
        layout = []
        for kind in c.indexer_types:
            per_token = mla_cache_layout(c)
            if kind == "full":
                per_token["index_k"] = (c.index_head_dim,)
            layout.append({"per_token": per_token})
        return layout
