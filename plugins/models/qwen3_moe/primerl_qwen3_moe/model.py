"""Qwen3-MoE (HF ``qwen3_moe``) in plain torch, with primerl's ragged forward.

Parameter names and shapes are those of ``Qwen3MoeForCausalLM.state_dict()`` and the
maths follows HF op for op. One decoder layer (x: [B, S, hidden])::

    h = x + GQA(RMSNorm(x))            # q/k RMS-normalised per head, RoPE (halves layout)
    y = h + MoE-or-MLP(RMSNorm(h))     # softmax top-k over experts, no shared expert

Routing: softmax of the router logits (computed in the model dtype, softmaxed in
float32), top-k, renormalised when ``norm_topk_prob``. Under router replay the weights
are the router's probabilities at the replayed experts, renormalised the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from primerl_blocks.attention import GQAttention, gqa_cache_layout
from primerl_blocks.decoder import DecoderLM, PreNormLayer
from primerl_blocks.layers import MLP, RMSNorm, rope_inv_freq, rope_parameters
from primerl_blocks.moe import MoEBlock, Routing, SoftmaxRouter
from torch import Tensor, nn

from primerl.models.batch import LayerCache
from primerl.models.experts import Experts
from primerl_qwen3_moe.presets import moe_layer_flags, num_experts


@dataclass(frozen=True)
class Qwen3MoeConfig:
    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    moe_intermediate_size: int = 768
    num_hidden_layers: int = 48
    num_attention_heads: int = 32
    num_key_value_heads: int = 4
    head_dim: int = 128
    num_experts: int = 128
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    moe_flags: tuple[bool, ...] = field(default=())
    rope: Mapping[str, Any] | None = None

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, moe in enumerate(self.moe_flags) if moe]

    def __post_init__(self) -> None:
        if len(self.moe_flags) != self.num_hidden_layers:
            raise ValueError("moe_flags must have one entry per layer")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen3-MoE uses silu)")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3MoeConfig:
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window is not supported (Qwen3-MoE checkpoints ship it off)")
        names = {f.name for f in fields(cls)} - {"rope", "moe_flags"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        kwargs.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        kwargs["num_experts"] = num_experts(dict(hf))
        kwargs["moe_flags"] = tuple(moe_layer_flags(dict(hf)))
        kwargs["rope"] = rope_parameters(hf)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf["rope_parameters"] = dict(hf.pop("rope") or {"rope_type": "default", "rope_theta": 10000.0})
        flags = hf.pop("moe_flags")
        hf["decoder_sparse_step"] = 1
        hf["mlp_only_layers"] = [i for i, moe in enumerate(flags) if not moe]
        hf["model_type"], hf["architectures"] = "qwen3_moe", ["Qwen3MoeForCausalLM"]
        return hf


class MoE(MoEBlock):
    """HF's ``Qwen3MoeSparseMoeBlock``: router ``gate``, fused ``experts``."""

    def __init__(self, c: Qwen3MoeConfig) -> None:
        super().__init__()
        self.experts = Experts(c.num_experts, c.hidden_size, c.moe_intermediate_size)
        self.gate = SoftmaxRouter(c.hidden_size, c.num_experts, c.num_experts_per_tok, norm_topk_prob=c.norm_topk_prob)

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None) -> tuple[Tensor, Routing]:
        routing = self.gate(x, valid, replay)
        return self.experts(x, routing.ids, routing.weights, valid), routing


class Qwen3MoeModel(nn.Module):
    def __init__(self, c: Qwen3MoeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            PreNormLayer(
                GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, i,
                            qk_norm_eps=c.rms_norm_eps, bias=c.attention_bias),
                MoE(c) if c.moe_flags[i] else MLP(c.hidden_size, c.intermediate_size),
                is_moe=c.moe_flags[i], hidden=c.hidden_size, eps=c.rms_norm_eps,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3MoeForCausalLM(DecoderLM):
    Config = Qwen3MoeConfig

    def __init__(self, config: Qwen3MoeConfig) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope or {"rope_type": "default", "rope_theta": 10000.0})
        self.inv_freq, self.rope_factor = rope_inv_freq(config.head_dim, rope, config.max_position_embeddings)
        self.model = Qwen3MoeModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = config.moe_layers
        self.tie_weights()

    def cache_layout(self) -> list[LayerCache]:
        c = self.config
        return [{"per_token": gqa_cache_layout(c.num_key_value_heads, c.head_dim)} for _ in range(c.num_hidden_layers)]
