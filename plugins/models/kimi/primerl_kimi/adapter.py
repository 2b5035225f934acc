"""The Kimi K2 model adapter: presets and MoE layout; build, tokenizer and HF checkpoints
come from :class:`primerl.models.HFModelAdapter` (light at import: no torch).

Checkpoints: HF directories of model_type ``deepseek_v3`` or ``kimi_k2`` (Kimi's own
name for the same architecture), per-expert or fused expert layout, read one tensor at a
time. Multi-token-prediction layers past ``num_hidden_layers`` are skipped.
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_kimi.presets import PRESETS, moe_layer_flags

MODEL_TYPES = ("deepseek_v3", "kimi_k2")


class Kimi(HFModelAdapter):
    """Kimi K2 (HF ``deepseek_v3``): MLA with YaRN RoPE + sigmoid-routed MoE."""

    name = "kimi"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = MODEL_TYPES
    supports = ModelCapabilities(expert_parallel=True, context_parallel=True, router_replay=True, fp8=True, lora=True,
                                 varlen_rows=True)
    model_class = "primerl_kimi.model:KimiForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        layers = [i for i, moe in enumerate(moe_layer_flags(hf)) if moe]
        return layers, hf.get("n_routed_experts", 384), hf.get("num_experts_per_tok", 8)

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """MLA, DeepSeek-V3-style MoE after the dense layers."""
        from primerl.plan import decoder_shape

        return decoder_shape(hf, self.moe_layers(hf)[0], attention="mla", router_bias=True, shared_experts=True, seq_len=seq_len)
