"""MiniMax-M2 (HF ``minimax_m2``) in plain torch, with primerl's ragged forward.

Parameter names and shapes are those of ``MiniMaxM2ForCausalLM.state_dict()`` and the
maths follows HF op for op. One decoder layer (x: [B, S, hidden])::

    h = x + GQA(RMSNorm(x))     # q and k RMS-normalised over the whole projection
                                # (heads * head_dim), RoPE on the first rotary_dim dims of a head
    y = h + MoE(RMSNorm(h))     # every layer: sigmoid top-k, no shared expert

Routing: sigmoid of the router logits in float32; experts chosen by top-k of score +
``e_score_correction_bias`` (a buffer of the MoE block, ``mlp.e_score_correction_bias``),
weighted by the bias-free scores renormalised over the k chosen. Under router replay the
weights are the scores at the replayed experts, renormalised the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch
from primerl_blocks.attention import GQAttention, gqa_cache_layout
from primerl_blocks.decoder import DecoderLM, PreNormLayer
from primerl_blocks.layers import RMSNorm, rope_inv_freq, rope_parameters
from primerl_blocks.moe import MoEBlock, Routing, SigmoidRouter
from torch import Tensor, nn

from primerl.models.batch import LayerCache
from primerl.models.experts import Experts
from primerl_minimax.presets import num_experts, rotary_dim


@dataclass(frozen=True)
class MiniMaxM2Config:
    vocab_size: int = 200064
    hidden_size: int = 3072
    intermediate_size: int = 1536  # one expert's width
    num_hidden_layers: int = 62
    num_attention_heads: int = 48
    num_key_value_heads: int = 8
    head_dim: int = 128
    rotary_dim: int = 64
    num_local_experts: int = 256
    num_experts_per_tok: int = 8
    hidden_act: str = "silu"
    max_position_embeddings: int = 196608
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    rope: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (MiniMax-M2 uses silu)")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> MiniMaxM2Config:
        hf = dict(hf)
        wrong = {k: hf[k] for k, ok in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer"),
                                         ("use_qk_norm", True), ("use_routing_bias", True)) if hf.get(k, ok) != ok}
        kinds = set(hf.get("layer_types") or ["full_attention"])
        if wrong or kinds != {"full_attention"}:
            raise ValueError(f"MiniMax-M2 variant not supported: {wrong or {'layer_types': sorted(kinds)}} "
                             f"(primerl implements sigmoid routing with a bias, per-layer q/k norm, full attention)")
        names = {f.name for f in fields(cls)} - {"rope", "rotary_dim", "num_local_experts"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        kwargs.setdefault("head_dim", hf["hidden_size"] // hf["num_attention_heads"])
        kwargs["num_local_experts"] = num_experts(hf)
        kwargs["rotary_dim"] = rotary_dim(hf)
        kwargs["rope"] = rope_parameters(hf)
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        rope = dict(hf.pop("rope") or {"rope_type": "default", "rope_theta": 5000000.0})
        rope["partial_rotary_factor"] = self.rotary_dim / self.head_dim
        hf["rope_parameters"] = rope
        hf["model_type"], hf["architectures"] = "minimax_m2", ["MiniMaxM2ForCausalLM"]
        return hf


class MoE(MoEBlock):
    """HF's ``MiniMaxM2SparseMoeBlock``: router ``gate``, fused ``experts``, and the block's
    ``e_score_correction_bias`` that steers the router's choice."""

    block_bias = "e_score_correction_bias"

    def __init__(self, c: MiniMaxM2Config) -> None:
        super().__init__()
        self.gate = SigmoidRouter(c.hidden_size, c.num_local_experts, c.num_experts_per_tok, owns_bias=False)
        self.experts = Experts(c.num_local_experts, c.hidden_size, c.intermediate_size)
        self.e_score_correction_bias = nn.Buffer(torch.zeros(c.num_local_experts, dtype=torch.float32))

    @torch.no_grad()
    def init_weights_(self, normal_: Any) -> None:
        """The bias starts at zero (the router and experts initialise themselves)."""
        self.e_score_correction_bias.zero_()

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None) -> tuple[Tensor, Routing]:
        routing = self.gate(x, valid, replay, bias=self.e_score_correction_bias)
        return self.experts(x, routing.ids, routing.weights, valid), routing


class MiniMaxM2Model(nn.Module):
    def __init__(self, c: MiniMaxM2Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(
            PreNormLayer(
                GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, i,
                            qk_norm_eps=c.rms_norm_eps, qk_norm="layer", rotary_dim=c.rotary_dim),
                MoE(c), is_moe=True, hidden=c.hidden_size, eps=c.rms_norm_eps,
            )
            for i in range(c.num_hidden_layers)
        )
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class MiniMaxM2ForCausalLM(DecoderLM):
    Config = MiniMaxM2Config
    keep_fp32 = ("gate.weight", "mlp.e_score_correction_bias")  # routing decided in float32

    def __init__(self, config: MiniMaxM2Config) -> None:
        super().__init__()
        self.config = config
        rope = dict(config.rope or {"rope_type": "default", "rope_theta": 5000000.0})
        self.inv_freq, self.rope_factor = rope_inv_freq(config.rotary_dim, rope, config.max_position_embeddings)
        self.model = MiniMaxM2Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = list(range(config.num_hidden_layers))
        self.tie_weights()

    def cache_layout(self) -> list[LayerCache]:
        c = self.config
        return [{"per_token": gqa_cache_layout(c.num_key_value_heads, c.head_dim)} for _ in range(c.num_hidden_layers)]
