"""The ``hf`` model: any causal LM transformers loads from a local checkpoint folder, trained
and served through transformers' own modeling code (:class:`primerl_hf.model.TransformersLM`).

Not to be confused with :class:`primerl.models.HFModelAdapter`, the base of primerl's own
model implementations that read and write HF checkpoints: this adapter runs transformers'
classes themselves, for architectures primerl has no plugin for. It is slower than a
plugin made for the architecture (no fused routing, masks built per forward) and cannot
do what needs the model's internals: router replay, expert parallel, context parallel,
FP8. Those are refused at config time, and where a plugin for the checkpoint's
``model_type`` is installed the trainer and the servers say so when they start.

Light at import (no torch, no transformers).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from primerl.models import ModelAdapter, ModelCapabilities, ModelConfig

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


def _say(msg: str) -> None:
    print(f"[model hf] {msg}", file=sys.stderr, flush=True)


class TransformersAdapter(ModelAdapter):
    """transformers' ``AutoModelForCausalLM`` behind primerl's model contract."""

    name = "hf"
    Config = ModelConfig
    presets = ()
    model_types = ()  # any: whatever transformers knows as a causal LM
    supports = ModelCapabilities(lora=True)  # LoRA wraps its linears; the rest needs the model's internals

    # -- configuration (no torch) ---------------------------------------------------------

    def config_dict(self, config: ModelConfig) -> dict[str, Any]:
        """The checkpoint's ``config.json``, checked to be an attention-only causal LM that
        the installed transformers has a class for (ValueError naming what is wrong)."""
        if config.checkpoint is None:
            raise ValueError("--model hf trains a checkpoint you bring: set --model.checkpoint DIR (a local HF "
                             "folder: config.json, *.safetensors, a tokenizer with its chat template)")
        path = config.checkpoint_dir() / "config.json"
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path.parent} has no config.json: not an HF checkpoint folder") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON ({exc})") from None
        model_type = hf.get("model_type")
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
            raise ValueError(f"{path}: model_type {model_type!r} is not a causal LM the installed transformers "
                             f"has a class for (AutoModelForCausalLM); custom modeling code is not run")
        text = hf.get("text_config") or hf
        other = sorted(set(text.get("layer_types") or ()) - set(ATTENTION_LAYER_TYPES))
        if other:
            raise ValueError(f"{path}: layer types {other} keep recurrent state, which --model hf cannot cache: it "
                             f"serves attention-only architectures (full or sliding-window attention)")
        return hf

    def capabilities(self, config: ModelConfig) -> ModelCapabilities:
        self.config_dict(config)  # a checkpoint this adapter cannot run is refused here, before any process starts
        return self.supports

    def moe_layout(self, config: ModelConfig) -> dict[str, Any]:
        """Nothing is reported as routed: the experts are transformers' and train as plain parameters."""
        return {"moe_layers": [], "num_experts": 0, "top_k": 0}

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        from primerl.errors import PrimerlError

        plugin = plugin_for(hf.get("model_type"))
        hint = f"; --model {plugin} describes {hf.get('model_type')!r}" if plugin else ""
        raise PrimerlError(f"model 'hf' runs transformers' modeling code, whose layers the planner cannot "
                           f"describe: primerl plan sizes the models of primerl's plugins{hint}")

    # -- model ----------------------------------------------------------------------------

    def build(self, config: ModelConfig, *, device: str = "cpu") -> Any:
        """transformers' model from the checkpoint, wrapped (:class:`~primerl_hf.model.TransformersLM`)."""
        import torch
        from transformers import AutoModelForCausalLM

        from primerl.errors import PrimerlError
        from primerl_hf.model import TransformersLM

        hf = self.config_dict(config)
        plugin = plugin_for(hf.get("model_type"))
        if plugin is not None:
            _say(f"{config.checkpoint} is a {hf['model_type']!r} model, which primerl's own plugin "
                 f"--model {plugin} implements (faster, and with what it supports of router replay, expert and "
                 f"context parallel, FP8); --model hf runs transformers' modeling code")
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # a progress bar per weight update in the servers' logs otherwise
        try:
            model = AutoModelForCausalLM.from_pretrained(config.checkpoint_dir(), dtype=getattr(torch, config.dtype),
                                                         trust_remote_code=False)
        except (OSError, ValueError) as exc:
            raise PrimerlError(f"transformers cannot load {config.checkpoint}: {exc}") from None
        model.to(device)
        wrapped = TransformersLM(model)
        wrapped.kv_shapes()  # an architecture whose layers keep no keys and values is refused now
        return wrapped

    def tokenizer(self, config: ModelConfig) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.checkpoint_dir())

    def load_checkpoint(self, model: Any, directory: Any) -> None:
        """Overwrite ``model``'s weights in place from an HF checkpoint folder (published or
        in-memory layout): every name and shape is checked before any weight changes."""
        from primerl.weights import apply, iter_safetensors, pair
        from primerl_hf.convert import to_in_memory

        tensors = to_in_memory(model.hf, iter_safetensors(directory))
        tied = _tied(model)
        apply(pair(model, tensors, directory, may_lack=(tied,) if tied else (), target="the model"))

    def save_checkpoint(self, model: Any, directory: Any, tokenizer: Any = None, *, state: Any = None,
                        **kwargs: Any) -> Any:
        """An HF checkpoint folder in the published layout (what transformers' ``save_pretrained``
        writes, so transformers, vLLM and the Hub read it): ``state`` (in-memory names, e.g.
        gathered from FSDP shards) or the model's own weights."""
        from primerl.models.checkpoint import save_checkpoint
        from primerl_hf.convert import published_pairs

        hf = model.config.to_dict()
        hf["architectures"] = [type(model.hf).__name__]
        pairs = model.state_dict().items() if state is None else state
        return save_checkpoint(model, directory, hf, None, tokenizer=tokenizer,
                               published=published_pairs(model.hf, pairs, skip=_tied(model)), **kwargs)

    def hf_format(self) -> Any:
        from primerl.errors import PrimerlError

        raise PrimerlError("model 'hf' publishes weights as checkpoint folders (trainer.weight_channel filesystem "
                           "or shm), not as a stream of renamed tensors (nccl)")


def _tied(model: Any) -> str | None:
    """The head's parameter name when it is the input embedding's (not written, not loaded)."""
    head, embed = model.hf.get_output_embeddings(), model.hf.get_input_embeddings()
    if head is None or head.weight is not embed.weight:
        return None
    return f"{dict((m, n) for n, m in model.named_modules())[head]}.weight"


def plugin_for(model_type: str | None) -> str | None:
    """The installed model plugin that implements ``model_type`` itself, if any."""
    from primerl.models import plugin_for_model_type

    return plugin_for_model_type(model_type)
