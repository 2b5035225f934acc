"""The HF ``config.json`` of each MiniMax-M2 preset (plain dicts: importing this module is free).

* ``tiny``: MiniMax-M2's architecture (GQA with q/k RMSNorm over the whole projection,
  RoPE on half of each head, sigmoid top-k routing with a score-correction bias over
  experts, no shared expert, every layer MoE) at about a million parameters, on the byte
  tokenizer.
* ``full``: MiniMax-M2 as published (230B parameters, 10B active).
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

TINY: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "rotary_dim": 16,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

# MiniMax-M2 as published at https://huggingface.co/MiniMaxAI/MiniMax-M2 (config.json; its
# three multi-token-prediction modules are not part of the model primerl trains)
FULL: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "vocab_size": 200064,
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "num_hidden_layers": 62,
    "num_attention_heads": 48,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rotary_dim": 64,
    "num_local_experts": 256,
    "num_experts_per_tok": 8,
    "scoring_func": "sigmoid",
    "use_routing_bias": True,
    "use_qk_norm": True,
    "qk_norm_type": "per_layer",
    "hidden_act": "silu",
    "max_position_embeddings": 196608,
    "rope_theta": 5000000,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_dropout": 0.0,
    "router_jitter_noise": 0.0,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "use_mtp": True,
    "num_mtp_modules": 3,
    "mtp_transformer_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 200034,
    "eos_token_id": 200020,
    "use_cache": True,
    "dtype": "bfloat16",
}

# ``small``: tiny's layers at hidden 512 (partial RoPE on half of each 64-wide head), where a
# step's matmuls dominate on a CPU core (bench/utilisation.py)
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 512, "intermediate_size": 384, "num_attention_heads": 8,
    "num_key_value_heads": 4, "head_dim": 64, "rotary_dim": 32,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "full": FULL}


def num_experts(hf: dict[str, Any]) -> int:
    """Routed experts: ``num_local_experts`` (``num_experts`` is transformers' alias)."""
    return int(hf.get("num_local_experts", hf.get("num_experts", 256)))


def rotary_dim(hf: dict[str, Any]) -> int:
    """The rotated dims of each head: published checkpoints say ``rotary_dim``, transformers
    v5 configs ``rope_parameters.partial_rotary_factor``."""
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    if hf.get("rotary_dim"):
        return int(hf["rotary_dim"])
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    return int(head_dim * factor)
