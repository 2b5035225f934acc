"""The ragged decoder forward every primerl model implements: packed rows, slot caches, R3.

Why: RL needs one forward that HF models do not offer, the same for every architecture,

* ragged batches: each row has its own number of new tokens (``lengths``), right-padded;
* packed training rows: ``segment_ids`` keep several sequences in one row apart; token-wise
  work (projections, MLPs, experts) runs on the packed rows, while attention runs one
  sequence per row (:class:`Segments`, what varlen attention kernels do), so its cost is
  that of each sequence, not of the whole row;
* a slot-indexed cache for continuous batching: in one call some rows prefill a prompt
  while others decode one token, each at its own past length, and a prefix can be copied
  from slot to slot;
* router replay ("R3"): the trainer forces the experts the inference engine used, while
  the router still receives gradients through its scores;
* the expert ids every MoE layer used *and* the ones its router would have chosen, so the
  trainer can measure routing agreement with inference while replaying.

A model plugin subclasses :class:`DecoderLM`: it builds ``self.model`` (``embed_tokens``,
``layers``, ``norm``; other names via :meth:`input_embeddings` and :meth:`final_norm`)
and ``self.lm_head``, describes its cache in :meth:`cache_layout`,
and may add per-batch tensors (RoPE angles) in :meth:`prepare`. Each layer is called as
``layer(x, batch, valid, carry, replay) -> (x, carry, routing | None)``; ``carry`` passes
state from one layer to the next (GLM-5's shared DSA selection), ``routing`` is the
:class:`~primerl.models.layers.Routing` of an MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn


class ModelOutput(NamedTuple):
    logits: Tensor  # [B, S, V] (logits_for="all") or [B, V] (logits_for="last")
    routed_experts: Tensor  # [B, S, n_moe_layers, top_k] int16: the experts each MoE layer used
    router_experts: Tensor  # [B, S, n_moe_layers, top_k] int16: the routers' own top-k choice


# ---------------------------------------------------------------------------------------
# Slot cache
# ---------------------------------------------------------------------------------------


class SlotCache:
    """Preallocated per-layer cache for continuous batching; a slot is one sequence.

    ``layout[l]`` names layer l's tensors and their trailing shapes:

    * ``"per_token"``: ``{name: shape}``, stored ``[num_slots, max_len, *shape]`` (keys,
      values, latents). A row's new tokens are written at positions
      ``past_lens[b] .. past_lens[b] + lengths[b] - 1`` of slot ``slots[b]``.
    * ``"state"``: ``{name: (shape, dtype)}``, stored ``[num_slots, *shape]``: a recurrent
      layer's state after the slot's last token (Mamba's conv window and SSM state).

    The caller owns which slot is free and how long each one is. A batch whose slots are
    consecutive (passed as a ``range``) reads the cache in place; any other batch gathers
    its rows, so an engine keeps its running sequences in the first slots (:meth:`swap`).
    Tensors start at zero,
    so never-written positions are finite (they are always masked out). Recurrent state
    exists only at a slot's current length, so caches with states cannot copy a prefix
    (``supports_prefix_reuse`` is False and the engine does not try); a recurrent layer
    treats a slot whose past length is 0 as holding the zero state, so slots need no reset.
    """

    def __init__(self, layout: list[dict[str, dict]], num_slots: int, max_len: int, *,
                 dtype: torch.dtype, device: Any) -> None:
        self.num_slots, self.max_len = num_slots, max_len
        self.per_token: list[dict[str, Tensor]] = []
        self.state: list[dict[str, Tensor]] = []
        for spec in layout:
            self.per_token.append({
                name: torch.zeros(num_slots, max_len, *shape, dtype=dtype, device=device)
                for name, shape in spec.get("per_token", {}).items()
            })
            self.state.append({
                name: torch.zeros(num_slots, *shape, dtype=sdtype or dtype, device=device)
                for name, (shape, sdtype) in spec.get("state", {}).items()
            })
        self.supports_prefix_reuse = not any(self.state)

    def tensors(self) -> list[Tensor]:
        return [t for layer in (*self.per_token, *self.state) for t in layer.values()]

    @torch.no_grad()
    def swap(self, a: int, b: int, n: int | None = None) -> None:
        """Exchange slots ``a`` and ``b``: the first ``n`` positions (all when None) of every
        per-token tensor, and the recurrent states."""
        n = self.max_len if n is None else n
        if not 0 <= n <= self.max_len:
            raise ValueError(f"swap length {n} outside [0, {self.max_len}]")
        if a == b:
            return
        # through a copy of one side: basic slices, ~3x cheaper on CPU than t[[a, b]] = t[[b, a]]
        views = [(t[a, :n], t[b, :n]) for layer in self.per_token for t in layer.values()]
        views += [(t[a], t[b]) for layer in self.state for t in layer.values()]
        for va, vb in views:
            keep = va.clone()
            va.copy_(vb)
            vb.copy_(keep)

    @torch.no_grad()
    def copy_prefix(self, src_slot: int, dst_slot: int, n: int) -> None:
        """Copy the first ``n`` cached positions of ``src_slot`` into ``dst_slot`` (prefix reuse)."""
        if not self.supports_prefix_reuse:
            raise ValueError("this cache holds recurrent state, which cannot be cut at a prefix")
        if not 0 <= n <= self.max_len:
            raise ValueError(f"prefix length {n} outside [0, {self.max_len}]")
        for layer in self.per_token:
            for t in layer.values():
                t[dst_slot, :n] = t[src_slot, :n]


# ---------------------------------------------------------------------------------------
# The batch every layer sees
# ---------------------------------------------------------------------------------------


@dataclass
class Batch:
    """What every layer needs about the batch, computed once per forward."""

    positions: Tensor  # [B, S] long
    lengths: Tensor  # [B] long: valid new tokens per row
    valid: Tensor  # [B, S] bool
    visible: Tensor  # [B, S, T] bool: key j may be attended by query i (None when ``segments`` is set)
    segment_ids: Tensor | None = None  # [B, S] packed rows (no cache)
    cache: SlotCache | None = None
    slots: Tensor | None = None  # [B]
    past_lens: Tensor | None = None  # [B]
    write_at: tuple[Tensor, ...] = ()  # (b, i, slot, pos) of every valid new token, [N] each
    extra: dict[str, Any] = field(default_factory=dict)  # model-specific (RoPE angles)
    segments: Segments | None = None  # packed rows: the one-sequence-per-row layout for attention
    # every row is one right-padded sequence from position 0, no cache: plain causal
    # attention is exact for valid queries (SDPA's is_causal, no mask tensor to read)
    causal: bool = False
    slot_range: tuple[int, int] | None = None  # slots are start..stop-1 in order: cache rows are read in place
    _biases: dict[tuple[int, torch.dtype], tuple[Tensor, Tensor]] = field(default_factory=dict, repr=False)
    _keys_seen: Tensor | None = field(default=None, repr=False)

    def bias(self, mask: Tensor, dtype: torch.dtype) -> Tensor:
        """``mask`` ([B, S, T] bool) as an additive bias (0 where visible, -inf elsewhere),
        built once per forward for each mask the layers share (``visible``, a DSA selection)."""
        key = (id(mask), dtype)
        if key not in self._biases:
            bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
            self._biases[key] = (mask, bias)  # holding the mask keeps its id from being reused
        return self._biases[key][1]

    def keys_seen(self) -> Tensor:
        """How many keys each query may attend to, [B, S] (computed once per forward)."""
        if self._keys_seen is None:
            self._keys_seen = self.visible.sum(-1)
        return self._keys_seen

    def keys(self, new: Tensor, layer: int, name: str) -> Tensor:
        """Keys seen by the new tokens: ``new`` itself, or the cache after writing ``new`` into it.

        new: [B, S, *D]; the store is [num_slots, max_len, *D]; returns [B, T, *D].
        """
        if self.cache is None:
            return new
        store = self.cache.per_token[layer][name]
        b, i, slot, pos = self.write_at
        store[slot, pos] = new[b, i].to(store.dtype)
        T = self.visible.shape[-1]  # every row reads positions 0..T-1 of its slot
        return self.slot_rows(store[:, :T]).to(new.dtype)

    def slot_rows(self, store: Tensor) -> Tensor:
        """Rows ``slots`` of a [num_slots, ...] cache tensor: a view when the slots are
        consecutive, else a gathered copy. [B, ...]."""
        if self.slot_range is not None:
            return store[self.slot_range[0] : self.slot_range[1]]
        return store.index_select(0, self.slots)


def make_batch(positions: Tensor, lengths: Tensor, segment_ids: Tensor | None, cache: SlotCache | None,
               slots: Tensor | range | None, past_lens: Tensor | None, *, unpack_segments: bool = False) -> Batch:
    """Key visibility and cache addressing shared by all layers.

    ``unpack_segments``: for packed rows, lay the sequences out one per row for attention
    when that is cheaper (:class:`Segments`); the packed rows' own [B, S, S] mask is then
    never built (``visible`` is None), which is what keeps long packed rows affordable.
    """
    B, S = positions.shape
    device = positions.device
    i = torch.arange(S, device=device)
    valid = i < lengths[:, None]  # [B, S]
    if cache is None:
        if slots is not None or past_lens is not None:
            raise ValueError("slots and past_lens need a cache")
        segments = _segments(positions, valid, segment_ids) if segment_ids is not None and unpack_segments else None
        if segments is not None:
            return Batch(positions, lengths, valid, None, segment_ids, segments=segments)  # type: ignore[arg-type]
        j = i
        visible = (j[None, :] <= i[:, None]).expand(B, S, S)  # causal
        if segment_ids is not None:
            visible = visible & (segment_ids[:, :, None] == segment_ids[:, None, :])
        batch = Batch(positions, lengths, valid, visible, segment_ids)
    else:
        if slots is None or past_lens is None:
            raise ValueError("a cache needs slots and past_lens")
        if segment_ids is not None:
            raise ValueError("segment_ids (packed rows) cannot be combined with a cache")
        slot_range = None
        if isinstance(slots, range):
            if slots.step != 1 or len(slots) != B:
                raise ValueError(f"a range of slots must be {B} consecutive slots, got {slots}")
            slot_range = (slots.start, slots.stop)
            slots = torch.arange(slots.start, slots.stop, device=device)
        T = int((past_lens + lengths).max())
        if T > cache.max_len:
            raise ValueError(f"sequence of {T} tokens does not fit the cache (max_len {cache.max_len})")
        j = torch.arange(T, device=device)
        visible = j[None, None, :] <= (past_lens[:, None] + i[None, :])[:, :, None]  # [B, S, T]
        b_idx, i_idx = valid.nonzero(as_tuple=True)
        write_at = (b_idx, i_idx, slots[b_idx], past_lens[b_idx] + i_idx)
        batch = Batch(positions, lengths, valid, visible, None, cache, slots, past_lens, write_at,
                      slot_range=slot_range)
    # Padding queries look at key 0 only: finite outputs, no all-masked softmax rows.
    batch.visible = torch.where(valid[:, :, None], batch.visible, j[None, None, :] == 0)
    return batch


@dataclass
class Segments:
    """The sequences of packed rows laid out one per row, for attention.

    A packed row of S tokens holding sequences of lengths l_1..l_m costs S^2 in attention
    (every pair, masked); one sequence per row costs max(l)^2 per sequence, and the
    indexer of DSA models scores only its own keys. Token-wise layers never see this
    layout: a mixer gets ``gather(h)`` and returns through ``scatter``.
    """

    batch: Batch  # the per-sequence batch: [n, L] positions, lengths, visible, RoPE angles
    index: Tensor  # [n, L] flat position (b * S + i) of each sequence's tokens; padding -> 0
    flat: Tensor  # [N] flat positions of the valid tokens
    where: tuple[Tensor, Tensor]  # (sequence, offset) of each valid token, [N] each
    shape: tuple[int, int]  # (B, S) of the packed rows

    def gather(self, t: Tensor) -> Tensor:
        """[B, S, *D] packed -> [n, L, *D] one sequence per row."""
        return t.flatten(0, 1)[self.index]

    def scatter(self, u: Tensor) -> Tensor:
        """[n, L, *D] -> [B, S, *D] packed (zeros at padding)."""
        B, S = self.shape
        out = u.new_zeros(B * S, *u.shape[2:])
        out[self.flat] = u[self.where]
        return out.view(B, S, *u.shape[2:])

    def adopt(self, extra: dict[str, Any]) -> None:
        """Per-token tensors of the packed batch's ``extra`` (RoPE angles) follow their tokens."""
        B, S = self.shape
        for key, value in extra.items():
            is_per_token = isinstance(value, Tensor) and value.shape[:2] == (B, S)
            self.batch.extra[key] = self.gather(value) if is_per_token else value


def _segments(positions: Tensor, valid: Tensor, segment_ids: Tensor) -> Segments | None:
    """The one-sequence-per-row layout of packed rows (a sequence is a run of equal
    ``segment_ids`` in a row), or None when it would not be cheaper than the packed rows."""
    B, S = valid.shape
    flat = valid.flatten().nonzero().squeeze(1)  # [N], row-major
    if flat.numel() == 0:
        return None
    sid, row = segment_ids.flatten()[flat], flat // S
    first = torch.ones_like(sid, dtype=torch.bool)
    first[1:] = (sid[1:] != sid[:-1]) | (row[1:] != row[:-1])
    seq = first.cumsum(0) - 1  # [N] sequence of each token
    starts = first.nonzero().squeeze(1)  # [n]
    offset = torch.arange(flat.numel(), device=flat.device) - starts[seq]
    lengths = torch.bincount(seq, minlength=starts.numel())  # [n]
    n, L = starts.numel(), int(lengths.max())
    if n * L * L >= B * S * S:
        return None
    index = torch.zeros(n, L, dtype=torch.long, device=flat.device)
    index[seq, offset] = flat
    sub = make_batch(positions.flatten()[index], lengths, None, None, None, None)
    sub.causal = True
    return Segments(sub, index, flat, (seq, offset), (B, S))


def mix(mixer: nn.Module, h: Tensor, batch: Batch, carry: Any) -> tuple[Tensor, Any]:
    """``mixer(h, batch, carry)``, on packed rows one sequence per row (see :class:`Segments`)."""
    seg = batch.segments
    if seg is None:
        return mixer(h, batch, carry)
    out, carry = mixer(seg.gather(h), seg.batch, carry)
    return seg.scatter(out), carry


# ---------------------------------------------------------------------------------------
# The pre-norm decoder layer
# ---------------------------------------------------------------------------------------


class PreNormLayer(nn.Module):
    """``h = x + self_attn(norm(x)); y = h + mlp(norm(h))``: the layer of Llama-style
    models (DeepSeek-V3, Kimi K2, GLM-5, Qwen3-MoE), with HF's parameter names.

    ``self_attn(x, batch, carry) -> (out, carry)``; ``mlp`` is a dense MLP (``mlp(h)``) or,
    when ``is_moe``, an MoE block (``mlp(h [N, hidden], valid, replay) -> (out, routing)``).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, *, is_moe: bool, hidden: int, eps: float) -> None:
        super().__init__()
        from primerl.models.layers import RMSNorm

        self.self_attn, self.mlp, self.is_moe = self_attn, mlp, is_moe
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def forward(self, x: Tensor, batch: Batch, valid: Tensor, carry: Any, replay: Tensor | None):
        """x: [B, S, hidden]; valid: [B*S]. Returns (x, carry, routing or None)."""
        attn, carry = mix(self.self_attn, self.input_layernorm(x), batch, carry)
        x = x + attn
        h = self.post_attention_layernorm(x)
        if not self.is_moe:
            return x + self.mlp(h), carry, None
        y, routing = self.mlp(h.flatten(0, 1), valid, replay)
        return x + y.view_as(x), carry, routing


# ---------------------------------------------------------------------------------------
# The causal LM base
# ---------------------------------------------------------------------------------------


class DecoderLM(nn.Module):
    """Base of primerl's causal LMs: embeddings -> layers -> norm -> lm_head, ragged.

    Subclasses set ``self.config`` (with ``vocab_size``, ``num_experts_per_tok`` and
    ``tie_word_embeddings``), ``self.model`` (``embed_tokens``, ``layers``, ``norm``),
    ``self.lm_head`` and ``self.moe_layers`` (indices of the MoE layers), and implement
    :meth:`cache_layout`.
    """

    config: Any
    model: nn.Module
    lm_head: nn.Linear
    moe_layers: list[int]

    # -- hooks -----------------------------------------------------------------------

    def cache_layout(self) -> list[dict[str, dict]]:
        """Per layer, the :class:`SlotCache` layout (see there)."""
        raise NotImplementedError

    def prepare(self, batch: Batch, dtype: torch.dtype) -> None:
        """Add per-batch tensors every layer shares to ``batch.extra``: RoPE angles
        (``cos``, ``sin`` [B, S, rope/2], and ``rot``, the same as one complex rotation) for
        models that set ``inv_freq`` and ``rope_factor``."""
        if getattr(self, "inv_freq", None) is not None:
            from primerl.models.layers import rope_angles, rope_rotation

            cos, sin = rope_angles(batch.positions, self.inv_freq, self.rope_factor, dtype)
            batch.extra.update(cos=cos, sin=sin, rot=rope_rotation(cos, sin))

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.norm

    # -- weights ---------------------------------------------------------------------

    # parameter/buffer name suffixes kept in float32 whatever the model dtype (routers)
    keep_fp32: tuple[str, ...] = ()
    # packed rows: attention one sequence per row when cheaper (False: masked packed rows)
    unpack_segments: bool = True

    def init_weights(self, seed: int) -> None:
        """HF's init, reproducible from ``seed`` (see :func:`primerl.models.layers.init_normal_`)."""
        from primerl.models.layers import init_normal_

        skip = (self.lm_head,) if self.config.tie_word_embeddings else ()
        init_normal_(self, seed, self.config.initializer_range, skip=skip)

    def cast_(self, dtype: torch.dtype) -> DecoderLM:
        """Cast floating tensors to ``dtype`` in place, keeping ``keep_fp32`` in float32."""
        from primerl.models.layers import cast_

        return cast_(self, dtype, self.keep_fp32)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.input_embeddings().weight

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_embeddings().weight.device

    def parallel_plan(self) -> dict[str, Any]:
        """What parallelism plugins need to know, read off the modules (no model-specific code):

        * ``fsdp_units``: the modules to shard as one FSDP unit each (every decoder layer,
          then the embeddings and the head);
        * ``layers``: per layer, its sequence mixer (``mla``, ``mla_dsa``, ``gqa``, ``mamba2``
          or None) — what context parallelism must split — and whether it is an MoE layer;
        * ``routers`` and ``experts``: the module names expert parallelism and router replay
          act on, in MoE-layer order.
        """
        from primerl.models.attention import GQAttention
        from primerl.models.layers import Experts, SigmoidRouter, SoftmaxRouter
        from primerl.models.mamba2 import Mamba2Mixer
        from primerl.models.mla import MLAttention

        def mixer(layer: nn.Module) -> str | None:
            for m in layer.modules():
                if isinstance(m, MLAttention):
                    return "mla_dsa" if type(m).select is not MLAttention.select else "mla"
                if isinstance(m, GQAttention):
                    return "gqa"
                if isinstance(m, Mamba2Mixer):
                    return "mamba2"
            return None

        names = {m: n for n, m in self.named_modules()}
        layers = list(self.model.layers)
        return {
            "fsdp_units": [names[layer] for layer in layers] + [names[self.input_embeddings()], "lm_head"],
            "layers": [{"mixer": mixer(layer), "moe": bool(getattr(layer, "is_moe", False))} for layer in layers],
            "routers": [n for n, m in self.named_modules() if isinstance(m, (SigmoidRouter, SoftmaxRouter))],
            "experts": [n for n, m in self.named_modules() if isinstance(m, Experts)],
        }

    def new_cache(self, num_slots: int, max_len: int, dtype: torch.dtype | None = None) -> SlotCache:
        """An empty cache of ``num_slots`` sequences of up to ``max_len`` tokens each."""
        return SlotCache(self.cache_layout(), num_slots, max_len, dtype=dtype or self.dtype, device=self.device)

    # -- forward ---------------------------------------------------------------------

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        lengths: Tensor,
        *,
        segment_ids: Tensor | None = None,
        cache: SlotCache | None = None,
        slots: Tensor | range | None = None,
        past_lens: Tensor | None = None,
        replay_experts: Tensor | None = None,
        logits_for: str = "all",
    ) -> ModelOutput:
        """One forward over a right-padded batch of new tokens.

        input_ids, positions: [B, S] long (positions drive RoPE only).
        lengths: [B] long, valid new tokens per row; tokens at i >= lengths[b] are padding.
        segment_ids: [B, S] long (no cache): packed rows; a token sees only earlier tokens
            of its own segment.
        cache, slots [B], past_lens [B]: row b's tokens are written to slot ``slots[b]`` at
            positions ``past_lens[b]...`` and attend to everything cached before them.
            ``slots`` may be a ``range`` of B consecutive slots: the cache is then read in
            place instead of gathered.
        replay_experts: [B, S, n_moe_layers, top_k] expert ids to force in each MoE layer
            (ignored at padding); weights still come from the router's own scores.
        logits_for: "all" -> logits [B, S, V]; "last" -> [B, V] at each row's last valid token.
        """
        B, S = input_ids.shape
        device = input_ids.device
        k = self.config.num_experts_per_tok
        if logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all' or 'last', got {logits_for!r}")
        if replay_experts is not None and replay_experts.shape != (B, S, len(self.moe_layers), k):
            raise ValueError(f"replay_experts must be [B, S, {len(self.moe_layers)}, {k}]")

        x = self.input_embeddings()(input_ids)  # [B, S, hidden]
        batch = make_batch(positions, lengths, segment_ids, cache, slots, past_lens,
                           unpack_segments=self.unpack_segments)
        self.prepare(batch, x.dtype)
        if batch.segments is not None:
            batch.segments.adopt(batch.extra)
        valid = batch.valid.flatten()  # [B*S]

        carry, used, own = None, [], []
        for layer in self.model.layers:
            replay = None
            if replay_experts is not None and getattr(layer, "is_moe", False):
                replay = replay_experts[:, :, len(used)].flatten(0, 1)  # [B*S, top_k]
            x, carry, routing = layer(x, batch, valid, carry, replay)
            if routing is not None:
                used.append(routing.ids.view(B, S, -1))
                own.append(routing.own_ids.view(B, S, -1))

        if logits_for == "last":
            x = x[torch.arange(B, device=device), (lengths - 1).clamp(min=0)]  # [B, hidden]
        logits = self.lm_head(self.final_norm()(x))
        if used:
            return ModelOutput(logits, torch.stack(used, 2).to(torch.int16), torch.stack(own, 2).to(torch.int16))
        none = torch.zeros(B, S, 0, k, dtype=torch.int16, device=device)
        return ModelOutput(logits, none, none)
