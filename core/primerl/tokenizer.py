"""A byte-level tokenizer built locally, for the tiny model presets.

Why it exists:

* Tiny presets must run anywhere, offline and in CI, so their tokenizer cannot come from
  a download. This one is built in memory from the ``tokenizers`` library in a few
  milliseconds and gives the same ids on every machine and every version.
* It is byte-level with no merges: every UTF-8 byte is one token. Any text round-trips
  exactly, and character-level tasks (reversing a string, counting letters, copying
  digits) are learnable by a small model, because each character is visible as its own
  token(s) instead of being hidden inside BPE merges.

Layout of the vocabulary (``len(tok) == 263``)::

    0..255   the 256 bytes, id == byte value (GPT-2's printable byte alphabet as strings)
    256      <|endoftext|>   eos and pad
    257      [gMASK]         GLM prefix
    258      <sop>           GLM start-of-prompt
    259..262 <|system|> <|user|> <|assistant|> <|observation|>   chat roles

Models pad their embedding table past ``len(tok)`` (to a multiple of 64: 320); the
extra rows are never produced by the tokenizer.

The chat template follows GLM: ``[gMASK]<sop>``, then per message ``<|role|>\\n`` and the
content, then ``<|assistant|>\\n`` when a generation prompt is asked for. The ``tool``
role is written as GLM's ``<|observation|>``. Given ``tools`` (OpenAI function specs), a
``<|system|>`` block lists them as JSON first; an assistant message's ``tool_calls`` are
written the way the model writes them, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(the format the server parses back into ``tool_calls``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerFast

__all__ = ["CHAT_TEMPLATE", "EOS_TOKEN", "EOS_TOKEN_ID", "PADDED_VOCAB_SIZE", "SPECIAL_TOKENS", "TOKEN_IDS",
           "VOCAB_SIZE", "byte_tokenizer"]

EOS_TOKEN = "<|endoftext|>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|observation|>")
SPECIAL_TOKENS = (EOS_TOKEN, "[gMASK]", "<sop>", *ROLE_TOKENS)
NUM_BYTES = 256
VOCAB_SIZE = NUM_BYTES + len(SPECIAL_TOKENS)  # len(byte_tokenizer()) == 263
EOS_TOKEN_ID = NUM_BYTES  # <|endoftext|>, also the pad id
# What every tiny preset's config.json takes from this tokenizer: embedding rows padded to
# a multiple of 64 (263 -> 320), and its special token ids.
PADDED_VOCAB_SIZE = (VOCAB_SIZE + 63) // 64 * 64
TOKEN_IDS = {"bos_token_id": None, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID}

CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- if tools -%}"
    "{{- '<|system|>\\n# Tools\\n<tools>\\n' -}}"
    "{%- for tool in tools -%}{{- (tool.function if tool.function is defined else tool) | tojson -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '</tools>\\nCall: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- set role = 'observation' if message['role'] == 'tool' else message['role'] -%}"
    "{%- if role not in ['system', 'user', 'assistant', 'observation'] -%}"
    "{{- raise_exception('unknown chat role: ' ~ message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' ~ role ~ '|>\\n' -}}"
    "{%- if message['content'] is not none -%}{{- message['content'] -}}{%- endif -%}"
    "{%- if role == 'assistant' and message['tool_calls'] is defined and message['tool_calls'] -%}"
    "{%- for call in message['tool_calls'] -%}"
    "{%- set fn = call.function if call.function is defined else call -%}"
    "{%- set args = fn.arguments if fn.arguments is string else (fn.arguments | tojson) -%}"
    "{{- '<tool_call>{\"name\": \"' ~ fn.name ~ '\", \"arguments\": ' ~ args ~ '}</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)


def _byte_alphabet() -> list[str]:
    """GPT-2's byte -> printable-character table, ordered by byte value (what ByteLevel emits)."""
    from tokenizers import pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # ByteLevel maps printable bytes to themselves and shifts the others to U+0100 onwards,
    # the same table as GPT-2's bytes_to_unicode; rebuild it in byte order.
    printable = list(range(ord("!"), ord("~") + 1))
    printable += list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, shift = [], 0
    for byte in range(NUM_BYTES):
        if byte in printable:
            table.append(chr(byte))
        else:
            table.append(chr(NUM_BYTES + shift))
            shift += 1
    assert sorted(table) == sorted(alphabet), "ByteLevel alphabet changed"
    return table


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """The byte-level tokenizer of the tiny presets (no download, deterministic ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {symbol: byte for byte, symbol in enumerate(_byte_alphabet())}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # No regex split: with no merges, words would be split into single bytes anyway.
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        padding_side="right",
        model_max_length=1 << 30,
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok
