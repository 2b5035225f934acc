"""The HF ``config.json`` of each Llama preset (plain dicts: importing this module is free).

* ``tiny``: Llama's architecture (GQA, SwiGLU MLPs, RoPE with Llama 3's frequency scaling)
  at about a million parameters, on the byte tokenizer.
* ``small``: the same layers at hidden 640 (about 30M parameters), where a step's matmuls
  dominate on a CPU core (bench/utilisation.py).
* ``135m``: SmolLM2-135M's shape (30 layers, hidden 576, 9 query / 3 key-value heads, tied
  embeddings), the shape of the packaged checkpoint ``smollm2-135m-instruct``.
* ``1b``, ``8b``: Llama-3.2-1B and Llama-3.1-8B as published.
* ``full``: Llama-3.1-405B as published, the largest Llama.
"""

from __future__ import annotations

from typing import Any

from primerl.tokenizer import PADDED_VOCAB_SIZE, TOKEN_IDS

# Llama 3.1's long-context RoPE: low frequencies interpolated by `factor`, a smooth ramp
# between the low and high frequency wavelengths (HF's rope_type "llama3")
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}

TINY: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": PADDED_VOCAB_SIZE,  # the byte tokenizer's 263 tokens -> 320 rows
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    # the llama3 frequency ramp over a short original context, so tiny runs that code path
    "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 10000.0, "original_max_position_embeddings": 256},
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    **TOKEN_IDS,
    "use_cache": True,
    "dtype": "float32",
}

SMALL: dict[str, Any] = {
    **TINY, "hidden_size": 640, "intermediate_size": 1920, "num_attention_heads": 10,
    "num_key_value_heads": 5, "head_dim": 64,
}


def _published(hidden: int, inter: int, layers: int, heads: int, tied: bool, rope_factor: float) -> dict[str, Any]:
    """A Llama 3.x config.json as Meta publishes them (8 key/value heads of 128, 128k positions)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "rope_scaling": {k: v for k, v in {**LLAMA3_ROPE, "factor": rope_factor}.items() if k != "rope_theta"},
        "rms_norm_eps": 1e-5,
        "initializer_range": 0.02,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": tied,
        "bos_token_id": 128000,
        "eos_token_id": 128001,
        "use_cache": True,
        "dtype": "bfloat16",
    }


# https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct (config.json)
SMOLLM2_135M: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.041666666666666664,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "use_cache": True,
    "dtype": "bfloat16",
}

# https://huggingface.co/meta-llama/Llama-3.2-1B, Llama-3.1-8B and -405B (config.json)
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": TINY,
    "small": SMALL,
    "135m": SMOLLM2_135M,
    "1b": _published(2048, 8192, 16, 32, tied=True, rope_factor=32.0),
    "8b": _published(4096, 14336, 32, 32, tied=False, rope_factor=8.0),
    "full": _published(16384, 53248, 126, 128, tied=False, rope_factor=8.0),
}
