"""The HF ``config.json`` of each Kimi K2 preset (plain dicts: importing this module is free).

* ``tiny``: the architecture and code paths of Kimi K2 (MLA with q/kv LoRA, YaRN RoPE
  with its softmax mscale, a dense first layer, sigmoid-routed MoE with a shared expert)
  shrunk to about a million parameters; its vocabulary is the byte tokenizer of
  :mod:`primerl.tokenizer`. ``model_type`` is ``deepseek_v3`` so that transformers builds
  it without remote code.
* ``full``: Kimi K2 as published (1T total / 32B active parameters).
* ``tiny-vllm``: ``tiny`` with Kimi K2's MLA latent width (512 + 64), which vLLM's CPU
  kernel needs.
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

TINY: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
    "n_routed_experts": 12,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_interleave": True,
    # Kimi K2's YaRN (factor 32 over 4096) scaled down: the long-context path is exercised
    "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 1024,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

# Kimi K2 as published at https://huggingface.co/moonshotai/Kimi-K2-Instruct (config.json;
# K2-Thinking and K2.5's text model have the same sizes). The checkpoint's model_type is
# "kimi_k2" with remote code for transformers' DeepseekV3 classes; the adapter reads both
# "kimi_k2" and "deepseek_v3". The published weights are block-FP8 (K2-Instruct) or INT4
# (K2-Thinking): dequantise them to bf16 before loading (quantized loading is not done).
FULL: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "kimi_k2",
    "vocab_size": 163840,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "n_routed_experts": 384,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
        "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "use_cache": True,
    "dtype": "bfloat16",
}

# ``tiny`` with the MLA latent of the real model (kv_lora_rank 512 + qk_rope_head_dim 64 =
# 576), the one width vLLM's CPU MLA kernel serves: the preset the vllm inference backend
# picks on CPU (docs/vllm.md). About 2.2M parameters; everything else as ``tiny``.
TINY_VLLM: dict[str, Any] = {**TINY, "kv_lora_rank": 512, "qk_rope_head_dim": 64}

# ``small``: tiny's layers at hidden 512 (about 22M parameters, 10M active a token), where a
# step's matmuls dominate on a CPU core (bench/utilisation.py)
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 384,
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
    "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "v_head_dim": 64,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "full": FULL, "tiny-vllm": TINY_VLLM}


def moe_layer_flags(hf: dict[str, Any]) -> list[bool]:
    """Which layers are MoE: every layer from ``first_k_dense_replace`` on (HF DeepseekV3)."""
    n = hf.get("num_hidden_layers", 61)
    n_dense = min(hf.get("first_k_dense_replace", 1), n)
    return [i >= n_dense for i in range(n)]
