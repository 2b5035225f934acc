"""The model contract: what the trainer, the engine, the parallelism plugins and the core's
model transforms (LoRA, FP8, router balancing) call on a built model.

A model plugin's adapter (:class:`primerl.models.ModelAdapter`) *builds* a model; this
module says what the built model is. :class:`CausalLM` lists its members: the ragged
forward, the slot cache, which layers route tokens, and :meth:`CausalLM.parallel_plan`,
a typed :class:`ParallelPlan` through which the model declares its layout: its decoder
layers (each one unit to shard and to gather), the sequence mixer of each (what context
parallel must split), and each MoE layer's router, routed experts and load-balancing bias
(what expert parallel, FP8, LoRA and the trainer's balancer act on). Nothing in the core
finds those parts by attribute name or module class: it asks the plan, and resolves the
plan's module names on the model it holds (``get_submodule``, ``get_buffer``), which
FSDP2's ``fully_shard`` and the transforms' class swaps leave as they are.

Why here, in the core, and not beside the building blocks (``primerl_blocks``, the
distribution the model plugins build on): the core calls these members, so it owns them;
a model need not be built from the blocks (``primerl_hf`` wraps transformers' modeling
code) to satisfy them. Light at import: no torch.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple, Protocol, runtime_checkable

import attrs

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import Tensor

    from primerl.models.batch import LayerCache, SlotCache

__all__ = [
    "CausalLM",
    "HFCausalLM",
    "LayerPlan",
    "Mixer",
    "ModelOutput",
    "MoEPlan",
    "ParallelPlan",
    "check_causal_lm",
    "protocol_members",
]


class ModelOutput(NamedTuple):
    """What :meth:`CausalLM.forward` returns."""

    logits: Tensor  # [B, S, V] (logits_for="all"), [B, V] ("last") or [N, V] (a mask)
    routed_experts: Tensor  # [B, S, n_moe_layers, top_k] int16: the experts each MoE layer used
    router_experts: Tensor  # [B, S, n_moe_layers, top_k] int16: the routers' own top-k choice


class Mixer(enum.Enum):
    """A decoder layer's sequence mixer, as context parallel needs to know it."""

    NONE = "none"  # no sequence mixing: an MLP or MoE layer of its own (Nemotron-H)
    GQA = "gqa"  # grouped-query attention, other tokens' keys read through Batch.keys
    MLA = "mla"  # multi-head latent attention, the latent read through Batch.keys
    MLA_DSA = "mla_dsa"  # MLA with DeepSeek Sparse Attention (the indexer's keys through Batch.keys too)
    MAMBA2 = "mamba2"  # a scan whose state passes from token to token
    OPAQUE = "opaque"  # a mixer the plan does not describe (transformers' own attention)


@attrs.frozen
class MoEPlan:
    """One MoE layer's parts, as module (and buffer) names of the model."""

    router: str  # the router module: its own FSDP unit (float32 on CUDA), trained by router replay
    experts: str  # the routed experts: a primerl.models.experts.Experts (3D weights [E, out, in])
    # the aux-loss-free correction bias (a buffer, [E]) the trainer's balancer moves; None: the
    # router has none (softmax routing)
    bias: str | None = None

    def under(self, prefix: str) -> MoEPlan:
        """The same parts named from a module ``prefix`` up (a layer's plan in the model's)."""
        def full(name: str | None) -> str | None:
            return None if name is None else f"{prefix}.{name}" if prefix else name

        return MoEPlan(full(self.router), full(self.experts), full(self.bias))  # type: ignore[arg-type]


@attrs.frozen
class LayerPlan:
    """One decoder layer: its module name, its sequence mixer, its MoE parts (None: dense)."""

    module: str
    mixer: Mixer
    moe: MoEPlan | None = None


@attrs.frozen
class ParallelPlan:
    """A model's layout as it declares it (:meth:`CausalLM.parallel_plan`)."""

    layers: tuple[LayerPlan, ...]  # every decoder layer, in order
    embeddings: str  # the input embeddings' module name
    head: str  # the output head's module name
    tied_embeddings: bool = False  # the head's weight is the input embeddings' (one tensor)

    @property
    def fsdp_units(self) -> tuple[str, ...]:
        """The modules to shard (and publish) one at a time: each decoder layer, the
        embeddings, the head."""
        return (*(layer.module for layer in self.layers), self.embeddings, self.head)

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Indices of the layers that route tokens (the layer axis of ``routed_experts``)."""
        return tuple(i for i, layer in enumerate(self.layers) if layer.moe is not None)

    def _moe(self) -> list[MoEPlan]:
        return [layer.moe for layer in self.layers if layer.moe is not None]

    @property
    def routers(self) -> tuple[str, ...]:
        """The routers' module names, in MoE-layer order."""
        return tuple(m.router for m in self._moe())

    @property
    def experts(self) -> tuple[str, ...]:
        """The routed experts' module names, in MoE-layer order."""
        return tuple(m.experts for m in self._moe())

    @property
    def router_biases(self) -> tuple[str, ...]:
        """The correction biases' buffer names, in MoE-layer order: one per MoE layer, or
        none when the routers have none."""
        biases = tuple(m.bias for m in self._moe() if m.bias is not None)
        if biases and len(biases) != len(self._moe()):
            raise ValueError("a correction bias on some MoE layers but not others: declare one per MoE layer or none")
        return biases


