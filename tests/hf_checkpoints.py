"""Tiny checkpoints written by transformers itself, for architectures primerl has no plugin
for (llama, mixtral, gpt_oss) and two it has (qwen3, minimax_m2), each with a tokenizer of
its own: a byte-pair vocabulary trained here on a small corpus, special tokens and a
ChatML chat template, nothing from primerl's byte tokenizer. What ``--model hf`` is tried on.
"""

from __future__ import annotations

from pathlib import Path

ARCHS = ("llama", "mixtral", "gpt_oss", "qwen3", "minimax_m2")
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
EXTRA = {
    "llama": {},
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # one sliding-window layer (window 8) and one full: prompts run past the window
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "qwen3": {},
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2, rotary_dim=8),
}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["Reverse the text character by character.", "Reverse: rivers", "Reverse: apple banana cherry",
          "the quick brown fox jumps over the lazy dog", "system user assistant", "tset a si siht"]


def local_tokenizer():
    """A BPE tokenizer trained on CORPUS (about 400 tokens) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    core.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                  bos_token=None, clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def write_checkpoint(model_type: str, directory: Path, seed: int = 0) -> Path:
    """``directory`` with transformers' save_pretrained of a random ``model_type`` model + tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = local_tokenizer()
    config = AutoConfig.for_model(model_type, **SHAPE, **EXTRA[model_type], vocab_size=len(tok),
                                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None,
                                  tie_word_embeddings=model_type == "qwen3")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # weights larger than the init's, so logits are not all alike
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory
