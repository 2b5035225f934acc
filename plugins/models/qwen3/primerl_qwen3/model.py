"""Qwen3 (HF ``qwen3``, dense) in plain torch, with primerl's ragged forward.

Parameter names and shapes are those of ``Qwen3ForCausalLM.state_dict()`` and the maths
follows HF op for op. One decoder layer (x: [B, S, hidden])::

    h = x + GQA(RMSNorm(x))       # q/k RMS-normalised per head, RoPE (halves layout)
    y = h + SwiGLU(RMSNorm(h))

Sliding-window attention (``use_sliding_window``) is refused: every published Qwen3
checkpoint ships it off.
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
class Qwen3Config:
    vocab_size: int = 151936
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 36
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int = 128
    hidden_act: str = "silu"
    max_position_embeddings: int = 40960
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    rope: Mapping[str, Any] | None = None
    num_experts_per_tok: int = 0  # dense: no layer routes

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (Qwen3 uses silu)")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3Config:
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window is not supported (Qwen3 checkpoints ship it off)")
        names = {f.name for f in fields(cls)} - {"rope", "num_experts_per_tok"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        kwargs.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        kwargs["rope"] = rope_parameters(hf)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf.pop("num_experts_per_tok")
        hf["rope_parameters"] = dict(hf.pop("rope") or {"rope_type": "default", "rope_theta": 10000.0})
        hf["model_type"], hf["architectures"] = "qwen3", ["Qwen3ForCausalLM"]
        return hf


class Qwen3Model(nn.Module):
    def __init__(self, c: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            PreNormLayer(
                GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, i,
                            qk_norm_eps=c.rms_norm_eps, bias=c.attention_bias),
                MLP(c.hidden_size, c.intermediate_size),
                is_moe=False, hidden=c.hidden_size, eps=c.rms_norm_eps,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3ForCausalLM(DecoderLM):
    Config = Qwen3Config

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope or {"rope_type": "default", "rope_theta": 10000.0})
        self.inv_freq, self.rope_factor = rope_inv_freq(config.head_dim, rope, config.max_position_embeddings)
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = []
        self.tie_weights()

    def cache_layout(self) -> list[LayerCache]:
        c = self.config
        return [{"per_token": gqa_cache_layout(c.num_key_value_heads, c.head_dim)} for _ in range(c.num_hidden_layers)]
