"""The model-adapter contract that model plugins implement.

A model plugin registers a *light* adapter class (``register("glm5",
"primerl_glm5.adapter:Glm5")``). The adapter module itself must not import torch at
module level: ``primerl run --dry-run`` instantiates it to validate the ``[model]``
section. Everything heavy (the torch model, the tokenizer, checkpoint IO) is imported
inside the methods that need it.

The framework talks to models only through this class, so the engine, the trainer and
checkpointing carry no model-specific code.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch


def _check_dtype(_inst: Any, attribute: attrs.Attribute, value: str) -> None:
    allowed = ("float32", "bfloat16", "float16")
    if value not in allowed:
        raise ValueError(f"{attribute.name} must be one of {', '.join(allowed)}, got {value!r}")


def _check_checkpoint(_inst: Any, attribute: attrs.Attribute, value: str | None) -> None:
    import os

    if value is not None and not os.path.isdir(value):
        raise ValueError(
            f"{attribute.name} must be a local HF checkpoint directory (config.json + *.safetensors); "
            f"'{value}' is not a directory"
        )


@attrs.define(kw_only=True)
class ModelConfig:
    """The ``[model]`` section shared by every model plugin (plugins may subclass it)."""

    name: str = "glm5"
    preset: str = "tiny"
    checkpoint: str | None = attrs.field(default=None, validator=_check_checkpoint)
    dtype: str = attrs.field(default="float32", validator=_check_dtype)
    seed: int = 0


class ModelAdapter:
    """Base class of model adapters. Subclasses set ``name``, ``presets`` and implement the hooks.

    Methods a subclass implements:

    * ``hf_config(preset) -> dict``: the HF-style ``config.json`` of a preset.
    * ``build(config, *, device="cpu") -> torch.nn.Module``: our torch implementation with
      the packed/ragged forward described in ``docs/models.md`` (random init for a preset,
      or weights from ``config.checkpoint``).
    * ``tokenizer(config)``: a ``transformers.PreTrainedTokenizerFast`` (built locally for
      presets, read from the checkpoint directory otherwise).
    """

    name: ClassVar[str] = ""
    Config: ClassVar[type[ModelConfig]] = ModelConfig
    presets: ClassVar[tuple[str, ...]] = ("tiny",)

    def hf_config(self, preset: str) -> dict[str, Any]:
        raise NotImplementedError

    def build(self, config: ModelConfig, *, device: str = "cpu") -> torch.nn.Module:
        raise NotImplementedError

    def tokenizer(self, config: ModelConfig) -> Any:
        raise NotImplementedError
