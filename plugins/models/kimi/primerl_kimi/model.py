"""Kimi K2 (HF ``deepseek_v3`` architecture) in plain torch, with primerl's ragged forward.

What this is: our implementation of ``transformers.models.deepseek_v3`` as Kimi K2 uses
it. Parameter names and shapes are those of ``DeepseekV3ForCausalLM.state_dict()`` and
the maths follows HF op for op, so logits agree with HF to float32 rounding. The ragged
forward (packed rows, slot cache, router replay) is :class:`primerl_blocks.decoder.DecoderLM`;
the attention is :mod:`primerl_blocks.mla`; norms are :mod:`primerl_blocks.layers`, the
router and MoE block :mod:`primerl_blocks.moe`, the experts :mod:`primerl.models.experts`.

One decoder layer (x: [B, S, hidden])::

    h = x + MLA(RMSNorm(x))            # latent KV cache, YaRN RoPE on a 64-dim slice
    y = h + MLP-or-MoE(RMSNorm(h))     # dense MLP in the first layer(s), MoE after

YaRN: Kimi K2 extends a 4k-trained RoPE 32x. Low frequencies are interpolated, cos/sin
scaled by YaRN's attention factor (1.0 for Kimi, whose mscale == mscale_all_dim), and the
softmax scale multiplied by mscale_all_dim's factor squared, as HF does.

MoE (Kimi K2: 384 routed experts, top-8, one shared expert): sigmoid scores, choice by
top-k of score + e_score_correction_bias, weights from the bias-free scores,
renormalised and scaled by ``routed_scaling_factor``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from primerl_blocks.decoder import DecoderLM, PreNormLayer
from primerl_blocks.layers import MLP, RMSNorm, rope_inv_freq, rope_parameters, yarn_mscale
from primerl_blocks.mla import MLAttention, mla_cache_layout
from primerl_blocks.moe import FP32_SUFFIXES, DeepSeekMoE
from torch import nn

from primerl.models.batch import LayerCache
from primerl_kimi.presets import moe_layer_flags


@dataclass(frozen=True)
class KimiConfig:
    """The fields of an HF ``deepseek_v3`` / ``kimi_k2`` config.json that the model uses."""

    vocab_size: int = 163840
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    first_k_dense_replace: int = 1
    num_attention_heads: int = 64
    q_lora_rank: int | None = 1536
    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_routed_experts: int = 384
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.827
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rope_interleave: bool = True
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope: Mapping[str, Any] | None = None  # rope_parameters (rope_type, rope_theta, YaRN fields)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if i >= self.first_k_dense_replace]

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Kimi K2 uses silu)")
        if self.n_routed_experts > torch.iinfo(torch.int16).max:
            raise ValueError("routed expert ids are returned as int16")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> KimiConfig:
        names = {f.name for f in fields(cls)} - {"rope", "first_k_dense_replace"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        if "q_lora_rank" in hf:
            kwargs["q_lora_rank"] = hf["q_lora_rank"]  # None is meaningful: no query LoRA
        if hf.get("num_key_value_heads", hf.get("num_attention_heads")) != hf.get("num_attention_heads"):
            raise ValueError("MLA expands keys and values per query head: num_key_value_heads must equal heads")
        flags = moe_layer_flags(dict(hf))
        kwargs["first_k_dense_replace"] = flags.index(True) if True in flags else len(flags)
        kwargs["rope"] = rope_parameters(hf)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        """The HF config.json fields this config determines (token ids are not among them)."""
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf["rope_parameters"] = dict(hf.pop("rope") or {"rope_type": "default", "rope_theta": 10000.0})
        hf["num_key_value_heads"] = self.num_attention_heads
        hf.setdefault("model_type", "deepseek_v3")
        hf["architectures"] = ["DeepseekV3ForCausalLM"]
        return hf


class KimiModel(nn.Module):
    """The decoder stack (HF's ``model.`` prefix)."""

    def __init__(self, config: KimiConfig, scaling: float) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        c = config
        self.layers = nn.ModuleList(
            PreNormLayer(
                MLAttention(c, i, scaling=scaling, interleave=c.rope_interleave),
                DeepSeekMoE(c) if i in c.moe_layers else MLP(c.hidden_size, c.intermediate_size),
                is_moe=i in c.moe_layers, hidden=c.hidden_size, eps=c.rms_norm_eps,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class KimiForCausalLM(DecoderLM):
    """Kimi K2 with primerl's ragged forward (see :class:`primerl_blocks.decoder.DecoderLM`)."""

    Config = KimiConfig
    keep_fp32 = FP32_SUFFIXES  # routers stay float32, as in HF

    def __init__(self, config: KimiConfig) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope or {"rope_type": "default", "rope_theta": 10000.0})
        self.inv_freq, self.rope_factor = rope_inv_freq(config.qk_rope_head_dim, rope, config.max_position_embeddings)
        scaling = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            scaling *= yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2  # HF's yarn_apply_mscale
        self.model = KimiModel(config, scaling)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = config.moe_layers
        self.tie_weights()

    def cache_layout(self) -> list[LayerCache]:
        return [{"per_token": mla_cache_layout(self.config)} for _ in range(self.config.num_hidden_layers)]
