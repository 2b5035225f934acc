"""The GLM-5 model adapter: presets, MoE layout; build, tokenizer and checkpoints come from
:class:`primerl.models.HFModelAdapter`.

Light at import (no torch, no transformers): ``primerl run --dry-run`` instantiates the
adapter to validate a config.

Checkpoints are HF directories read one tensor at a time straight into our model, in
both expert layouts: the fused 3D tensors of ``GlmMoeDsaForCausalLM.state_dict()`` and
the per-expert tensors GLM-5 is published in (and HF ``save_pretrained`` writes). Keys of
layers past ``num_hidden_layers`` are skipped: GLM-5 ships its multi-token-prediction
layer as ``model.layers.78``. We write the per-expert layout, which HF, vLLM and SGLang
all load.
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_glm5.presets import PRESETS, layer_types


class Glm5(HFModelAdapter):
    """GLM-5 (HF ``glm_moe_dsa``): MLA + DeepSeek sparse attention + sigmoid-routed MoE."""

    name = "glm5"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("glm_moe_dsa",)
    supports = ModelCapabilities(expert_parallel=True, context_parallel=True, router_replay=True, fp8=True, lora=True,
                                 varlen_rows=True)
    model_class = "primerl_glm5.model:Glm5ForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        mlp_types, _ = layer_types(hf)
        layers = [i for i, kind in enumerate(mlp_types) if kind == "sparse"]
        return layers, hf.get("n_routed_experts", 256), hf.get("num_experts_per_tok", 8)

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """MLA with DSA indexers, DeepSeek-V3-style MoE after the dense layers."""
        from primerl.plan import decoder_shape

        _, indexers = layer_types(hf)
        return decoder_shape(hf, self.moe_layers(hf)[0], attention="mla", indexers=indexers, router_bias=True, shared_experts=True,
                             seq_len=seq_len)
