"""The HF ``config.json`` of each Qwen3-MoE preset (plain dicts: importing this module is free).

* ``tiny``: Qwen3-MoE's architecture (GQA with per-head q/k RMSNorm, softmax top-k
  routing over experts without a shared expert, one dense layer through
  ``mlp_only_layers``) at about a million parameters, on the byte tokenizer.
* ``full``: Qwen3-30B-A3B as published.
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

TINY: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [0],
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

# Qwen3-30B-A3B as published at https://huggingface.co/Qwen/Qwen3-30B-A3B (config.json).
FULL: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": 151936,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "hidden_act": "silu",
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 48,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "use_cache": True,
    "dtype": "bfloat16",
}

# ``small``: tiny's layers at hidden 512, where a step's matmuls dominate on a CPU core
# (bench/utilisation.py)
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 384,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "full": FULL}


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts: ``num_experts`` in published configs, ``num_local_experts`` in the
    ones transformers v5 writes."""
    return hf.get("num_experts", hf.get("num_local_experts", 128))


def moe_layer_flags(hf: dict[str, Any]) -> list[bool]:
    """HF Qwen3-MoE's rule: a layer is MoE unless listed in ``mlp_only_layers``, when it has
    experts and (layer + 1) is a multiple of ``decoder_sparse_step``."""
    n = hf.get("num_hidden_layers", 48)
    dense = set(hf.get("mlp_only_layers") or [])
    step, experts = hf.get("decoder_sparse_step", 1), num_experts(hf)
    return [i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)]
