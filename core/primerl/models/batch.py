"""The batch every layer of a primerl model sees, and the slot cache it addresses.

:func:`make_batch` turns one forward's ragged inputs (right-padded rows, optional packed
``segment_ids``, optional :class:`SlotCache` addressing) into a :class:`Batch`: key
visibility, cache write positions and per-batch tensors (``extra``, RoPE angles) that all
layers share. Packed rows may be laid out one sequence per row for attention
(:class:`Segments`); :func:`mix` runs a sequence mixer in that layout.

Context parallelism (each process holds a slice of every packed row) plugs in here too:
while :func:`sharded_rows` is active, :func:`make_batch` asks the :class:`RowShard` for the
batch of the slice, whose :meth:`Batch.keys` returns the whole row's keys (gathered from
the other ranks) and whose ``visible`` relates the local queries to them. Sequence mixers
read the keys of other tokens only through :meth:`Batch.keys`, so attention needs no code
of its own for it (``primerl_fsdp.context_parallel``).

Why in the core: it is the contract between a model's layers and their callers (the
engine's slot cache, context parallel's :class:`RowShard`). The sequence mixers of the
building blocks (``primerl_blocks.attention``, ``.mla``, ``.mamba2``) and their decoder
(``primerl_blocks.decoder``) import this module; it imports none of them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Protocol, TypedDict

import torch
from torch import Tensor, nn

__all__ = [
    "Batch",
    "LayerCache",
    "RowShard",
    "Segments",
    "SlotCache",
    "make_batch",
    "mix",
    "sharded_rows",
]

# ---------------------------------------------------------------------------------------
# Slot cache
# ---------------------------------------------------------------------------------------


class LayerCache(TypedDict, total=False):
    """One layer's entry of a cache layout (``CausalLM.cache_layout()``), see :class:`SlotCache`."""

    per_token: dict[str, tuple[int, ...]]  # name -> trailing shape: [num_slots, max_len, *shape] each
    state: dict[str, tuple[tuple[int, ...], torch.dtype | None]]  # name -> (shape, dtype): [num_slots, *shape]


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

    def __init__(self, layout: list[LayerCache], num_slots: int, max_len: int, *,
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

    # ---- what a KV store reads and writes (primerl.kv_stores: offload, shared blocks) ----

    def names(self) -> list[str]:
        """The per-token tensors as :meth:`read` and :meth:`write` name them: ``"{layer}.{name}"``."""
        return [f"{i}.{name}" for i, layer in enumerate(self.per_token) for name in layer]

    def _span(self, start: int, n: int) -> None:
        if not self.supports_prefix_reuse:
            raise ValueError("this cache holds recurrent state, which cannot be cut at a prefix")
        if start < 0 or n < 0 or start + n > self.max_len:
            raise ValueError(f"positions {start}..{start + n - 1} outside the cache (max_len {self.max_len})")

    def read(self, slot: int, start: int, n: int) -> dict[str, Tensor]:
        """Positions ``start .. start+n-1`` of ``slot``: per :meth:`names`, a view
        ``[n, *shape]`` into the cache (copy it before the slot is written again)."""
        self._span(start, n)
        return {f"{i}.{name}": t[slot, start:start + n]
                for i, layer in enumerate(self.per_token) for name, t in layer.items()}

    @torch.no_grad()
    def write(self, slot: int, start: int, tensors: dict[str, Tensor]) -> None:
        """Write ``tensors`` (per :meth:`names`, each ``[n, *shape]``, any device) at positions
        ``start .. start+n-1`` of ``slot``: what :meth:`read` returned, restored."""
        names = self.names()
        if sorted(tensors) != sorted(names):
            raise ValueError(f"cache tensors {sorted(tensors)} do not match this cache's {sorted(names)}")
        n = len(next(iter(tensors.values()))) if tensors else 0
        self._span(start, n)
        for i, layer in enumerate(self.per_token):
            for name, t in layer.items():
                src = tensors[f"{i}.{name}"]
                if tuple(src.shape) != (n, *t.shape[2:]) or src.dtype != t.dtype:
                    raise ValueError(f"cache tensor {i}.{name}: got {tuple(src.shape)} {src.dtype}, "
                                     f"this cache holds {(n, *t.shape[2:])} {t.dtype}")
                t[slot, start:start + n].copy_(src)


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
    one_token_rows: bool = False  # every row one valid new token (a decode step): write_at's (b, i) is (all, 0)
    # context parallel (no cache): this rank's [B, S, *D] -> the whole rows' [B, T, *D] in
    # global token order, differentiably (see RowShard); ``visible`` is then [B, S, T]
    gather_keys: Callable[[Tensor], Tensor] | None = None
    # [B, S] packed prompt trees: the segment a token also sees (a shared prompt), its own where none
    prefix_ids: Tensor | None = None
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
        """Keys seen by the new tokens: ``new`` itself, the cache after writing ``new`` into
        it, or (context parallel) the whole rows' keys gathered from every rank.

        new: [B, S, *D]; the store is [num_slots, max_len, *D]; returns [B, T, *D]. Every
        sequence mixer reads other tokens' keys (and values) through this method only.
        """
        if self.cache is None:
            return new if self.gather_keys is None else self.gather_keys(new)
        store = self.cache.per_token[layer][name]
        b, i, slot, pos = self.write_at
        store[slot, pos] = (new[:, 0] if self.one_token_rows else new[b, i]).to(store.dtype)
        T = self.visible.shape[-1]  # every row reads positions 0..T-1 of its slot
        return self.slot_rows(store[:, :T]).to(new.dtype)

    def slot_rows(self, store: Tensor) -> Tensor:
        """Rows ``slots`` of a [num_slots, ...] cache tensor: a view when the slots are
        consecutive, else a gathered copy. [B, ...]."""
        if self.slot_range is not None:
            return store[self.slot_range[0] : self.slot_range[1]]
        return store.index_select(0, self.slots)


class RowShard(Protocol):
    """This process holds a slice of every row (context parallelism): the batch of the slice.

    ``make_batch(positions, lengths, segment_ids, prefix_ids)`` gets this rank's tokens
    ([B, S] each, ``prefix_ids`` None unless the rows hold prompt trees; ``lengths`` [B]
    counting the whole rows' valid tokens) and returns a :class:`Batch`
    with ``valid`` [B, S] for this rank's tokens, ``gather_keys`` set and ``visible``
    [B, S, T] over the whole rows' T keys, or with ``segments`` whose batch does the same
    one sequence per row.
    """

    def make_batch(self, positions: Tensor, lengths: Tensor, segment_ids: Tensor | None,
                   prefix_ids: Tensor | None = None) -> Batch: ...


_row_shard: ContextVar[RowShard | None] = ContextVar("primerl_row_shard", default=None)


@contextmanager
def sharded_rows(shard: RowShard) -> Iterator[None]:
    """Within this block, :func:`make_batch` builds batches of cache-free forwards through
    ``shard`` (a forward hook of context-parallel models enters it)."""
    token = _row_shard.set(shard)
    try:
        yield
    finally:
        _row_shard.reset(token)


def make_batch(positions: Tensor, lengths: Tensor, segment_ids: Tensor | None, cache: SlotCache | None,
               slots: Tensor | range | None, past_lens: Tensor | None, *, unpack_segments: bool = False,
               prefix_ids: Tensor | None = None) -> Batch:
    """Key visibility and cache addressing shared by all layers.

    ``unpack_segments``: for packed rows, lay the sequences out one per row for attention
    when that is cheaper (:class:`Segments`); the packed rows' own [B, S, S] mask is then
    never built (``visible`` is None), which is what keeps long packed rows affordable.
    ``prefix_ids`` ([B, S], with ``segment_ids``): prompt trees, a token also sees the
    earlier tokens of segment ``prefix_ids`` (``primerl.trainer.packing``).
    Inside :func:`sharded_rows` the :class:`RowShard` builds the batch instead.
    """
    shard = _row_shard.get()
    if prefix_ids is not None and (segment_ids is None or cache is not None):
        raise ValueError("prefix_ids (shared prompts) need packed rows (segment_ids) and no cache")
    if shard is not None:
        if cache is not None:
            raise ValueError("a forward over sharded rows (context parallel) cannot use a cache")
        return shard.make_batch(positions, lengths, segment_ids, prefix_ids)
    B, S = positions.shape
    device = positions.device
    i = torch.arange(S, device=device)
    valid = i < lengths[:, None]  # [B, S]
    if cache is None:
        if slots is not None or past_lens is not None:
            raise ValueError("slots and past_lens need a cache")
        segments = (_segments(positions, valid, segment_ids, prefix_ids)
                    if segment_ids is not None and unpack_segments else None)
        if segments is not None:
            return Batch(positions, lengths, valid, None, segment_ids, segments=segments,  # type: ignore[arg-type]
                         prefix_ids=prefix_ids)
        j = i
        visible = (j[None, :] <= i[:, None]).expand(B, S, S)  # causal
        if segment_ids is not None:
            same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [B, S, S]
            if prefix_ids is not None:  # and the keys of the prompt the query's segment continues
                same = same | (prefix_ids[:, :, None] == segment_ids[:, None, :])
            visible = visible & same
        batch = Batch(positions, lengths, valid, visible, segment_ids, prefix_ids=prefix_ids)
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
                      slot_range=slot_range, one_token_rows=S == 1 and len(b_idx) == B)
    # Padding queries look at key 0 only: finite outputs, no all-masked softmax rows.
    if not batch.one_token_rows:  # (a decode step of valid rows has none)
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


