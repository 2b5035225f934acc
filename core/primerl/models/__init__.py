"""The model-adapter contract that model plugins implement.

A model plugin registers a *light* adapter class (``register("glm5",
"primerl_glm5.adapter:Glm5")``). The adapter module itself must not import torch at
module level: ``primerl run --dry-run`` instantiates it to validate the ``[model]``
section. Everything heavy (the torch model, the tokenizer, checkpoint IO) is imported
inside the methods that need it.

The framework talks to models only through this class and the model it builds, a
:class:`primerl.models.contract.CausalLM` (the members the trainer, the engine and the
parallelism plugins call, with the typed plan through which a model declares its layers,
routers and experts), so the engine, the trainer and checkpointing carry no
model-specific code. ``docs/models.md`` ("The model contract") writes both down.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from primerl.models.contract import HFCausalLM

__all__ = ["HFModelAdapter", "ModelAdapter", "ModelCapabilities", "ModelConfig", "plugin_for_model_type"]


def _check_dtype(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    allowed = ("float32", "bfloat16", "float16")
    if value not in allowed:
        raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}, got {value!r}")


def _check_checkpoint(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    """A folder, a file, or what reads as a registered checkpoint's name (looked up in the
    registry when the config is checked: ``primerl.config``)."""
    import os

    from primerl.models.sources import is_checkpoint_name

    if value is None or os.path.isdir(value) or is_checkpoint_name(value):
        return
    if os.path.isfile(value):
        from primerl.models.gguf import is_gguf

        if is_gguf(value):
            return
        raise ValueError(f"{attribute.name}: '{value}' is not a GGUF file (it does not start with 'GGUF'); give a "
                         f"local HF checkpoint directory (config.json + *.safetensors), a .gguf file, or a checkpoint "
                         f"name from `primerl models list`")
    raise ValueError(f"{attribute.name}: '{value}' does not exist; give a local HF checkpoint directory "
                     f"(config.json + *.safetensors), a .gguf file, or a checkpoint name from `primerl models list`")


@attrs.define(kw_only=True)
class ModelConfig:
    """The ``[model]`` section shared by every model plugin (plugins may subclass it)."""

    # the model plugin (register_models): glm5, kimi, nemotron, qwen3-moe...; `primerl
    # plugins list` shows those installed
    name: str = "glm5"
    # one of the plugin's named architectures (e.g. "tiny"), built with random weights and
    # the byte tokenizer; ignored when checkpoint is set
    preset: str = "tiny"
    # the weights to start from: a local HF checkpoint directory (config.json +
    # *.safetensors, tokenizer), a .gguf file (converted once into cache_dir), or the name
    # of a checkpoint an installed package carries (`primerl models list`); None: the
    # preset, randomly initialised
    checkpoint: str | None = attrs.field(default=None, validator=_check_checkpoint)
    # where converted checkpoints (GGUF files) are kept, by content; "": $XDG_CACHE_HOME/primerl
    # or ~/.cache/primerl
    cache_dir: str = ""
    # "float32", "bfloat16" or "float16": what inference serves in unless inference.dtype
    # says otherwise; the trainer always keeps float32 master weights
    dtype: str = attrs.field(default="float32", validator=_check_dtype)
    seed: int = 0  # the random init of a preset's weights (unused with a checkpoint)

    def checkpoint_dir(self) -> Path | None:
        """The HF folder ``checkpoint`` stands for (a GGUF file or a packaged checkpoint
        resolved: :func:`primerl.models.sources.resolve_checkpoint`), or None for a preset."""
        if self.checkpoint is None:
            return None
        from primerl.models.sources import resolve_checkpoint

        return resolve_checkpoint(self.checkpoint, self.cache_dir, log=_say)

    @property
    def pretrained(self) -> bool:
        """Whether the weights come from a checkpoint (not a randomly initialised preset)."""
        return self.checkpoint is not None


def _say(msg: str) -> None:
    import sys

    print(f"[model] {msg}", file=sys.stderr, flush=True)


@attrs.frozen
class ModelCapabilities:
    """What a model plugin supports, read by the config check (an unsupported setting is
    refused in one line before anything starts): the default is a model that supports none."""

    expert_parallel: bool = False  # trainer.parallel.ep > 1: its routed experts can be split over ranks
    context_parallel: bool = False  # trainer.parallel.cp > 1: its rows can be split over ranks
    router_replay: bool = False  # trainer.router_replay: the trainer can route as inference did
    fp8: bool = False  # trainer.fp8: its linears train in block-scaled FP8
    lora: bool = False  # trainer.lora: its projections are nn.Linear modules that adapters can wrap
    # its attention follows the segment ids, not the rows (varlen): the trainer runs each
    # forward's packed rows as one row without padding (masked rows would cost N^2)
    varlen_rows: bool = False


class ModelAdapter:
    """Base class of model adapters: everything the core asks of a model plugin.

    Subclasses set ``name``, ``presets`` and ``Config`` (the class that checks ``[model]``:
    :class:`ModelConfig`, or a subclass with the model's own keys) and implement:

    * ``hf_config(preset) -> dict``: the HF-style ``config.json`` of a preset.
    * ``build(config, *, device="cpu") -> torch.nn.Module``: a
      :class:`~primerl.models.contract.CausalLM` (the packed/ragged forward described in
      ``docs/models.md``; random init for a preset, or weights from ``config.checkpoint``).
    * ``tokenizer(config)``: a ``transformers.PreTrainedTokenizerFast`` (built locally for
      presets, read from the checkpoint directory otherwise).
    * ``save_checkpoint(model, directory, tokenizer=None)``: write an HF checkpoint (the
      trainer publishes every policy version this way).
    * ``load_checkpoint(model, directory)``: overwrite ``model``'s weights in place from an
      HF checkpoint (resume, and weight updates in inference).
    * ``moe_layout(config) -> dict``: ``{"moe_layers": [...], "num_experts": E, "top_k": k}``,
      which layers route tokens among how many experts (empty for a dense model: the default).
    * ``shape(hf, *, seq_len) -> primerl.plan.ModelShape``: what ``primerl plan`` counts for
      an HF config (built with ``primerl.plan``'s building blocks); the default says the
      planner cannot describe this model.
    * ``capabilities(config) -> ModelCapabilities``: what the model supports (expert and
      context parallel, router replay, FP8 training), which the config check reads before
      any process starts; the default is the class's ``supports`` record.

    ``model_types`` lists the HF ``model_type`` values the plugin implements (its
    checkpoints' ``config.json``), so a generic adapter can name the plugin made for a
    checkpoint.

    :class:`HFModelAdapter` implements all of them for HF-compatible architectures.
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[ModelConfig]] = ModelConfig
    presets: ClassVar[tuple[str, ...]] = ("tiny",)
    model_types: ClassVar[tuple[str, ...]] = ()
    supports: ClassVar[ModelCapabilities] = ModelCapabilities()

    def hf_config(self, preset: str) -> dict[str, Any]:
        raise NotImplementedError

    def build(self, config: ModelConfig, *, device: str = "cpu") -> torch.nn.Module:
        raise NotImplementedError

    def tokenizer(self, config: ModelConfig) -> Any:
        raise NotImplementedError

    def save_checkpoint(self, model: torch.nn.Module, directory: Any, tokenizer: Any = None) -> Any:
        raise NotImplementedError

    def load_checkpoint(self, model: torch.nn.Module, directory: Any) -> None:
        raise NotImplementedError

    def moe_layout(self, config: ModelConfig) -> dict[str, Any]:
        """A dense model routes nothing."""
        return {"moe_layers": [], "num_experts": 0, "top_k": 0}

    def shape(self, hf: dict[str, Any], *, seq_len: int = 4096) -> Any:
        """The planner's :class:`primerl.plan.ModelShape` of an HF config."""
        from primerl.errors import PrimerlError

        raise PrimerlError(f"model plugin '{self.name}' does not describe its layers to the planner "
                           f"(ModelAdapter.shape): primerl plan cannot size it")

    def capabilities(self, config: ModelConfig) -> ModelCapabilities:
        """What this model supports under ``config`` (its preset or checkpoint)."""
        return self.supports


class HFModelAdapter(ModelAdapter):
    """A model adapter for HF-compatible architectures: most model plugins need only set
    the class attributes and :meth:`moe_layers`.

    * ``model_types``: the HF ``model_type`` values a checkpoint's ``config.json`` may have;
    * ``preset_configs``: preset name -> HF config dict (light: plain dicts);
    * ``model_class``: lazy ``"module:Class"`` of the torch model, a
      :class:`primerl.models.contract.HFCausalLM` (``primerl_blocks.decoder.DecoderLM``
      is one);
    * ``hf_format()``: the :class:`primerl.models.checkpoint.HFFormat` of its checkpoints.

    Checkpoints are read one tensor at a time into the model built on the ``meta`` device
    and materialised once on the target device: a sharded checkpoint is never loaded whole.
    """

    preset_configs: ClassVar[dict[str, dict[str, Any]]] = {}
    model_class: ClassVar[str] = ""

    # -- configuration (no torch) ------------------------------------------------------

    def hf_config(self, preset: str) -> dict[str, Any]:
        import copy

        try:
            return copy.deepcopy(self.preset_configs[preset])
        except KeyError:
            raise ValueError(
                f"unknown {self.name} preset {preset!r}; choose one of {', '.join(self.preset_configs)}"
            ) from None

    def config_dict(self, config: ModelConfig) -> dict[str, Any]:
        """The HF config of a run: the checkpoint's ``config.json``, else the preset's."""
        if config.checkpoint is None:
            return self.hf_config(config.preset)
        from primerl.models.checkpoint import read_config

        return read_config(config.checkpoint_dir(), self.model_types)

    def moe_layers(self, hf: dict[str, Any]) -> tuple[list[int], int, int]:
        """(indices of the MoE layers, routed experts, experts per token) of an HF config."""
        raise NotImplementedError

    def moe_layout(self, config: ModelConfig) -> dict[str, Any]:
        """Which layers route tokens, among how many experts, and how many per token."""
        layers, experts, top_k = self.moe_layers(self.config_dict(config))
        return {"moe_layers": layers, "num_experts": experts, "top_k": top_k}

    def capabilities(self, config: ModelConfig) -> ModelCapabilities:
        """The class's ``supports``; expert parallel and router replay only where some layer
        routes tokens (a checkpoint without MoE layers has nothing to split or replay)."""
        if self.moe_layout(config)["moe_layers"]:
            return self.supports
        return attrs.evolve(self.supports, expert_parallel=False, router_replay=False)

    def hf_format(self) -> Any:
        from primerl.models.checkpoint import HFFormat

        return HFFormat()

    # -- model -----------------------------------------------------------------------

    def _classes(self) -> Any:
        from primerl.registry import load_target

        return load_target(self.model_class)

    def build(self, config: ModelConfig, *, device: str = "cpu") -> torch.nn.Module:
        """Our model, from ``config.checkpoint`` or randomly initialised from ``config.seed``."""
        hf = self.config_dict(config)
        model = self.build_from_hf(hf, dtype=config.dtype, seed=None if config.checkpoint else config.seed,
                                   device=device)
        if config.checkpoint is not None:
            self.load_checkpoint(model, config.checkpoint_dir())
        return model

    def build_from_hf(self, hf: dict[str, Any], *, dtype: str = "float32", seed: int | None = 0,
                      device: str = "cpu") -> HFCausalLM:
        """Our model for an HF config dict; random weights from ``seed`` (None: uninitialised)."""
        import torch

        cls = self._classes()
        with torch.device("meta"):  # allocate once, directly on the target device
            model = cls(cls.Config.from_hf(hf))
        model.to_empty(device=device)
        model.tie_weights()
        model.cast_({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])
        if seed is not None:
            model.init_weights(seed)
        model.hf_config = hf
        return model

    def tokenizer(self, config: ModelConfig) -> Any:
        if config.checkpoint is None:
            from primerl.tokenizer import byte_tokenizer

            return byte_tokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.checkpoint_dir())

    def load_checkpoint(self, model: HFCausalLM, directory: Any) -> None:  # type: ignore[override]
        """Overwrite ``model``'s weights in place from an HF checkpoint (also weight updates)."""
        import json
        from pathlib import Path

        from primerl.models.checkpoint import (
            CONFIG_NAME,
            fp8_block_size,
            load_checkpoint,
        )

        c = model.config
        path = Path(directory) / CONFIG_NAME
        hf = json.loads(path.read_text()) if path.exists() else {}
        load_checkpoint(model, directory, self.hf_format(), num_layers=c.num_hidden_layers,
                        tied=c.tie_word_embeddings, fp8_block=fp8_block_size(hf) or 128)

    def save_checkpoint(self, model: HFCausalLM, directory: Any, tokenizer: Any = None,  # type: ignore[override]
                        **kwargs: Any) -> Any:
        """Write an HF checkpoint (see :func:`primerl.models.checkpoint.save_checkpoint`)."""
        from primerl.models.checkpoint import save_checkpoint

        hf = {**model.hf_config, **model.config.to_hf()}
        if "num_nextn_predict_layers" in hf:
            hf["num_nextn_predict_layers"] = 0  # multi-token-prediction layers are not part of our model
        return save_checkpoint(model, directory, hf, self.hf_format(), tokenizer=tokenizer,
                               tied=model.config.tie_word_embeddings, **kwargs)


def plugin_for_model_type(model_type: str | None, registry: Any = None, *, exclude: str = "hf") -> str | None:
    """The installed model plugin that implements ``model_type`` itself (its adapter's
    ``model_types``), if any; ``exclude``: a plugin not to name (the generic one)."""
    if not model_type:
        return None
    from primerl.registry import get_registry

    reg = registry or get_registry()
    for component in reg.of_kind("model"):
        if component.name == exclude or component.error is not None:
            continue
        try:
            if model_type in component.load().model_types:
                return component.name
        except Exception:  # noqa: BLE001 - a broken plugin is reported by `plugins list`, not here
            continue
    return None
