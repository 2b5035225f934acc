"""Nemotron 3 (HF ``nemotron_h``) in plain torch, with primerl's ragged forward.

A hybrid stack where every layer is one residual block ``x + mixer(RMSNorm(x))`` and the
mixer is one of (``hybrid_override_pattern`` codes in brackets):

* Mamba-2 [M] (:mod:`primerl_blocks.mamba2`): the bulk of the sequence mixing, with a
  per-slot recurrent state instead of a KV cache;
* attention [*] (:mod:`primerl_blocks.attention`): GQA without positional encoding;
* MoE [E]: sigmoid router with a correction bias (DeepSeek's noaux_tc), non-gated relu2
  experts, a relu2 shared expert, and for Nemotron 3 Super/Ultra an optional latent
  projection around the routed experts (``moe_latent_size``);
* MLP [-]: a relu2 MLP.

Parameter names and shapes are those of ``NemotronHForCausalLM.state_dict()``
(``model.embeddings``, ``model.layers.N.norm``, ``model.layers.N.mixer...``,
``model.norm_f``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from primerl_blocks.attention import GQAttention, gqa_cache_layout
from primerl_blocks.decoder import DecoderLM
from primerl_blocks.layers import MLP, RMSNorm
from primerl_blocks.mamba2 import Mamba2Mixer, mamba2_state_layout
from primerl_blocks.moe import FP32_SUFFIXES, MoEBlock, Routing, SigmoidRouter
from torch import Tensor, nn

from primerl.models.batch import Batch, LayerCache, mix
from primerl.models.contract import LayerPlan, Mixer
from primerl.models.experts import Experts
from primerl_nemotron.presets import layer_kinds


@dataclass(frozen=True)
class NemotronConfig:
    vocab_size: int = 131072
    hidden_size: int = 2688
    num_attention_heads: int = 32
    num_key_value_heads: int = 2
    head_dim: int = 128
    intermediate_size: int = 1856
    mlp_hidden_act: str = "relu2"
    mamba_num_heads: int = 64
    mamba_head_dim: int = 64
    ssm_state_size: int = 128
    n_groups: int = 8
    conv_kernel: int = 4
    time_step_min: float = 0.001
    use_conv_bias: bool = True
    use_bias: bool = False
    n_routed_experts: int = 128
    num_experts_per_tok: int = 6
    moe_intermediate_size: int = 1856
    moe_shared_expert_intermediate_size: int = 3712
    moe_latent_size: int | None = None
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 2.5
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    layers_block_type: tuple[str, ...] = field(default=())

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layers_block_type)

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.layers_block_type) if kind == "moe"]

    def __post_init__(self) -> None:
        if self.mlp_hidden_act != "relu2":
            raise ValueError(f"mlp_hidden_act {self.mlp_hidden_act!r} is not supported (Nemotron-H uses relu2)")
        if self.mamba_num_heads % self.n_groups:
            raise ValueError("mamba_num_heads must be a multiple of n_groups")

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> NemotronConfig:
        if hf.get("residual_in_fp32"):
            raise ValueError("residual_in_fp32 is not supported (Nemotron 3 ships it off)")
        hf = dict(hf)
        for old, new in (("mamba_n_groups", "n_groups"), ("mamba_d_conv", "conv_kernel"),
                         ("mamba_dt_min", "time_step_min"), ("mamba_conv_bias", "use_conv_bias")):
            if old in hf and new not in hf:
                hf[new] = hf[old]
        names = {f.name for f in fields(cls)} - {"layers_block_type"}
        kwargs: dict[str, Any] = {k: hf[k] for k in names if hf.get(k) is not None}
        kwargs["layers_block_type"] = tuple(layer_kinds(hf))
        return cls(**kwargs)

    def to_hf(self) -> dict[str, Any]:
        hf: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        hf["layers_block_type"] = list(self.layers_block_type)
        hf["num_hidden_layers"] = self.num_hidden_layers
        hf.pop("hybrid_override_pattern", None)
        hf["model_type"], hf["architectures"] = "nemotron_h", ["NemotronHForCausalLM"]
        return hf


class MoE(MoEBlock):
    """HF's ``NemotronHMoE``: routed relu2 experts (optionally in a latent space) + shared expert."""

    def __init__(self, c: NemotronConfig) -> None:
        super().__init__()
        width = c.moe_latent_size or c.hidden_size
        self.experts = Experts(c.n_routed_experts, width, c.moe_intermediate_size, act="relu2", gated=False)
        self.gate = SigmoidRouter(
            c.hidden_size, c.n_routed_experts, c.num_experts_per_tok, n_group=c.n_group,
            topk_group=c.topk_group, norm_topk_prob=c.norm_topk_prob, scaling=c.routed_scaling_factor,
        )
        self.shared_experts = MLP(c.hidden_size, c.moe_shared_expert_intermediate_size, act="relu2",
                                  gated=False, bias=c.mlp_bias)
        self.latent = c.moe_latent_size is not None  # routed experts in a latent space (Super/Ultra)
        if self.latent:
            self.fc1_latent_proj = nn.Linear(c.hidden_size, c.moe_latent_size, bias=c.mlp_bias)
            self.fc2_latent_proj = nn.Linear(c.moe_latent_size, c.hidden_size, bias=c.mlp_bias)

    def forward(self, x: Tensor, valid: Tensor, replay: Tensor | None) -> tuple[Tensor, Routing]:
        routing = self.gate(x, valid, replay)
        h = self.fc1_latent_proj(x) if self.latent else x
        y = self.experts(h, routing.ids, routing.weights, valid)
        if self.latent:
            y = self.fc2_latent_proj(y)
        return y + self.shared_experts(x), routing