def _segments(positions: Tensor, valid: Tensor, segment_ids: Tensor, prefix_ids: Tensor | None = None) -> Segments | None:
    """The one-sequence-per-row layout of packed rows (a sequence is a run of equal
    ``segment_ids`` in a row), or None when it would not be cheaper than the packed rows.
    With prompt trees (``prefix_ids``) see :func:`_tree_segments`."""
    B, S = valid.shape
    flat = valid.flatten().nonzero().squeeze(1)  # [N], row-major
    if flat.numel() == 0:
        return None
    seq, offset, starts, lengths = _runs(segment_ids.flatten()[flat], flat // S)
    if prefix_ids is None:
        return _sequence_rows(positions, (B, S), flat, seq, offset, starts, lengths, B * S * S)
    # prompt trees: one tree per row (masked within) or one segment per row (facing its
    # prompt's keys), whichever scores fewer query-key pairs, padding included
    tree_runs = _runs(prefix_ids.flatten()[flat], flat // S)
    n_trees, tree_len = tree_runs[2].numel(), int(tree_runs[3].max())
    per_tree = n_trees * tree_len * tree_len
    split = _tree_segments(positions, valid, segment_ids, prefix_ids, flat, seq, offset, starts, lengths,
                           min(per_tree, B * S * S))
    if split is not None:
        return split
    return _sequence_rows(positions, (B, S), flat, *tree_runs, B * S * S, segment_ids, prefix_ids)


def _sequence_rows(positions: Tensor, shape: tuple[int, int], flat: Tensor, seq: Tensor, offset: Tensor,
                   starts: Tensor, lengths: Tensor, budget: int, segment_ids: Tensor | None = None,
                   prefix_ids: Tensor | None = None) -> Segments | None:
    """Each run (a sequence, or a whole prompt tree when ``prefix_ids`` is given, then
    masked within) one per row; None unless it scores fewer query-key pairs than ``budget``."""
    n, L = starts.numel(), int(lengths.max())
    if n * L * L >= budget:
        return None
    index = torch.zeros(n, L, dtype=torch.long, device=flat.device)
    index[seq, offset] = flat
    if prefix_ids is None:
        sub = make_batch(positions.flatten()[index], lengths, None, None, None, None)
        sub.causal = True
    else:  # trees: the same-segment-or-prompt mask within each
        sub = make_batch(positions.flatten()[index], lengths, segment_ids.flatten()[index], None, None, None,
                         prefix_ids=prefix_ids.flatten()[index])
    return Segments(sub, index, flat, (seq, offset), shape)


def _runs(ids: Tensor, row: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Runs of equal ``ids`` within a row, over N tokens in row-major order: each token's
    run and offset in it ([N] each), each run's first token and length ([n] each)."""
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = (ids[1:] != ids[:-1]) | (row[1:] != row[:-1])
    seq = first.cumsum(0) - 1  # [N] run of each token
    starts = first.nonzero().squeeze(1)  # [n]
    offset = torch.arange(ids.numel(), device=ids.device) - starts[seq]
    return seq, offset, starts, torch.bincount(seq, minlength=starts.numel())


def _tree_segments(positions: Tensor, valid: Tensor, segment_ids: Tensor, prefix_ids: Tensor, flat: Tensor,
                   seq: Tensor, offset: Tensor, starts: Tensor, lengths: Tensor, budget: int) -> Segments | None:
    """Prompt trees one segment per query row: a shared prompt and each sample's own part
    are rows of their own, and a sample's row faces its prompt's keys followed by its own
    (``Batch.gather_keys``: the keys go back to the packed rows and are gathered from
    there). Attention then costs, per tree, prompt^2 + sum(own x (prompt + own)), not
    (prompt + sum(own))^2 as one masked row per tree would. None unless it scores fewer
    query-key pairs than ``budget``, or when the ids are not runs of increasing ids."""
    B, S = valid.shape
    device = flat.device
    row = flat // S
    sid, pre = segment_ids.flatten()[flat], prefix_ids.flatten()[flat]
    # each run's segment, as a (row, segment) identity, increasing along the row-major runs
    span = int(sid.max()) + 1
    ident = row[starts] * span + sid[starts]  # [n]
    if bool(sid.min() < 0) or (ident.numel() > 1 and bool((ident.diff() <= 0).any())):
        return None
    # the prompt run a run continues (itself when it continues none): found by its identity
    prompt_ident = row[starts] * span + pre[starts]  # [n]
    prompt_run = torch.searchsorted(ident, prompt_ident).clamp_(max=ident.numel() - 1)  # [n]
    if not torch.equal(ident[prompt_run], prompt_ident):  # a prompt that is not a run of this row
        return None
    shares = prompt_run != torch.arange(ident.numel(), device=device)  # [n] a sample's part of a tree
    p_start = flat[starts[prompt_run]]  # [n] flat position of the prompt's first token
    p_len = torch.where(shares, lengths[prompt_run], 0)  # [n]
    k_lengths = p_len + lengths  # [n]
    n, Lq, Lk = starts.numel(), int(lengths.max()), int(k_lengths.max())
    if n * Lq * Lk >= budget:
        return None
    index = torch.zeros(n, Lq, dtype=torch.long, device=device)
    index[seq, offset] = flat  # [n, Lq] flat position of each query; padding -> 0
    k_slot = torch.arange(Lk, device=device)
    own = flat[starts][:, None] + (k_slot[None, :] - p_len[:, None])  # [n, Lk]
    k_index = torch.where(k_slot[None, :] < p_len[:, None], p_start[:, None] + k_slot[None, :], own)
    k_has = k_slot[None, :] < k_lengths[:, None]  # [n, Lk]
    k_index = torch.where(k_has, k_index, 0)  # [n, Lk] flat positions of each row's keys
    q_has = torch.arange(Lq, device=device)[None, :] < lengths[:, None]  # [n, Lq]
    visible = k_has[:, None, :] & k_index[:, None, :].le(index[:, :, None])  # [n, Lq, Lk]: causal in the packed row
    visible = torch.where(q_has[:, :, None], visible, k_slot[None, None, :] == 0)  # padding queries: key 0

    def tree_keys(new: Tensor) -> Tensor:
        """[n, Lq, *D] keys of each query row -> [n, Lk, *D]: the prompt's, then its own."""
        return segments.scatter(new).flatten(0, 1)[k_index]

    sub = Batch(positions.flatten()[index], lengths, q_has, visible, gather_keys=tree_keys)
    segments = Segments(sub, index, flat, (seq, offset), (B, S))
    return segments


def mix(mixer: nn.Module, h: Tensor, batch: Batch, carry: Any) -> tuple[Tensor, Any]:
    """``mixer(h, batch, carry)``, on packed rows one sequence per row (see :class:`Segments`)."""
    seg = batch.segments
    if seg is None:
        return mixer(h, batch, carry)
    out, carry = mixer(seg.gather(h), seg.batch, carry)
    return seg.scatter(out), carry
