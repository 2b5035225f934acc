"""The Llama model adapter: presets, capabilities and the planner's shape; build, tokenizer
and HF checkpoints come from :class:`primerl.models.HFModelAdapter` (light at import: no
torch). A dense model: nothing routes, so expert parallel and router replay do not apply.

``model_types`` covers ``llama`` and ``mistral`` (the same layers; a Mistral checkpoint with
a sliding window is refused when it is read): checkpoint folders and GGUF files of either
(llama.cpp files Llama, SmolLM2, TinyLlama and Mistral under the ``llama`` architecture)."""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_llama.presets import PRESETS


class Llama(HFModelAdapter):
    """Llama (HF ``llama``): GQA + SwiGLU MLPs, RoPE (default, linear or Llama 3's)."""

    name = "llama"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("llama", "mistral")
    supports = ModelCapabilities(context_parallel=True, fp8=True, lora=True, varlen_rows=True)
    model_class = "primerl_llama.model:LlamaForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        return [], 0, 0

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """GQA without q/k norms, a SwiGLU MLP in every layer."""
        from primerl.plan import decoder_shape

        return decoder_shape(hf, [], attention="gqa", qk_norm=None, seq_len=seq_len)
