"""The Nemotron 3 model adapter: presets, MoE layout and checkpoint names; build, tokenizer
and the checkpoint IO itself come from :class:`primerl.models.HFModelAdapter`.

Published Nemotron-H checkpoints name the decoder ``backbone.`` (our model and
transformers' in-memory model say ``model.``) and store each expert's non-gated
``up_proj``/``down_proj`` separately: both mappings are declared in :meth:`hf_format`.
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_nemotron.presets import PRESETS, layer_kinds


class Nemotron(HFModelAdapter):
    """Nemotron 3 (HF ``nemotron_h``): hybrid Mamba-2 / attention / MoE."""

    name = "nemotron"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("nemotron_h",)
    # context parallel cannot split a Mamba-2 scan (its state would pass from rank to rank)
    supports = ModelCapabilities(expert_parallel=True, router_replay=True, fp8=True, lora=True, varlen_rows=True)
    model_class = "primerl_nemotron.model:NemotronForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        layers = [i for i, kind in enumerate(layer_kinds(hf)) if kind == "moe"]
        return layers, hf.get("n_routed_experts", 128), hf.get("num_experts_per_tok", 6)

    def hf_format(self) -> Any:
        from primerl.models.checkpoint import FusedExperts, HFFormat

        return HFFormat(
            prefixes=(("backbone.", "model."),),
            experts=(FusedExperts("up_proj", ("up_proj",)), FusedExperts("down_proj", ("down_proj",))),
        )

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """The hybrid stack: one norm per block, then a Mamba-2 mixer, attention (GQA without
        RoPE), a relu2 MLP or a sigmoid-routed MoE (shared expert, optional latent projections)."""
        from primerl import plan

        h = hf["hidden_size"]
        kinds = layer_kinds(hf)
        n_experts, top_k = plan.experts_of(hf) if "moe" in kinds else (0, 0)
        expert_params = 0
        layers = []
        for i, kind in enumerate(kinds):
            layer = plan.Layer(i, {"linear_attention": "mamba2", "full_attention": "gqa"}.get(kind, "none"),
                          {"moe": "moe", "mlp": "dense"}.get(kind, "none"))
            layer.dense += h  # the block's norm
            layer.saved += plan.norm_residual(h, 1)
            if kind == "linear_attention":
                plan.mamba2_mixer(hf, layer)
            elif kind == "full_attention":
                plan.gqa_mixer(hf, layer, qk_norm=None, rope=False)
            elif kind == "mlp":
                params, saved = plan.dense_mlp(h, hf["intermediate_size"], gated=False, bias=hf.get("mlp_bias", False))
                layer.dense += params
                layer.quantisable += 2 * h * hf["intermediate_size"]
                layer.saved += saved
            else:
                block, expert_params = plan.moe_block(
                    hf, h, n_experts=n_experts, top_k=top_k, inter=hf["moe_intermediate_size"], gated=False,
                    shared_inter=hf.get("moe_shared_expert_intermediate_size", 0),
                    shared_bias=hf.get("mlp_bias", False), router_bias=True, latent=hf.get("moe_latent_size"),
                )
                plan.merge_block(layer, block)
            layers.append(layer)
        return plan.assemble_shape(hf, layers, num_experts=n_experts, top_k=top_k, expert_params=expert_params)
