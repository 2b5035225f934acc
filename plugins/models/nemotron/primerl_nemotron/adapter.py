"""The Nemotron 3 model adapter: presets, MoE layout and checkpoint names; build, tokenizer
and the checkpoint IO itself come from :class:`primerl.models.HFModelAdapter`.

Published Nemotron-H checkpoints name the decoder ``backbone.`` (our model and
transformers' in-memory model say ``model.``) and store each expert's non-gated
``up_proj``/``down_proj`` separately: both mappings are declared in :meth:`hf_format`.
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelConfig
from primerl_nemotron.presets import PRESETS, layer_kinds


class Nemotron(HFModelAdapter):
    """Nemotron 3 (HF ``nemotron_h``): hybrid Mamba-2 / attention / MoE."""

    name = "nemotron"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_type = "nemotron_h"
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
