"""The Qwen3-MoE model adapter: presets and MoE layout; build, tokenizer and HF checkpoints
come from :class:`primerl.models.HFModelAdapter` (light at import: no torch)."""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_qwen3_moe.presets import PRESETS, moe_layer_flags, num_experts


class Qwen3Moe(HFModelAdapter):
    """Qwen3-MoE (HF ``qwen3_moe``): GQA + softmax-routed MoE."""

    name = "qwen3-moe"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("qwen3_moe",)
    supports = ModelCapabilities(expert_parallel=True, context_parallel=True, router_replay=True, fp8=True, lora=True,
                                 varlen_rows=True)
    model_class = "primerl_qwen3_moe.model:Qwen3MoeForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        layers = [i for i, moe in enumerate(moe_layer_flags(hf)) if moe]
        return layers, num_experts(hf), hf.get("num_experts_per_tok", 8)

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """GQA with per-head q/k norms, softmax-routed experts."""
        from primerl.plan import decoder_shape

        return decoder_shape(hf, self.moe_layers(hf)[0], attention="gqa", qk_norm="head", seq_len=seq_len)
