"""The HF ``config.json`` of each GLM-5 preset (plain dicts: importing this module is free).

* ``tiny``: the same architecture and code paths as the real model (MLA with q/kv LoRA,
  the DSA indexer with both "full" and "shared" indexer layers, a dense first layer,
  sigmoid-routed MoE with a shared expert), shrunk to about a million parameters so a
  forward pass takes milliseconds on a CPU. ``index_topk`` is 32, so any sequence longer
  than 32 tokens goes through the sparse top-k attention path. Its vocabulary is the
  byte tokenizer of :mod:`primerl.tokenizer`, padded to a multiple of 64.
* ``full``: the published GLM-5 (744B total / 40B active parameters).
"""

from __future__ import annotations

import copy
from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

TINY: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "first_k_dense_replace": 1,  # layer 0 dense, layers 1-3 MoE
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 64,
    "kv_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 32,
    "qk_head_dim": 48,
    "head_dim": 16,
    "v_head_dim": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    # 16 indexer heads, not 2: each head's score is relu(q.k), so with few heads many keys
    # score exactly 0 (all heads negative: 1 in 4 keys with 2 heads) and the top-k cut
    # falls inside a tie, where torch.topk's pick is arbitrary and HF's result depends on
    # the padded length. With 16 heads exact ties are ~1e-5 per key (GLM-5 has 32).
    "index_n_heads": 16,
    "index_head_dim": 32,
    "index_topk": 32,
    # Layers 1 and 3 reuse the top-k of the layer before them (GLM's IndexCache sharing).
    "indexer_types": ["full", "shared", "full", "shared"],
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

# GLM-5 as published at https://huggingface.co/zai-org/GLM-5 (config.json). The sizes are
# the defaults of transformers' GlmMoeDsaConfig, whose docstring cites zai-org/GLM-5
# (transformers/models/glm_moe_dsa/configuration_glm_moe_dsa.py); the token ids,
# rope_theta and max_position_embeddings are those of the published config.json. GLM-5
# runs the indexer on every layer (no "shared" layers). The checkpoint also holds one MTP
# layer (model.layers.78, num_nextn_predict_layers=1) that the loader skips.
FULL: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "first_k_dense_replace": 3,
    "mlp_layer_types": ["dense"] * 3 + ["sparse"] * 75,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "qk_head_dim": 256,
    "head_dim": 64,
    "v_head_dim": 256,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 2048,
    "indexer_types": ["full"] * 78,
    "num_nextn_predict_layers": 1,
    "hidden_act": "silu",
    "max_position_embeddings": 202752,
    "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    "eos_token_id": [154820, 154827, 154829],  # <|endoftext|>, <|user|>, <|observation|>
    "pad_token_id": 154820,
    "use_cache": True,
    "dtype": "bfloat16",
}

# ``small``: tiny's layers at hidden 512 (about 22M parameters, 11M active a token), so
# that a step's matmuls, not per-op overhead, take most of its time on a CPU core
# (bench/utilisation.py measures how much of the machine the loop uses on it).
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 512, "intermediate_size": 1536, "moe_intermediate_size": 384,
    "num_attention_heads": 8, "num_key_value_heads": 8, "q_lora_rank": 256, "kv_lora_rank": 128,
    "qk_rope_head_dim": 32, "qk_nope_head_dim": 64, "qk_head_dim": 96, "head_dim": 32, "v_head_dim": 64,
    "index_head_dim": 64,
}

PRESETS: dict[str, dict[str, Any]] = {"tiny": TINY, "small": SMALL, "full": FULL}


def preset_config(preset: str) -> dict[str, Any]:
    """A fresh copy of a preset's HF config dict."""
    try:
        return copy.deepcopy(PRESETS[preset])
    except KeyError:
        raise ValueError(f"unknown glm5 preset {preset!r}; choose one of {', '.join(PRESETS)}") from None


def layer_types(hf: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(mlp_layer_types, indexer_types) of an HF config, derived as ``GlmMoeDsaConfig`` does
    when the lists are absent: ``first_k_dense_replace`` dense layers then MoE; the indexer
    pattern from ``index_topk_pattern`` or ``index_topk_freq``/``index_skip_topk_offset``."""
    n = hf.get("num_hidden_layers", 78)
    mlp = hf.get("mlp_layer_types")
    if mlp is None:
        n_dense = min(hf.get("first_k_dense_replace", 3), n)
        mlp = ["dense"] * n_dense + ["sparse"] * (n - n_dense)
    indexer = hf.get("indexer_types")
    pattern = hf.get("index_topk_pattern")
    if indexer is None and pattern is not None:
        indexer = [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else pattern
    if indexer is None:
        freq = max(hf.get("index_topk_freq", 1), 1)
        offset = hf.get("index_skip_topk_offset", 2)
        indexer = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    return list(mlp), list(indexer)
