"""Any transformers causal LM behind primerl's ragged decoder contract.

Why: primerl's engine and trainer call one model contract
(:class:`primerl.models.contract.CausalLM`: ragged right-padded rows, packed training rows with ``segment_ids`` and prompt trees with
``prefix_ids``, a slot cache for continuous batching, ``logits_for="last"``); transformers'
models offer a dense batch, a 4D attention mask and a ``Cache`` object. This module maps
one onto the other, keeping transformers' modeling code (its attention, norms, RoPE,
experts, logit processing) as the thing that computes:

* masks: the contract's visibility (own segment or prompt tree, causal, row length, a
  layer's sliding window over positions) as one boolean 4D mask per layer type, in the form
  the model's attention implementation takes (boolean for ``sdpa``, additive for
  ``eager``), passed as the ``{"full_attention": ..., "sliding_attention": ...}`` mapping
  when the model mixes layer types;
* the cache: a :class:`~primerl.models.batch.SlotCache` of keys and values
  ``[num_slots, max_len, kv_heads, head_dim]`` per layer (so the KV stores, prefix copies
  and slot swaps of the engine work unchanged), seen by the model through
  :class:`SlotKV`, a transformers ``Cache`` whose layers write each row's new keys at its
  past length and return the rows' cached keys, read in place for consecutive slots;
* the head: logits at each row's last token only (``logits_for="last"``), through the
  model's own ``logits_to_keep``.

State-dict names are transformers' in-memory names (the CausalLM's children are this
module's), so FSDP units, the shm weight channel and optimizer checkpoints name what
transformers names. Nothing routes here: MoE checkpoints train with their routers as
plain parameters, and the contract's routed experts come back empty (router replay and
expert parallel are refused at config time, see :mod:`primerl_hf.adapter`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor, nn

from primerl.errors import PrimerlError
from primerl.models.batch import LayerCache, SlotCache
from primerl.models.contract import LayerPlan, Mixer, ModelOutput, ParallelPlan
from primerl.models.tensors import cast_

ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")


class SlotKVLayer:
    """One layer of :class:`SlotKV`: writes a forward's new keys and values into the slot
    cache and returns every row's keys up to its last new token ``[B, kv_heads, T, head_dim]``."""

    is_sliding = False
    is_compileable = False
    is_initialized = True

    def __init__(self, kv: SlotKV, keys: Tensor, values: Tensor) -> None:
        self.kv, self.keys, self.values = kv, keys, values  # [num_slots, max_len, kv_heads, head_dim]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        """key_states, value_states: [B, kv_heads, S, head_dim], the forward's new tokens."""
        kv = self.kv
        if tuple(key_states.shape[1::2]) != tuple(self.keys.shape[2::]) or \
                tuple(value_states.shape[1::2]) != tuple(self.values.shape[2::]):
            raise PrimerlError(f"the model's attention keys/values are {tuple(key_states.shape)} / "
                               f"{tuple(value_states.shape)}, not the [B, heads, S, dim] its cache was made for")
        rows, cols = kv.written  # the valid new tokens: (row, index) pairs
        at = kv.past[rows] + cols  # [n] their positions in the slot
        slot = kv.slot_ids[rows]
        self.keys[slot, at] = key_states.transpose(1, 2)[rows, cols].to(self.keys.dtype)
        self.values[slot, at] = value_states.transpose(1, 2)[rows, cols].to(self.values.dtype)
        return kv.view(self.keys), kv.view(self.values)

    def get_seq_length(self) -> int:
        return self.kv.total

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.kv.total, 0

    def get_max_length(self) -> int:
        return -1


class SlotKV:
    """The transformers ``Cache`` a cached forward sees: row b's new tokens go to slot
    ``slots[b]`` from position ``past_lens[b]``; it attends to the slot's first
    ``past_lens[b] + i + 1`` positions (the mask says which; ``T`` = the longest row's)."""

    is_compileable = False

    def __init__(self, cache: SlotCache, slots: Tensor | range, past: Tensor, lengths: Tensor) -> None:
        device = past.device
        self.slots = slots
        self.slot_ids = torch.arange(slots.start, slots.stop, device=device) if isinstance(slots, range) else slots
        self.past = past  # [B]
        S = int(lengths.max()) if lengths.numel() else 0
        self.written = (torch.arange(S, device=device)[None, :] < lengths[:, None]).nonzero(as_tuple=True)
        self.total = int((past + lengths).max()) if lengths.numel() else 0  # T
        self.layers = [SlotKVLayer(self, layer["k"], layer["v"]) for layer in cache.per_token]

    def view(self, store: Tensor) -> Tensor:
        """The rows' first T positions of ``store`` as [B, kv_heads, T, head_dim] (in place for a range)."""
        rows = store[self.slots.start:self.slots.stop] if isinstance(self.slots, range) else store[self.slots]
        return rows[:, : self.total].transpose(1, 2)

    # -- what transformers' models call on a Cache ------------------------------------
    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.total

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.total, 0

    def __len__(self) -> int:
        return len(self.layers)


