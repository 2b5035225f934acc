"""The GLM-5 model adapter: presets, building the model, tokenizer, HF checkpoints, MoE layout.

Light at import (no torch, no transformers): ``primerl run --dry-run`` instantiates the
adapter to validate a config. Heavy modules are imported inside the methods.

Checkpoints are HF directories (``config.json`` plus ``model.safetensors`` or shards
listed in ``model.safetensors.index.json``). They are read one shard at a time straight
into our model, never through the HF model, and accept both expert layouts: the fused 3D
tensors of ``GlmMoeDsaForCausalLM.state_dict()`` and the per-expert tensors that GLM-5 is
published in (and that HF ``save_pretrained`` writes). Keys of layers past
``num_hidden_layers`` are skipped: GLM-5 ships its multi-token-prediction layer as
``model.layers.78``. We write the per-expert layout, which HF, vLLM and SGLang all load.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from primerl.models import ModelAdapter, ModelConfig

from primerl_glm5.presets import PRESETS, layer_types, preset_config

if TYPE_CHECKING:  # pragma: no cover
    import torch

    from primerl_glm5.model import Glm5ForCausalLM

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.")
_EXPERT_KEY = re.compile(
    r"(?P<prefix>.*\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight"
)


class Glm5(ModelAdapter):
    """GLM-5 (HF ``glm_moe_dsa``): MLA + DeepSeek sparse attention + sigmoid-routed MoE."""

    name = "glm5"
    Config = ModelConfig
    presets = tuple(PRESETS)

    # -- configuration ---------------------------------------------------------------

    def hf_config(self, preset: str) -> dict[str, Any]:
        return preset_config(preset)

    def config_dict(self, config: ModelConfig) -> dict[str, Any]:
        """The HF config of a run: the checkpoint's ``config.json``, else the preset's."""
        if config.checkpoint is None:
            return self.hf_config(config.preset)
        path = Path(config.checkpoint) / CONFIG_NAME
        try:
            hf = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"checkpoint {config.checkpoint} has no {CONFIG_NAME}") from None
        if hf.get("model_type") != "glm_moe_dsa":
            raise ValueError(f"{path} is a {hf.get('model_type')!r} model, not glm_moe_dsa")
        return hf

    def moe_layout(self, config: ModelConfig) -> dict[str, Any]:
        """Which layers route tokens, among how many experts, and how many per token."""
        hf = self.config_dict(config)
        mlp_types, _ = layer_types(hf)
        return {
            "moe_layers": [i for i, kind in enumerate(mlp_types) if kind == "sparse"],
            "num_experts": hf.get("n_routed_experts", 256),
            "top_k": hf.get("num_experts_per_tok", 8),
        }

    # -- model -----------------------------------------------------------------------

    def build(self, config: ModelConfig, *, device: str = "cpu") -> Glm5ForCausalLM:
        """Our model, from ``config.checkpoint`` or randomly initialised from ``config.seed``."""
        import torch

        from primerl_glm5.model import Glm5Config, Glm5ForCausalLM

        hf = self.config_dict(config)
        with torch.device("meta"):  # allocate once, directly on the target device
            model = Glm5ForCausalLM(Glm5Config.from_hf(hf))
        model.to_empty(device=device)
        model.tie_weights()
        model.cast_(getattr(torch, config.dtype))
        if config.checkpoint is None:
            model.init_weights(config.seed)
        else:
            load_checkpoint(model, config.checkpoint)
        model.hf_config = hf
        return model

    def tokenizer(self, config: ModelConfig) -> Any:
        if config.checkpoint is None:
            from primerl.tokenizer import byte_tokenizer

            return byte_tokenizer()
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(config.checkpoint)

    def load_checkpoint(self, model: Glm5ForCausalLM, directory: str | Path) -> None:
        """Overwrite ``model``'s weights in place from an HF checkpoint (weight updates)."""
        load_checkpoint(model, directory)

    def save_checkpoint(
        self, model: Glm5ForCausalLM, directory: str | Path, tokenizer: Any = None, **kwargs: Any
    ) -> Path:
        """Write an HF checkpoint (see :func:`save_checkpoint`)."""
        return save_checkpoint(model, directory, tokenizer=tokenizer, **kwargs)


# ---------------------------------------------------------------------------------------
# HF checkpoint IO
# ---------------------------------------------------------------------------------------


def _shard_files(directory: Path) -> list[Path]:
    index = directory / INDEX_NAME
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [directory / name for name in sorted(set(weight_map.values()))]
    if (directory / WEIGHTS_NAME).exists():
        return [directory / WEIGHTS_NAME]
    raise FileNotFoundError(f"{directory} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")


