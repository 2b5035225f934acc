"""The MiniMax-M2 model adapter: presets, MoE layout, capabilities, the planner's shape and
the published checkpoint names; build, tokenizer and checkpoint IO come from
:class:`primerl.models.HFModelAdapter` (light at import: no torch).

Published MiniMax-M2 checkpoints name each layer's MoE block ``block_sparse_moe`` (the
model and transformers' in-memory model say ``mlp``) and store each expert's SwiGLU as
``w1`` (gate), ``w3`` (up) and ``w2`` (down): both are declared in :meth:`hf_format`.
Their block-FP8 weights are read directly (dequantised as they load).
"""

from __future__ import annotations

from typing import Any

from primerl.models import HFModelAdapter, ModelCapabilities, ModelConfig
from primerl_minimax.presets import PRESETS, num_experts


class MiniMax(HFModelAdapter):
    """MiniMax-M2 (HF ``minimax_m2``): GQA + sigmoid-routed MoE in every layer."""

    name = "minimax"
    Config = ModelConfig
    presets = tuple(PRESETS)
    preset_configs = PRESETS
    model_types = ("minimax_m2",)
    supports = ModelCapabilities(expert_parallel=True, context_parallel=True, router_replay=True, fp8=True, lora=True,
                                 varlen_rows=True)
    model_class = "primerl_minimax.model:MiniMaxM2ForCausalLM"

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        return list(range(hf.get("num_hidden_layers", 62))), num_experts(hf), hf.get("num_experts_per_tok", 8)

    def hf_format(self) -> Any:
        from primerl.models.checkpoint import FusedExperts, HFFormat

        return HFFormat(
            renames=((".block_sparse_moe.", ".mlp."),),
            experts=(FusedExperts("gate_up_proj", ("w1", "w3")), FusedExperts("down_proj", ("w2",))),
        )

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """GQA with q/k norms over the whole projection, sigmoid-routed experts with a bias."""
        from primerl.plan import decoder_shape

        return decoder_shape({**hf, "n_routed_experts": num_experts(hf)}, self.moe_layers(hf)[0], attention="gqa",
                             qk_norm="layer", router_bias=True, expert_inter="intermediate_size", seq_len=seq_len)