def _as_cache(cls: type) -> type:
    """``cls`` as a subclass of transformers' ``Cache`` too (models check ``isinstance``);
    its own members come first."""
    from transformers.cache_utils import Cache

    return type(cls.__name__, (cls, Cache), {"__init__": cls.__init__})


class _Probe:
    """A Cache that records the shape of every layer's keys and values (one token's forward)."""

    is_compileable = False

    def __init__(self) -> None:
        self.shapes: dict[int, tuple[tuple[int, int], tuple[int, int]]] = {}
        self.layers: list[Any] = []  # what transformers' mask helpers iterate (none to size: the mask is given)

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args: Any, **kwargs: Any):
        self.shapes[layer_idx] = ((key_states.shape[1], key_states.shape[3]),
                                  (value_states.shape[1], value_states.shape[3]))
        return key_states, value_states

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0


class TransformersLM(nn.Module):
    """A transformers ``*ForCausalLM`` behind primerl's model contract
    (:class:`primerl.models.contract.CausalLM`: the forward, cache and plan of primerl's models).

    ``hf`` is the transformers model; its children (``model``, ``lm_head``, ...) become
    this module's, so parameter names are transformers' own.
    """

    moe_layers: list[int] = []  # nothing is routed: MoE checkpoints train their routers as plain parameters
    unpack_segments = False  # packed rows are masked rows (transformers' attention takes a 4D mask)
    keep_fp32: tuple[str, ...] = ()

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        for name, child in hf.named_children():
            self.add_module(name, child)
        object.__setattr__(self, "hf", hf)  # not a child: its modules are ours already
        self.config = hf.config
        self.text_config = text = hf.config.get_text_config()
        self.num_layers = text.num_hidden_layers
        self.layer_types = list(getattr(text, "layer_types", None) or [])
        self.sliding_window = getattr(text, "sliding_window", None)
        if not self.layer_types:
            self.layer_types = ["sliding_attention" if self.sliding_window else "full_attention"] * self.num_layers
        impl = getattr(hf.config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise PrimerlError(f"the hf model runs attention as 'sdpa' or 'eager', not {impl!r}")
        self.attn_implementation = impl
        params = inspect.signature(hf.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._kv_shapes: list[tuple[tuple[int, int], tuple[int, int]]] | None = None
        self._slot_kv, self._probe = _as_cache(SlotKV), _as_cache(_Probe)

    # -- what the trainer, the engine and the parallelism plugins read ---------------------

    @property
    def vocab_size(self) -> int:
        return self.text_config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.hf.get_input_embeddings().weight.device

    def decoder_layers(self) -> list[nn.Module]:
        """The model's decoder layers: the modules of the classes it says must not be split."""
        kinds = set(getattr(self.hf, "_no_split_modules", None) or ())
        layers = [m for m in self.hf.modules() if type(m).__name__ in kinds]
        if len(layers) != self.num_layers:
            raise PrimerlError(f"found {len(layers)} decoder layers of classes {sorted(kinds)} in "
                               f"{type(self.hf).__name__}, its config says {self.num_layers}")
        return layers

    def parallel_plan(self) -> ParallelPlan:
        """FSDP units: every decoder layer, then the input embeddings and the head. Nothing
        routed, and mixers the plan does not describe (context and expert parallel are
        refused by the adapter)."""
        names = {m: n for n, m in self.named_modules()}
        head, embed = self.hf.get_output_embeddings(), self.hf.get_input_embeddings()
        return ParallelPlan(
            layers=tuple(LayerPlan(names[layer], Mixer.OPAQUE) for layer in self.decoder_layers()),
            embeddings=names[embed], head=names[head], tied_embeddings=head.weight is embed.weight,
        )

    def cast_(self, dtype: torch.dtype) -> TransformersLM:
        return cast_(self, dtype, self.keep_fp32)

    def tie_weights(self) -> None:
        self.hf.tie_weights()

    # -- the cache -------------------------------------------------------------------------

    def kv_shapes(self) -> list[tuple[tuple[int, int], tuple[int, int]]]:
        """Per layer, ((kv_heads, key_dim), (kv_heads, value_dim)), from one token's forward."""
        if self._kv_shapes is None:
            probe = self._probe()
            ids = torch.zeros(1, 1, dtype=torch.long, device=self.device)
            mask = self._masks(torch.ones(1, 1, 1, dtype=torch.bool, device=self.device), ids, ids, self.dtype)
            with torch.no_grad():
                self.hf(input_ids=ids, position_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1,
                        **{self._cache_kwarg: probe})
            missing = [i for i in range(self.num_layers) if i not in probe.shapes]
            if missing:
                raise PrimerlError(f"layers {missing} of {type(self.hf).__name__} keep no keys and values (recurrent "
                                   f"or linear-attention layers): the hf model serves attention-only architectures")
            self._kv_shapes = [probe.shapes[i] for i in range(self.num_layers)]
        return self._kv_shapes

    def cache_layout(self) -> list[LayerCache]:
        return [{"per_token": {"k": k, "v": v}} for k, v in self.kv_shapes()]

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> SlotCache:
        return SlotCache(self.cache_layout(), num_slots, max_len, dtype=dtype or self.dtype, device=self.device)

    # -- masks -----------------------------------------------------------------------------

    def _masks(self, visible: Tensor, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Any:
        """visible: [B, S, T] bool; q_pos [B, S], k_pos [B, T]: positions (for sliding windows).
        The model's attention mask: one 4D mask, or the mapping per layer type."""
        masks = {"full_attention": visible}
        if "sliding_attention" in self.layer_types:
            near = (q_pos[:, :, None] - k_pos[:, None, :]) < self.sliding_window  # [B, S, T]
            masks["sliding_attention"] = visible & near
        out = {}
        for kind, m in masks.items():
            m = m[:, None]  # [B, 1, S, T]
            if self.attn_implementation == "eager":
                m = torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, torch.finfo(dtype).min)
            out[kind] = m
        kinds = set(self.layer_types)
        return out[kinds.pop()] if len(kinds) == 1 else out

    # -- forward ---------------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        lengths: Tensor,
        *,
        segment_ids: Tensor | None = None,
        prefix_ids: Tensor | None = None,
        cache: SlotCache | None = None,
        slots: Tensor | range | None = None,
        past_lens: Tensor | None = None,
        replay_experts: Tensor | None = None,
        logits_for: str | Tensor = "all",
    ) -> ModelOutput:
        """The contract of :meth:`primerl.models.contract.CausalLM.forward` (``docs/models.md``; a mask
        in ``logits_for`` runs transformers' head at the columns some row selects, then selects)."""
        B, S = input_ids.shape
        device = input_ids.device
        selected = isinstance(logits_for, Tensor)
        if not selected and logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all', 'last' or a bool [B, S] mask, got {logits_for!r}")
        if replay_experts is not None and replay_experts.shape[2]:
            raise PrimerlError("the hf model does not replay routed experts (trainer.router_replay)")
        i = torch.arange(S, device=device)
        valid_q = i[None, :] < lengths[:, None]  # [B, S]
        kv: Any = None
        if cache is None:
            # keys are the row's own tokens: causal, within the row's length, in the query's segment
            # (or the prompt its segment shares: prefix_ids)
            visible = (i[None, :, None] >= i[None, None, :]) & valid_q[:, None, :]  # [B, S, S]
            if segment_ids is not None:
                same = segment_ids[:, :, None] == segment_ids[:, None, :]
                if prefix_ids is not None:
                    same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
                visible = visible & same
            k_pos = positions
        else:
            past = past_lens if past_lens is not None else torch.zeros(B, dtype=torch.long, device=device)
            kv = self._slot_kv(cache, slots if slots is not None else range(B), past.to(device), lengths)
            j = torch.arange(kv.total, device=device)
            visible = j[None, None, :] <= (past[:, None] + i[None, :])[:, :, None]  # [B, S, T]
            k_pos = j[None, :].expand(B, -1)
        # a padding query sees its own position only (a row of no key gives NaN in sdpa)
        own = (i[None, :, None] == i[None, None, :]) if cache is None else \
            (j[None, None, :] == past[:, None, None])  # [1|B, S, T]
        visible = torch.where(valid_q[:, :, None], visible, own)
        mask = self._masks(visible, positions, k_pos, self.dtype)
        if selected:  # the head only at the columns some row selects (transformers' 1-D logits_to_keep)
            keep: Tensor | int = logits_for.any(0).nonzero().squeeze(1)  # [C]
        else:
            keep = (lengths - 1).clamp(min=0)[:, None] if logits_for == "last" else 0  # [B, 1]: each row's last
        out = self.hf(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                      use_cache=kv is not None, logits_to_keep=keep, **{self._cache_kwarg: kv})
        if selected:
            logits = out.logits[logits_for[:, keep]]  # [N, V]: row-major, as logits_for[mask] orders them
        else:
            logits = out.logits[:, 0] if logits_for == "last" else out.logits  # [B, V] or [B, S, V]
        none = torch.zeros(B, S, 0, 0, dtype=torch.int16, device=device)
        return ModelOutput(logits, none, none)
