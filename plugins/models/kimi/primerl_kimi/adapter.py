"""The Kimi K2 model adapter: presets and MoE layout; build, tokenizer and HF checkpoints
come from :class:`primerl.models.HFModelAdapter` (light at import: no torch).

Checkpoints: HF directories of model_type ``deepseek_v3`` or ``kimi_k2`` (Kimi's own
name for the same architecture), per-expert or fused expert layout, read one tensor at a
time. Multi-token-prediction layers past ``num_hidden_layers`` are skipped.
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelConfig
from primerl_kimi.presets import PRESETS, moe_layer_flags

MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class Kimi(HFModelAdapter):
    """Kimi K2 (HF ``deepseek_v3``): MLA with YaRN RoPE + sigmoid-routed MoE."""

    name = "kimi"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_type = "deepseek_v3"
    model_class = "primerl_kimi.model:KimiForCausalLM"

    def config_dict(self, config: ModelConfig) -> dict[str, Any]:
        if config.checkpoint is None:
            return self.hf_config(config.preset)
        from primerl.models.checkpoint import read_config

        return read_config(config.checkpoint, MODEL_TYPES)

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        layers = [i for i, moe in enumerate(moe_layer_flags(hf)) if moe]
        return layers, hf.get("n_routed_experts", 384), hf.get("num_experts_per_tok", 8)
