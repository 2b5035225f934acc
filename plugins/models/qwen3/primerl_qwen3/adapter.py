"""The Qwen3 model adapter: presets, capabilities and the planner's shape; build, tokenizer
and HF checkpoints come from :class:`primerl.models.HFModelAdapter` (light at import: no
torch). A dense model: nothing routes, so expert parallel and router replay do not apply."""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_qwen3.presets import PRESETS


class Qwen3(HFModelAdapter):
    """Qwen3 (HF ``qwen3``): GQA with per-head q/k norms + SwiGLU MLPs."""

    name = "qwen3"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("qwen3",)
    supports = ModelCapabilities(context_parallel=True, fp8=True, lora=True, varlen_rows=True)
    model_class = "primerl_qwen3.model:Qwen3ForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        return [], 0, 0

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """GQA with per-head q/k norms, a SwiGLU MLP in every layer."""
        from primerl.plan import decoder_shape

        return decoder_shape(hf, [], attention="gqa", qk_norm="head", seq_len=seq_len)
