"""LoRA (``[trainer.lora]``): the trainer trains low-rank adapters, the model's own weights stay.

Why: most users with few GPUs post-train this way; the optimizer's state is the adapters'
only (two AdamW moments of ``r x (in + out)`` numbers per wrapped linear instead of
``in x out``), and gradients of the frozen weights are never computed.

* :func:`apply_lora` wraps every selected ``nn.Linear`` of a model (built by any model
  plugin, ``hf`` included) in :class:`LoRALinear`, which keeps the linear's ``weight`` and
  ``bias`` under their names (frozen) and adds ``lora_A.weight`` [r, in] (PEFT's init)
  and ``lora_B.weight`` [out, r] (zeros): ``y = x W^T + b + (alpha / r) x A^T B^T``.
  Selected: the linears whose name ends with one of ``target_modules``, by default every
  linear but the output head and routers (``gate``). Experts held as fused 3D tensors
  are not linears and stay frozen.
* Inference gets merged weights (``W + (alpha / r) B A``) through the usual channels
  (:func:`merged`), so every backend serves a LoRA run unchanged.
* Checkpoints hold the frozen weights as before plus ``adapter/`` in PEFT's format
  (``adapter_config.json`` + ``adapter_model.safetensors``, :func:`write_peft_adapter`):
  ``peft.PeftModel.from_pretrained`` and vLLM's LoRA support load it as it is, and a resume
  loads it back (:func:`load_adapter`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from torch import nn

from primerl.errors import PrimerlError

ADAPTER_DIR = "adapter"  # a checkpoint's PEFT adapter folder
PEFT_PREFIX = "base_model.model."  # PEFT's names: this + the model's module name
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")


class LoRALinear(nn.Module):
    """An ``nn.Linear`` plus a low-rank update; ``weight`` and ``bias`` keep their names."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight  # [out, in], frozen
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        kw = {"dtype": torch.float32, "device": base.weight.device}
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, **kw)  # [r, in]
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, **kw)  # [out, r]
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))  # as PEFT: B = 0, so the model starts unchanged
        nn.init.zeros_(self.lora_B.weight)
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(out.dtype) * self.scale


def lora_modules(model: nn.Module) -> dict[str, LoRALinear]:
    """The model's LoRA-wrapped linears, by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def apply_lora(model: nn.Module, rank: int, alpha: float, target_modules: Iterable[str] = ()) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the selected linears (see the module
    docstring); returns the wrapped modules' names. None selected is an error."""
    targets = tuple(target_modules)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head = head if head is not None else getattr(model, "lm_head", None)
    chosen = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear or module is head:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (leaf in targets or any(name.endswith("." + t) for t in targets)) if targets else leaf != "gate":
            chosen.append(name)
    if not chosen:
        raise PrimerlError(f"trainer.lora.target_modules {list(targets)} selects no linear layer of this model: name "
                           f"the last part of the linears' names (e.g. q_proj, o_proj, gate_proj), or leave it empty "
                           f"for every linear but the head and the routers")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), rank, alpha))
    return chosen


def merged(units: Iterator[tuple[str, dict[str, torch.Tensor]]], scale: float
           ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Full-weight units (``Parallelism.full_weights``) with each wrapped linear's weight
    merged (``W + scale * B A``) and its adapter left out: what inference serves."""
    for unit, part in units:
        out = {n: t for n, t in part.items() if not n.endswith(LORA_PARTS)}
        for name in part:
            if name.endswith(".lora_A.weight"):
                base = name.removesuffix(".lora_A.weight")
                a, b = part[name], part[base + ".lora_B.weight"]  # [r, in], [out, r]
                w = out[base + ".weight"]
                out[base + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
        yield unit, out


class Split:
    """Full-weight units split into the frozen weights (:meth:`base`, consumed as pairs) and
    the adapters, collected on the way (``adapters``: model names -> tensors)."""

    def __init__(self, units: Iterator[tuple[str, dict[str, torch.Tensor]]]) -> None:
        self.units, self.adapters = units, {}

    def base(self) -> Iterator[tuple[str, torch.Tensor]]:
        for _unit, part in self.units:
            for name, t in part.items():
                if name.endswith(LORA_PARTS):
                    self.adapters[name] = t.detach().to("cpu").contiguous()
                else:
                    yield name, t


def write_peft_adapter(directory: Path, adapters: dict[str, torch.Tensor], *, rank: int, alpha: float,
                       base_model: str | None) -> Path:
    """``directory/adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's LoRA format."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    modules = sorted({n.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight") for n in adapters})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": modules, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None,
        "init_lora_weights": True, "use_rslora": False, "use_dora": False, "inference_mode": True,
        "base_model_name_or_path": base_model,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({PEFT_PREFIX + n: t for n, t in adapters.items()}, str(directory / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return directory


def load_adapter(model: nn.Module, directory: Path) -> None:
    """A PEFT adapter folder's weights into the model's LoRA linears (resume); every wrapped
    linear must be in it, with the shapes of this run's rank."""
    from safetensors.torch import load_file

    path = Path(directory) / "adapter_model.safetensors"
    if not path.is_file():
        raise PrimerlError(f"{directory} holds no adapter_model.safetensors: this checkpoint was not written by a "
                           f"LoRA run (trainer.lora.rank must stay as it was)")
    tensors = {n.removeprefix(PEFT_PREFIX): t for n, t in load_file(str(path)).items()}
    own = {n: p for n, p in model.named_parameters() if n.endswith(LORA_PARTS)}
    if set(tensors) != set(own) or any(tensors[n].shape != p.shape for n, p in own.items()):
        raise PrimerlError(f"the adapter in {directory} does not fit this run's LoRA layers (other target modules "
                           f"or rank): resume with the [trainer.lora] settings it was written with")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(tensors[n])


def describe(model: nn.Module, wrapped: list[str], rank: int, alpha: float) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"lora: rank {rank}, alpha {alpha:g} on {len(wrapped)} linears; {trainable / 1e6:.3f}M trainable "
            f"parameters of {total / 1e6:.2f}M ({100 * trainable / max(total, 1):.2f}%)")