class Block(nn.Module):
    """One residual layer: ``x + mixer(norm(x))`` (HF's ``NemotronHBlock``)."""

    def __init__(self, c: NemotronConfig, layer_idx: int) -> None:
        super().__init__()
        self.kind = c.layers_block_type[layer_idx]
        self.is_moe = self.kind == "moe"
        self.norm = RMSNorm(c.hidden_size, c.layer_norm_epsilon, weight_in_fp32=True)
        if self.kind == "linear_attention":
            self.mixer = Mamba2Mixer(c, layer_idx)
        elif self.kind == "full_attention":
            self.mixer = GQAttention(c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
                                     layer_idx, rope=False, bias=c.attention_bias)
        elif self.kind == "moe":
            self.mixer = MoE(c)
        else:
            self.mixer = MLP(c.hidden_size, c.intermediate_size, act="relu2", gated=False, bias=c.mlp_bias)

    def layer_plan(self, name: str) -> LayerPlan:
        """A Mamba-2 or attention layer mixes the sequence; an MoE or MLP layer does not."""
        if self.kind in ("linear_attention", "full_attention"):
            return LayerPlan(name, self.mixer.mixer_kind)
        return LayerPlan(name, Mixer.NONE, self.mixer.moe_plan().under(f"{name}.mixer") if self.is_moe else None)

    def forward(self, x: Tensor, batch: Batch, valid: Tensor, carry: Any, replay: Tensor | None):
        h = self.norm(x)
        if self.kind == "linear_attention":
            return x + self.mixer(h, batch), carry, None
        if self.kind == "full_attention":
            return x + mix(self.mixer, h, batch, None)[0], carry, None
        if self.is_moe:
            y, routing = self.mixer(h.flatten(0, 1), valid, replay)
            return x + y.view_as(x), carry, routing
        return x + self.mixer(h), carry, None


class NemotronModel(nn.Module):
    def __init__(self, c: NemotronConfig) -> None:
        super().__init__()
        self.embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, i) for i in range(c.num_hidden_layers))
        self.norm_f = RMSNorm(c.hidden_size, c.layer_norm_epsilon, weight_in_fp32=True)


class NemotronForCausalLM(DecoderLM):
    Config = NemotronConfig
    # routers stay float32 as in HF, and so do Mamba's per-head A_log, D and dt_bias (they set
    # each step's decay, where bf16 rounding compounds over the sequence)
    keep_fp32 = FP32_SUFFIXES + ("mixer.A_log", "mixer.D", "mixer.dt_bias")

    def __init__(self, config: NemotronConfig) -> None:
        super().__init__()
        self.config = config
        self.model = NemotronModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.moe_layers = config.moe_layers
        self.tie_weights()

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def final_norm(self) -> nn.Module:
        return self.model.norm_f

    def cache_layout(self) -> list[LayerCache]:
        c = self.config
        layout: list[LayerCache] = []
        for kind in c.layers_block_type:
            if kind == "full_attention":
                layout.append({"per_token": gqa_cache_layout(c.num_key_value_heads, c.head_dim)})
            elif kind == "linear_attention":
                layout.append({"state": mamba2_state_layout(c)})
            else:
                layout.append({})
        return layout
