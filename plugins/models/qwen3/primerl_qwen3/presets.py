"""The HF ``config.json`` of each Qwen3 preset (plain dicts: importing this module is free).

* ``tiny``: Qwen3's architecture (GQA with per-head q/k RMSNorm, SwiGLU MLPs, RoPE) at
  about a million parameters, on the byte tokenizer.
* ``0.6b``, ``8b``: Qwen3-0.6B (tied embeddings) and Qwen3-8B as published.
* ``full``: Qwen3-32B as published, the largest dense Qwen3.
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

TINY: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
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


def _published(hidden: int, inter: int, layers: int, heads: int, tied: bool) -> dict[str, Any]:
    """A Qwen3 config.json as Qwen publishes them (8 key/value heads of 128, 40960 positions)."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": 151936,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
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
        "max_window_layers": layers,
        "tie_word_embeddings": tied,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "use_cache": True,
        "dtype": "bfloat16",
    }


# ``small``: tiny's layers at hidden 768 (about 30M parameters), where a step's matmuls
# dominate on a CPU core (bench/utilisation.py)
SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 768, "intermediate_size": 2304, "num_attention_heads": 12,
    "num_key_value_heads": 4, "head_dim": 64,
}

# https://huggingface.co/Qwen/Qwen3-0.6B, Qwen3-8B and Qwen3-32B (config.json)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY,
    "small": SMALL,
    "0.6b": _published(1024, 3072, 28, 16, tied=True),
    "8b": _published(4096, 12288, 36, 32, tied=False),
    "full": _published(5120, 25600, 64, 64, tied=False),
}
