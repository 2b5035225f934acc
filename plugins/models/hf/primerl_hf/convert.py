"""A transformers model's in-memory tensor names <-> its published checkpoint layout.

transformers 5 holds some architectures' weights in another layout than their published
checkpoints (Mixtral's and MiniMax-M2's experts fused into ``experts.gate_up_proj``
[E, 2I, H] where the Hub has ``block_sparse_moe.experts.{e}.w1/w3/w2``, renamed modules,
...), and converts while loading (``conversion_mapping``); ``save_pretrained`` converts back.
The trainer publishes and inference loads weights many times a run, on tensors it already
holds, so both directions run here on a state dict, with transformers' own conversions
for that model: a round trip is exact (tested), and an architecture transformers adds a
conversion for is covered without code here.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch


def to_published(model: Any, state: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """In-memory names and layout (``model.state_dict()``) -> the checkpoint's on the Hub."""
    from transformers.core_model_loading import revert_weight_conversion

    return revert_weight_conversion(model, dict(state))


def to_in_memory(model: Any, state: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A checkpoint's names and layout (published, or already in-memory) -> ``model.state_dict()``'s."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    targets = model.state_dict()
    pending: dict[str, Any] = {}
    for key, tensor in sorted(state, key=lambda kv: dot_natural_key(kv[0])):
        name, pattern = rename_source_key(key, renamings, converters, model.base_model_prefix, targets)
        if pattern is not None:
            transform = pending.setdefault(name, copy.deepcopy(by_pattern[pattern]))
        else:
            transform, pattern = pending.setdefault(name, WeightRenaming(key, name)), key
        transform.add_tensor(name, key, pattern, tensor)
    out: dict[str, torch.Tensor] = {}
    for first, transform in pending.items():
        for name, value in transform.convert(first, model=model, config=model.config).items():
            out[name] = value[0] if isinstance(value, list) else value
    return out


_LAYER = re.compile(r"\.layers\.(\d+)\.")


def published_pairs(model: Any, pairs: Iterable[tuple[str, torch.Tensor]], *, skip: str | None = None
                    ) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`to_published` one decoder layer at a time (a conversion never spans layers), so
    a checkpoint is written while its tensors are gathered; ``skip``: a name left out (a tied head)."""
    group: list[tuple[str, torch.Tensor]] = []
    key: str | None = None
    for name, tensor in pairs:
        if name == skip:
            continue
        m = _LAYER.search(name)
        k = m.group(1) if m else None
        if group and k != key:
            yield from to_published(model, group).items()
            group = []
        group.append((name, tensor))
        key = k
    if group:
        yield from to_published(model, group).items()