@runtime_checkable
class CausalLM(Protocol):
    """A built model, as the trainer, the engine and the parallelism plugins use it: a
    ``torch.nn.Module`` (its parameters, ``get_submodule``, ``state_dict`` ...) that also has
    these members. ``docs/models.md`` ("The model contract") describes each.
    """

    # indices of the layers that route tokens, in order: the layer axis of routed_experts and
    # replay_experts (the plan's moe_layers)
    moe_layers: Sequence[int]
    # packed rows: attention one sequence per row when cheaper (False: the masked packed rows);
    # context parallel builds its batches the same way
    unpack_segments: bool

    @property
    def vocab_size(self) -> int:
        """Token ids of a prompt are in [0, vocab_size)."""
        ...

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights (the embeddings')."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        ...

    def forward(self, input_ids: Tensor, positions: Tensor, lengths: Tensor, *,
                segment_ids: Tensor | None = None, prefix_ids: Tensor | None = None,
                cache: SlotCache | None = None, slots: Tensor | range | None = None,
                past_lens: Tensor | None = None, replay_experts: Tensor | None = None,
                logits_for: str | Tensor = "all") -> ModelOutput:
        """One forward over right-padded rows of new tokens (called as ``model(...)``)."""
        ...

    def parallel_plan(self) -> ParallelPlan:
        """The model's layout: units, sequence mixers, routers, experts, biases."""
        ...

    def cache_layout(self) -> list[LayerCache]:
        """Per layer, what its slot cache holds (per-token tensors, per-slot states)."""
        ...

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> SlotCache:
        """An empty cache of ``num_slots`` sequences of up to ``max_len`` tokens each."""
        ...


class _HFConfig(Protocol):
    """The parsed HF config an :class:`HFCausalLM` keeps as ``config``."""

    num_hidden_layers: int
    tie_word_embeddings: bool

    def to_hf(self) -> dict[str, Any]: ...


@runtime_checkable
class HFCausalLM(CausalLM, Protocol):
    """What :class:`primerl.models.HFModelAdapter` builds and checkpoints (its
    ``model_class``): a :class:`CausalLM` built from an HF config dict by
    ``cls(cls.Config.from_hf(hf))`` on the ``meta`` device, then materialised."""

    Config: ClassVar[Any]  # the parsed config class: Config.from_hf(dict) -> config
    config: _HFConfig
    hf_config: dict[str, Any]  # the HF config dict it was built from ({} when built otherwise)

    def tie_weights(self) -> None:
        """Make the head's weight the input embeddings' when the config ties them."""
        ...

    def cast_(self, dtype: torch.dtype) -> Any:
        """Cast floating tensors to ``dtype`` in place (routers may stay float32)."""
        ...

    def init_weights(self, seed: int) -> None:
        """Random weights, reproducible from ``seed`` on any device."""
        ...


def protocol_members(cls: type) -> list[str]:
    """The members a Protocol class declares itself (annotations, methods, properties)."""
    own = vars(cls)
    names = set(own.get("__annotations__", {}))
    names |= {n for n, v in own.items() if not n.startswith("_") and (callable(v) or isinstance(v, property))}
    return sorted(names)


def check_causal_lm(model: Any) -> list[str]:
    """What ``model`` lacks of :class:`CausalLM` and of a plan consistent with itself: empty
    when it satisfies the contract (the structural check the test suite runs on every
    built-in model)."""
    missing = [m for m in protocol_members(CausalLM) if m not in dir(model)]
    if missing:
        return [f"{type(model).__name__} lacks {', '.join(missing)}"]
    plan = model.parallel_plan()
    problems = []
    if not isinstance(plan, ParallelPlan):
        return [f"parallel_plan() returned a {type(plan).__name__}, not a ParallelPlan"]
    if list(plan.moe_layers) != list(model.moe_layers):
        problems.append(f"moe_layers {list(model.moe_layers)} but the plan's MoE layers are {list(plan.moe_layers)}")
    if len(model.cache_layout()) != len(plan.layers):
        problems.append(f"cache_layout() has {len(model.cache_layout())} layers, the plan {len(plan.layers)}")
    modules = dict(model.named_modules())
    buffers = dict(model.named_buffers())
    for name in (*plan.fsdp_units, *plan.routers, *plan.experts):
        if name not in modules:
            problems.append(f"the plan names {name!r}, which is not a module of the model")
    problems += [f"the plan names the bias {b!r}, which is not a buffer of the model"
                 for b in plan.router_biases if b not in buffers]
    return problems
