"""GGUF files written as llama.cpp writes them, for the GGUF tests (no file from the internet).

:func:`write_llama` turns a transformers ``LlamaForCausalLM`` into a GGUF file the way
llama.cpp's ``convert_hf_to_gguf.py`` does: the ``llama.*`` metadata, a byte-level BPE
tokenizer (``gpt2``) with ChatML's special tokens and chat template, the tensors under
GGUF's names (``blk.N.attn_q.weight``...) with q and k rows permuted to llama.cpp's rotary
layout, each tensor stored as F32 or quantized (``gguf.quants``). So a conversion back to
an HF folder has to undo exactly what a real file does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_vocab() -> list[str]:
    """GPT-2's 256 byte symbols, then the special tokens: vocabulary size 259."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return [bytes_to_unicode()[b] for b in range(256)] + SPECIAL


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (its rotary pairs adjacent), as convert_hf_to_gguf.py writes it."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: Any) -> dict[str, np.ndarray]:
    """The model's weights under GGUF's names, q/k permuted (a tied head is not written)."""
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    if not c.tie_word_embeddings:
        out["output.weight"] = sd["lm_head.weight"]
    names = {"self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        out[f"blk.{i}.attn_q.weight"] = _permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads)
        out[f"blk.{i}.attn_k.weight"] = _permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads)
        for hf, g in names.items():
            out[f"blk.{i}.{g}.weight"] = sd[p + hf + ".weight"]
    return out


def write_llama(path: Path, model: Any, *, quant: str = "F32", arch: str = "llama", name: str = "tiny-llama",
                raw: dict[str, str] | None = None) -> Path:
    """Write ``model`` (a transformers LlamaForCausalLM over :func:`byte_vocab`) as a GGUF file.
    ``quant``: the type of every 2D weight (F32, F16, Q8_0, Q4_0...; norms stay F32);
    ``raw``: tensor name -> a type written as raw bytes of the right size (zeros), for types
    the gguf package cannot quantize."""
    import gguf

    c = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    tokens = byte_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3] * len(SPECIAL))
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(tokens.index("<|im_start|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_pad_token_id(tokens.index("<|im_end|>"))
    w.add_chat_template(CHATML)
    qtype = gguf.GGMLQuantizationType[quant]
    for tname, t in gguf_tensors(model).items():
        if raw and tname in raw:
            rtype = gguf.GGMLQuantizationType[raw[tname]]
            block, nbytes = gguf.GGML_QUANT_SIZES[rtype]
            data = np.zeros((t.shape[0], t.shape[1] // block * nbytes), dtype=np.uint8)
            w.add_tensor(tname, data, raw_dtype=rtype)
        elif t.ndim == 2 and qtype not in (gguf.GGMLQuantizationType.F32,):
            w.add_tensor(tname, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(tname, t.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_llama(*, tied: bool = True, seed: int = 0, hidden: int = 256) -> Any:
    """A random transformers Llama over the byte vocabulary (hidden 256: Q8_0/Q4_0 blocks of 32 fit)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=len(byte_vocab()), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=tied, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        bos_token_id=len(byte_vocab()) - 2, eos_token_id=len(byte_vocab()) - 1)
    return transformers.LlamaForCausalLM(config).eval()
