"""Llama (HF ``llama``; ``mistral`` without sliding windows) in plain torch, with primerl's
ragged forward.

Parameter names and shapes are those of ``LlamaForCausalLM.state_dict()`` and the maths
follows HF op for op. One decoder layer (x: [B, S, hidden])::

    h = x + GQA(RMSNorm(x))       # RoPE (halves layout; Llama 3's frequency scaling)
    y = h + SwiGLU(RMSNorm(h))

Llama 2 and 3, SmolLM2, TinyLlama and Mistral's dense models without a sliding window share
it; their differences are config values (bias in the projections, tied embeddings, the
RoPE kind). Sliding-window attention is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from primerl_blocks.attention import GQAttention, gqa_cache_layout
from primerl_blocks.decoder import DecoderLM, PreNormLayer
from primerl_blocks.layers import MLP, RMSNorm, rope_inv_freq, rope_parameters
from torch import nn

from primerl.models.batch import LayerCache


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 131072
    rms_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    rope: Mapping[str, Any] | None = None
    num_experts_per_tok: int = 0  # dense: no layer routes

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Llama uses silu)")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        window = hf.get("sliding_window")
        if window is not None and window < hf.get("max_position_embeddings", 0):
            raise ValueError(f"sliding_window {window} is not supported: --model llama runs full attention "
                             f"(--model hf runs sliding-window checkpoints)")
        if hf.get("pretraining_tp", 1) != 1:
            raise ValueError(f"pretraining_tp {hf['pretraining_tp']} is not supported (every published Llama "
                             f"checkpoint ships 1)")
        names = {f.name for f in fields(cls)} - {"rope", "num_experts_per_tok"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        kwargs.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        kwargs.setdefault("num_key_value_heads", hf["num_attention_heads"])
        kwargs["rope"] = rope_parameters(hf)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf.pop("num_experts_per_tok")
        hf["rope_parameters"] = dict(hf.pop("rope") or {"rope_type": "default", "rope_theta": 10000.0})
        hf["model_type"], hf["architectures"] = "llama", ["LlamaForCausalLM"]
        return hf


class LlamaModel(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            PreNormLayer(
                GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, i,
                            bias=c.attention_bias),
                MLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias),
                is_moe=False, hidden=c.hidden_size, eps=c.rms_norm_eps,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class LlamaForCausalLM(DecoderLM):
    Config = LlamaConfig

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope or {"rope_type": "default", "rope_theta": 10000.0})
        self.inv_freq, self.rope_factor = rope_inv_freq(config.head_dim, rope, config.max_position_embeddings)
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = []
        self.tie_weights()

    def cache_layout(self) -> list[LayerCache]:
        c = self.config
        return [{"per_token": gqa_cache_layout(c.num_key_value_heads, c.head_dim)} for _ in range(c.num_hidden_layers)]
