"""LoRA (``[trainer.lora]``): the trainer trains low-rank adapters, the model's own weights stay.

Why: most users with few GPUs post-train this way; the optimizer's state is the adapters'
only (two AdamW moments of ``r x (in + out)`` numbers per wrapped linear instead of
``in x out``), and gradients of the frozen weights are never computed.

* :func:`apply_lora` wraps every selected ``nn.Linear`` of a model (a
  :class:`primerl.models.contract.CausalLM` built by any model plugin, ``hf`` included) in
  :class:`LoRALinear`, which keeps the linear's ``weight`` and
  ``bias`` under their names (frozen) and adds ``lora_A.weight`` [r, in] (PEFT's init)
  and ``lora_B.weight`` [out, r] (zeros): ``y = x W^T + b + (alpha / r) x A^T B^T``.
  Selected: the linears whose name ends with one of ``target_modules``, by default every
  linear but the routers (``gate``), the output head (the plan's ``head``) included unless
  the plan says it is tied to the input embeddings (on a small model much of what RL changes is in the head: the quick
  start's reward rise is 0.12-0.16 without it, above 0.2 with it).
* Routed experts held as fused 3D tensors (the plan's ``experts``, each a
  :class:`primerl.models.experts.Experts`: ``gate_up_proj`` [E, out, in], ``down_proj``)
  get an adapter per expert, as PEFT's
  ``target_parameters`` does: ``A`` [E*r, in] and ``B`` [out, r*E] (registered as
  ``lora_<param>_A`` / ``_B``), and the module reads ``W[e] + (alpha / r) B_e A_e``
  (:func:`adapt_experts`).
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
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from primerl.errors import PrimerlError
from primerl.models.contract import CausalLM

__all__ = [
    "ADAPTER_DIR",
    "LoRAExperts",
    "LoRALinear",
    "Split",
    "adapt_experts",
    "apply_lora",
    "describe",
    "expert_delta",
    "is_adapter",
    "load_adapter",
    "lora_modules",
    "merged",
    "write_peft_adapter",
]

ADAPTER_DIR = "adapter"  # a checkpoint's PEFT adapter folder
PEFT_PREFIX = "base_model.model."  # PEFT's names: this + the model's module name
LORA_PARTS = (".lora_A.weight", ".lora_B.weight")
_EXPERT_ADAPTER = re.compile(r"\.lora_(\w+)_(A|B)$")  # an expert module's adapter: lora_<param>_A / _B


def is_adapter(name: str) -> bool:
    """Whether a parameter name is an adapter's (a linear's or an expert module's)."""
    return name.endswith(LORA_PARTS) or _EXPERT_ADAPTER.search(name) is not None


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
        self.scale, self.rank = alpha / rank, rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        return out + self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))).to(out.dtype) * self.scale


class LoRAExperts:
    """Mixed into an adapted :class:`~primerl.models.experts.Experts` (its class swapped, so
    every path that reads its 3D weights reads the adapted ones): ``adapted`` lists its
    adapted parameters, in PEFT's nesting order (the in-projection first)."""

    adapted: tuple[str, ...]
    scale: float
    rank: int
    _during: dict[str, torch.Tensor] | None = None  # this forward's adapted weights, each computed once

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._during = {n: self.effective(n) for n in self.adapted}  # read many times (shapes, per expert)
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._during = None

    def weight(self, name: str) -> torch.Tensor:
        return self._during[name] if self._during is not None else self.effective(name)

    def effective(self, name: str) -> torch.Tensor:
        """``W + scale * delta``: [E, out, in]."""
        w = self._parameters[name]  # [E, out, in]
        delta = expert_delta(self._parameters[f"lora_{name}_A"], self._parameters[f"lora_{name}_B"], w.shape[0])
        return w + (self.scale * delta).to(w.dtype)