def load_checkpoint(model: Glm5ForCausalLM, directory: str | Path) -> None:
    """Copy an HF checkpoint into ``model`` shard by shard (strict: every tensor once).

    Tensors are cast to the dtype of the parameter they fill and moved to its device.
    """
    import torch
    from safetensors import safe_open

    directory = Path(directory)
    n_layers = model.config.num_hidden_layers
    targets: dict[str, torch.Tensor] = dict(model.state_dict(keep_vars=True))
    required = set(targets) - ({"lm_head.weight"} if model.config.tie_word_embeddings else set())
    filled: set[str] = set()
    expert_parts: dict[str, set[tuple[int, str]]] = {}  # fused param -> {(expert, "gate"|"up"|"down")}
    unexpected: list[str] = []

    def copy(name: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.shape != src.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(src.shape)} != model shape {tuple(dst.shape)}")
        with torch.no_grad():
            dst.copy_(src)

    for path in _shard_files(directory):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                layer = _LAYER_KEY.match(key)
                if layer and int(layer.group(1)) >= n_layers:
                    continue  # multi-token-prediction layers are not part of the model
                expert = _EXPERT_KEY.fullmatch(key)
                if expert and key not in targets:
                    prefix, e, proj = expert["prefix"], int(expert["expert"]), expert["proj"]
                    fused = f"{prefix}.down_proj" if proj == "down" else f"{prefix}.gate_up_proj"
                    if fused not in targets:
                        unexpected.append(key)
                        continue
                    dst = targets[fused][e]  # gate_up: [2I, H] (gate rows first); down: [H, I]
                    if proj != "down":
                        half = dst.shape[0] // 2
                        dst = dst[:half] if proj == "gate" else dst[half:]
                    copy(key, dst, f.get_tensor(key))
                    expert_parts.setdefault(fused, set()).add((e, proj))
                elif key in targets:
                    copy(key, targets[key], f.get_tensor(key))
                    filled.add(key)
                else:
                    unexpected.append(key)

    for fused, parts in expert_parts.items():
        want = {"down"} if fused.endswith("down_proj") else {"gate", "up"}
        if parts == {(e, p) for e in range(targets[fused].shape[0]) for p in want}:
            filled.add(fused)
    missing = sorted(required - filled)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not match the model: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )


def _hf_tensors(model: Glm5ForCausalLM):
    """(name, tensor) in HF's published layout: experts split into per-expert linears."""
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name.removesuffix(".gate_up_proj")
            gate, up = t.chunk(2, dim=1)  # [E, I, H] each
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", gate[e]
                yield f"{prefix}.{e}.up_proj.weight", up[e]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def save_checkpoint(
    model: Glm5ForCausalLM,
    directory: str | Path,
    tokenizer: Any = None,
    *,
    max_shard_bytes: int = 5 * 2**30,
) -> Path:
    """Write ``model`` as an HF checkpoint that ``AutoModelForCausalLM.from_pretrained`` loads.

    ``config.json`` (the model's HF config with its dtype), ``model.safetensors`` (or
    shards of at most ``max_shard_bytes`` with ``model.safetensors.index.json``) and, when
    given, the tokenizer's files. Returns the directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    dtype = str(model.dtype).removeprefix("torch.")
    hf = {**getattr(model, "hf_config", {}), **model.config.to_hf(), "dtype": dtype}
    hf.pop("torch_dtype", None)
    if "num_nextn_predict_layers" in hf:
        hf["num_nextn_predict_layers"] = 0  # the MTP layer is not part of our model
    if tokenizer is not None:
        for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
            if hf.get(key) is None and getattr(tokenizer, key, None) is not None:
                hf[key] = getattr(tokenizer, key)
    (directory / CONFIG_NAME).write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")

    # Group tensors into shards, in order, each under max_shard_bytes (a larger tensor
    # gets a shard of its own).
    shards: list[list[tuple[str, Any]]] = [[]]
    size = 0
    for name, t in _hf_tensors(model):
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes

    for stale in [
        directory / INDEX_NAME,
        *directory.glob("model-*-of-*.safetensors"),
        directory / WEIGHTS_NAME,
    ]:
        stale.unlink(missing_ok=True)
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = WEIGHTS_NAME if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: t.detach().to("cpu").contiguous() for name, t in shard}
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")

    if tokenizer is not None:
        tokenizer.save_pretrained(str(directory))
    return directory
