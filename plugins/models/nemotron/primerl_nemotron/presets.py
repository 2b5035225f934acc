"""The HF ``config.json`` of each Nemotron 3 preset (plain dicts: importing this module is free).

* ``tiny``: Nemotron 3's hybrid stack — Mamba-2 ("M"), MoE ("E") and attention ("*")
  blocks, each its own residual layer, as in ``hybrid_override_pattern`` — with every
  mechanism of the real model (grouped Mamba state, gated RMSNorm, relu2 experts with a
  shared expert, sigmoid routing with a correction bias, GQA without RoPE), at about a
  million parameters, on the byte tokenizer.
* ``full``: NVIDIA Nemotron 3 Nano 30B-A3B as published (the Nemotron 3 checkpoint
  released in transformers' ``nemotron_h`` format; Super and Ultra share the
  architecture at larger sizes and add a latent MoE projection, ``moe_latent_size``,
  which the model supports).
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

LAYER_CODES = {"M": "linear_attention", "E": "moe", "*": "full_attention", "-": "mlp"}
# older checkpoints spell the kinds differently
LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}

TINY: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "layers_block_type": ["linear_attention", "moe", "full_attention", "moe", "linear_attention", "moe"],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "intermediate_size": 256,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
    "conv_kernel": 4,
    "chunk_size": 32,
    "mamba_hidden_act": "silu",
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "use_bias": False,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "moe_shared_expert_intermediate_size": 128,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 4096,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "residual_in_fp32": False,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

# NVIDIA Nemotron 3 Nano 30B-A3B as published at
# https://huggingface.co/nvidia/NVIDIA-Nemotron-3-Nano-30B-A3B-BF16 (config.json; the
# checkpoint transformers' NemotronHConfig docstring cites): 52 layers, 23 Mamba-2 + 23 MoE
# + 6 attention, 128 routed experts top-6 plus a shared expert.
FULL: dict[str, Any] = {
    "architectures": ["NemotronHForCausalLM"],
    "model_type": "nemotron_h",
    "vocab_size": 131072,
    "hidden_size": 2688,
    "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
    "num_hidden_layers": 52,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "intermediate_size": 1856,
    "mlp_hidden_act": "relu2",
    "mamba_num_heads": 64,
    "mamba_head_dim": 64,
    "ssm_state_size": 128,
    "n_groups": 8,
    "expand": 2,
    "conv_kernel": 4,
    "chunk_size": 128,
    "mamba_hidden_act": "silu",
    "mamba_ssm_cache_dtype": "float32",
    "time_step_min": 0.001,
    "time_step_max": 0.1,
    "time_step_floor": 1e-4,
    "use_conv_bias": True,
    "mamba_proj_bias": False,
    "use_bias": False,
    "n_routed_experts": 128,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 1856,
    "moe_shared_expert_intermediate_size": 3712,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "max_position_embeddings": 262144,
    "layer_norm_epsilon": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "mlp_bias": False,
    "residual_in_fp32": False,
    "rescale_prenorm_residual": True,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    "use_cache": True,
    "dtype": "bfloat16",
}

# ``small``: tiny's layers at hidden 512 (Mamba-2 heads 16 x 32), where a step's matmuls
# dominate on a CPU core (bench/utilisation.py)
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 1536, "mamba_num_heads": 16, "mamba_head_dim": 32, "ssm_state_size": 32,
    "moe_intermediate_size": 384, "moe_shared_expert_intermediate_size": 768,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "full": FULL}


def layer_kinds(hf: dict[str, Any]) -> list[str]:
    """Each layer's kind (linear_attention | full_attention | moe | mlp), as NemotronHConfig
    derives it: ``layers_block_type``, else ``hybrid_override_pattern``."""
    kinds = hf.get("layers_block_type") or hf.get("layer_types")
    if kinds is None:
        pattern = hf.get("hybrid_override_pattern")
        if pattern is None:
            raise ValueError("a nemotron_h config needs layers_block_type or hybrid_override_pattern")
        try:
            kinds = [LAYER_CODES[c] for c in pattern]
        except KeyError as e:
            raise ValueError(f"hybrid_override_pattern has an unknown layer code {e}; codes: M E * -") from None
    kinds = [LEGACY_KINDS.get(k, k) for k in kinds]
    unknown = set(kinds) - set(LAYER_CODES.values())
    if unknown:
        raise ValueError(f"unknown nemotron_h layer kinds {sorted(unknown)}")
    return kinds