def expert_delta(a: torch.Tensor, b: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Per-expert ``B_e A_e`` from PEFT's layout: a [E*r, in], b [out, r*E] -> [E, out, in]."""
    r = a.shape[0] // n_experts
    return torch.einsum("ore,eri->eoi", b.view(b.shape[0], r, n_experts), a.view(n_experts, r, a.shape[-1]))


def _adapted_class(cls: type, names: tuple[str, ...]) -> type:
    props = {n: property(lambda self, n=n: self.weight(n)) for n in names}
    return type(f"LoRA{cls.__name__}", (LoRAExperts, cls), props)


def adapt_experts(module: nn.Module, rank: int, alpha: float) -> None:
    """Per-expert adapters on ``module``'s 3D weights (in-projection, then ``down_proj``)."""
    from primerl.models.experts import Experts

    if not isinstance(module, Experts):
        raise PrimerlError(f"trainer.lora: {type(module).__name__} is declared as routed experts but is not a "
                           f"primerl.models.experts.Experts module: its experts cannot take adapters")
    names = module.projections
    for n in names:
        w = module._parameters[n]  # [E, out, in]
        E, out, inp = w.shape
        w.requires_grad_(False)
        a = torch.empty(E * rank, inp, dtype=torch.float32, device=w.device)
        for e in range(E):  # as PEFT: each expert's A like a linear's, B at zero
            nn.init.kaiming_uniform_(a[e * rank:(e + 1) * rank], a=math.sqrt(5))
        module.register_parameter(f"lora_{n}_A", nn.Parameter(a))
        module.register_parameter(f"lora_{n}_B", nn.Parameter(torch.zeros(out, rank * E, device=w.device)))
    module.__class__ = _adapted_class(type(module), names)
    module.adapted, module.scale, module.rank = names, alpha / rank, rank


def lora_modules(model: nn.Module) -> dict[str, LoRALinear | LoRAExperts]:
    """The model's adapted modules (linears and expert modules), by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAExperts))}


def apply_lora(model: CausalLM, rank: int, alpha: float, target_modules: Iterable[str] = (), *,
               experts: bool = True) -> list[str]:
    """Freeze every parameter of ``model`` and wrap the selected linears and, with
    ``experts``, adapt the routed-expert modules its plan declares (see the module
    docstring); returns the adapted modules' names. None selected is an error."""
    plan = model.parallel_plan()
    targets = tuple(target_modules)
    head, tied = model.get_submodule(plan.head), plan.tied_embeddings
    chosen = []
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if not ((leaf in targets or any(name.endswith("." + t) for t in targets)) if targets else leaf != "gate"):
            continue
        if module is head and tied:  # one matrix is both: an adapter of the head would change the embeddings
            if targets:
                raise PrimerlError(f"trainer.lora.target_modules names the output head {name!r}, whose weight is "
                                   f"tied to the input embeddings: leave it out of target_modules")
            continue
        chosen.append(name)
    expert_modules = list(plan.experts) if experts else []
    expert_modules = [n for n in expert_modules
                      if not targets or any(n.endswith("." + t) or n == t for t in targets)]
    if not chosen and not expert_modules:
        raise PrimerlError(f"trainer.lora.target_modules {list(targets)} selects no linear layer of this model: name "
                           f"the last part of the linears' names (e.g. q_proj, o_proj, gate_proj; experts: the routed "
                           f"experts), or leave it empty for every linear but the routers")
    for p in model.parameters():
        p.requires_grad_(False)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(model.get_submodule(name), rank, alpha))
    for name in expert_modules:
        adapt_experts(model.get_submodule(name), rank, alpha)
    return chosen + expert_modules


