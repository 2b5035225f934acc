"""Tensor helpers the core's model modules and the model building blocks share: the
activations of MLPs and experts, tensors derived from weights and kept between decode
steps, and casting a model's floating tensors to a dtype.

Why in the core: the routed experts (:mod:`primerl.models.experts`, which the core's
transforms act on) use them, and so do the blocks the model plugins are built from
(``primerl_blocks``) and the ``hf`` plugin's model. Importing this module imports torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["ACTIVATIONS", "activation", "cast_", "derived", "keeps_derived", "relu2"]


def relu2(x: Tensor) -> Tensor:
    """Squared ReLU (Nemotron-H's MLP activation)."""
    return torch.square(F.relu(x))


ACTIVATIONS = {"silu": F.silu, "relu2": relu2}


def activation(name: str):
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"activation {name!r} is not supported; choose one of {', '.join(ACTIVATIONS)}") from None


def keeps_derived(*sources: Tensor) -> bool:
    """Whether :func:`derived` may keep a tensor built from ``sources`` between calls: not
    with autograd on (gradients must flow to the sources), not for inference tensors (they
    have no version to notice an update by), not while ``torch.compile`` traces (dynamo
    cannot read versions; the graph rebuilds the tensor instead)."""
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or any(t.is_inference() for t in sources))


def derived(owner: nn.Module, name: str, build: Callable[[], Tensor], *sources: Tensor) -> Tensor:
    """A tensor computed from weights (stacked, concatenated) by ``build``. Rebuilt every
    call unless :func:`keeps_derived` (decode steps): then kept on ``owner`` until a source
    changes: a weight update writes in place, which bumps the tensor's version, or swaps
    its storage."""
    if not keeps_derived(*sources):
        return build()
    key = tuple((t.data_ptr(), t._version, t.dtype) for t in sources)
    cache = owner.__dict__.setdefault("_derived", {})
    if name not in cache or cache[name][0] != key:
        cache[name] = (key, build())
    return cache[name][1]


def cast_(model: nn.Module, dtype: torch.dtype, keep_fp32: tuple[str, ...] = ()) -> nn.Module:
    """Cast floating tensors to ``dtype`` in place, keeping names ending in ``keep_fp32``
    in float32."""
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_floating_point():
            t.data = t.data.to(torch.float32 if keep_fp32 and name.endswith(keep_fp32) else dtype)
    return model