def merged(units: Iterator[tuple[str, dict[str, torch.Tensor]]], scale: float
           ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Full-weight units (``Parallelism.full_weights``) with each wrapped linear's weight
    merged (``W + scale * B A``) and its adapter left out: what inference serves."""
    for unit, part in units:
        out = {n: t for n, t in part.items() if not is_adapter(n)}
        for name in part:
            if name.endswith(".lora_A.weight"):
                base = name.removesuffix(".lora_A.weight")
                a, b = part[name], part[base + ".lora_B.weight"]  # [r, in], [out, r]
                w = out[base + ".weight"]
                out[base + ".weight"] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
            elif (m := _EXPERT_ADAPTER.search(name)) and m.group(2) == "A":
                module, param = name[: m.start()], m.group(1)
                a, b = part[name], part[f"{module}.lora_{param}_B"]  # [E*r, in], [out, r*E]
                w = out[f"{module}.{param}"]  # [E, out, in]
                delta = expert_delta(a.float(), b.float(), w.shape[0])
                out[f"{module}.{param}"] = (w.float() + scale * delta).to(w.dtype)
        yield unit, out


class Split:
    """Full-weight units split into the frozen weights (:meth:`base`, consumed as pairs) and
    the adapters, collected on the way (``adapters``: model names -> tensors)."""

    def __init__(self, units: Iterator[tuple[str, dict[str, torch.Tensor]]]) -> None:
        self.units, self.adapters = units, {}

    def base(self) -> Iterator[tuple[str, torch.Tensor]]:
        for _unit, part in self.units:
            for name, t in part.items():
                if is_adapter(name):
                    self.adapters[name] = t.detach().to("cpu").contiguous()
                else:
                    yield name, t


def _peft_name(name: str) -> str:
    """A model's adapter name -> PEFT's: linears as they are; an expert module's in-projection
    nested inside its ``down_proj`` (PEFT wraps ``target_parameters`` in the order given)."""
    m = _EXPERT_ADAPTER.search(name)
    if m is None:
        return PEFT_PREFIX + name
    module, param, part = name[: m.start()], m.group(1), m.group(2)
    inner = ".base_layer" if param != "down_proj" else ""
    return f"{PEFT_PREFIX}{module}{inner}.lora_{part}.weight"


def write_peft_adapter(directory: Path, adapters: dict[str, torch.Tensor], *, rank: int, alpha: float,
                       base_model: str | None) -> Path:
    """``directory/adapter_config.json`` + ``adapter_model.safetensors`` in PEFT's LoRA format."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    linears = sorted({n.removesuffix(".lora_A.weight").removesuffix(".lora_B.weight")
                      for n in adapters if n.endswith(LORA_PARTS)})
    experts: dict[str, list[str]] = {}
    for n in adapters:
        if (m := _EXPERT_ADAPTER.search(n)) and m.group(2) == "A":
            experts.setdefault(n[: m.start()], []).append(m.group(1))
    parameters = [f"{module}.{p}" for module in sorted(experts)
                  for p in sorted(experts[module], key=lambda p: p == "down_proj")]  # in-projection first
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": linears, "target_parameters": parameters or None, "bias": "none",
        "fan_in_fan_out": False, "modules_to_save": None, "init_lora_weights": True, "use_rslora": False,
        "use_dora": False, "inference_mode": True, "base_model_name_or_path": base_model,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({_peft_name(n): t for n, t in adapters.items()}, str(directory / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    return directory


def load_adapter(model: nn.Module, directory: Path) -> None:
    """A PEFT adapter folder's weights into the model's adapters (resume); every adapter
    must be in it, with the shapes of this run's rank."""
    from safetensors.torch import load_file

    path = Path(directory) / "adapter_model.safetensors"
    if not path.is_file():
        raise PrimerlError(f"{directory} holds no adapter_model.safetensors: this checkpoint was not written by a "
                           f"LoRA run (trainer.lora.rank must stay as it was)")
    tensors = load_file(str(path))
    own = {n: p for n, p in model.named_parameters() if is_adapter(n)}
    theirs = {n: tensors.get(_peft_name(n)) for n in own}
    if len(tensors) != len(own) or any(t is None or t.shape != own[n].shape for n, t in theirs.items()):
        raise PrimerlError(f"the adapter in {directory} does not fit this run's LoRA layers (other target modules "
                           f"or rank): resume with the [trainer.lora] settings it was written with")
    with torch.no_grad():
        for n, p in own.items():
            p.copy_(theirs[n])


def describe(model: nn.Module, wrapped: list[str], rank: int, alpha: float) -> str:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    return (f"lora: rank {rank}, alpha {alpha:g} on {len(wrapped)} modules; {trainable / 1e6:.3f}M trainable "
            f"parameters of {total / 1e6:.2f}M ({100 * trainable / max(total, 1):.2f}%)")
