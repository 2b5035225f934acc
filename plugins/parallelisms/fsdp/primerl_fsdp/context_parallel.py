"""Context parallelism (CP): every packed row's tokens split over the ``cp`` ranks of a group.

What: each rank of a CP group holds 1/cp of every packed row and runs embeddings, norms,
MLPs/experts, the head and the loss on its own tokens only; attention layers see the keys
and values of the whole row, all-gathered over the group. This is how a 131k-token row
of GLM-5 fits: per-token activations (the bulk of the memory) shrink by cp, and only
the keys cross ranks.

How a row is split (:func:`split_for_cp`): the row is right-padded to a multiple of
2*cp and cut into 2*cp equal chunks; rank r holds chunks r and 2cp-1-r ("zigzag"), so
every rank has as many early (cheap) as late (expensive) causal queries and the
attention work is balanced. A rank's tokens are in local order chunk r, then chunk
2cp-1-r; :func:`cp_token_indices` gives the global index of each, and
:func:`gather_from_cp` puts per-token tensors back in global order.

How attention sees the whole row (:func:`apply_context_parallel_`): a forward hook on
the model makes :func:`primerl.models.batch.make_batch` build the batch of this rank's
slice (:class:`ContextParallelShard`). In it, :meth:`Batch.keys` all-gathers the keys
(differentiably: the backward reduce-scatters their gradients, summing what every
rank's queries sent back; gloo without reduce-scatter falls back to all-reduce + slice)
and reorders them to global token order; which key each query sees is computed from the
*global* token indices (causal) and the gathered segment ids (same sequence), never from
local order. Every sequence mixer reads other tokens' keys only through ``Batch.keys``,
so the attention modules run unchanged:

* GQA gathers k and v ([kv_heads, head_dim] per token, after RoPE);
* MLA gathers the compressed latent and the shared rope key (kv_lora + rope values per
  token, 576 for DeepSeek-V3: much smaller than per-head keys and values); each rank
  then expands them with ``kv_b_proj`` for its own queries;
* MLA + DSA (GLM-5): the indexer's key goes through ``Batch.keys`` too, so each local
  query scores the whole row's index keys; the top-k is chosen in global key order,
  exact ties going to the earlier key as in one process;
* Mamba-2 (Nemotron-H) is refused when CP is applied: its scan carries a state from
  token to token, so a rank would need the state at the end of the previous rank's
  chunk (state passing between ranks), which is not implemented.

Why not torch's ``torch.distributed.tensor.experimental.context_parallel`` (what
torchtitan uses): it shards buffers along the sequence and swaps
``scaled_dot_product_attention`` for ring attention, which supports ``is_causal`` but no
attention mask (``attn_bias is not supported``). Packed rows need a same-segment mask,
MLA attends eagerly (q.k and v head dims differ) and DSA restricts each query to its own
top-k keys: none of these go through SDPA's causal path. All-gathering the keys (what
Llama 3 did for document masks, and cheap for MLA, whose gathered latent is small)
supports any mask and keeps one attention code path for one process and for CP.

Attention layout, as in one process (:class:`~primerl.models.batch.Segments`): when
cheaper, this rank's queries are laid out one sequence per row, each facing the keys of
its own sequence only ([n, Lq] queries x [n, Lk] keys: sum of local queries x sequence
length); otherwise (or with the model's ``unpack_segments`` False) the masked rows,
``visible`` [B, S_local, S_row]. Either way a rank's attention costs about 1/cp of one
process's, balanced by the zigzag; the keys gathered are the whole rows' in both.

What the trainer does per forward (rows of :meth:`PackedBatch.rows`, the same on every
rank of a CP group, in the same order):

1. ``local = split_row_for_cp(row, cp_rank, cp_size)``: every per-token tensor
   (input_ids, positions, segment_ids, prefix_ids, targets, loss_mask, inference_logprobs,
   advantages, temperatures, replay_experts, ...) is padded and split the same way;
   ``lengths`` stays the whole rows' lengths (the model reads validity off the global
   token indices); ``local["valid"]`` [k, S_local] marks this rank's real tokens and
   ``local["token_index"]`` [S_local] their global indices.
2. ``model(local["input_ids"], local["positions"], local["lengths"],
   segment_ids=local["segment_ids"], prefix_ids=local["prefix_ids"], replay_experts=...,
   logits_for="all")`` on every rank (no cache; ``logits_for="last"`` is refused).
3. Logprobs of ``local["targets"]``, filtered by ``local["valid"]``; the loss with
   ``normalizer`` = the loss tokens of the *whole* step (over every rank of the CP group,
   and of the data-parallel groups if the loss is to be one mean over all of them), so
   that the sum of the ranks' losses is one process's loss.
4. ``loss.backward()`` on every rank, even one whose slice holds no loss token (its
   keys are other ranks' context: the backward's reduce-scatter needs every rank). Skip
   a forward only when the whole rows hold no loss token, decided the same on all ranks.

Gradients: a replicated parameter's gradient on one rank covers its own tokens (and
what other ranks' queries sent back to its keys); the gradient of the whole rows is the
*sum* over the CP ranks. FSDP2 over (dp_shard x cp) reduce-scatters gradients with a
mean by default, so either multiply each rank's loss by the FSDP group size or set
``set_gradient_divide_factor(1.0)`` on every FSDP module (sum) with the loss normalised as
above. In a test without FSDP, all-reduce (sum) each gradient over the group. Per-step
metrics that the trainer sums over rows (loss, metric sums, routing agreement counts,
router loads) must be all-reduced (sum) over the CP group too.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from primerl.errors import PrimerlError
from primerl.models.batch import Batch, RowShard, Segments, sharded_rows
from primerl.models.contract import CausalLM, Mixer

# sequence mixers whose layers read other tokens only through Batch.keys (or mix none)
SUPPORTED_MIXERS = (Mixer.NONE, Mixer.GQA, Mixer.MLA, Mixer.MLA_DSA)

# the models context parallel is applied to, and the shard each forward of theirs goes through
_applied: weakref.WeakKeyDictionary[nn.Module, ContextParallelShard] = weakref.WeakKeyDictionary()

# torch >= 2.13 names the single-tensor collectives *_single (the *_tensor names warn)
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# set once a backend turned out to lack reduce-scatter (gloo in older torch): all-reduce + slice
_reduce_scatter_missing: set[str] = set()


# ---------------------------------------------------------------------------------------
# How a row is split
# ---------------------------------------------------------------------------------------


def padded_length(seq_len: int, cp_size: int) -> int:
    """``seq_len`` rounded up to a multiple of 2 * cp_size (the zigzag's chunks)."""
    chunks = 2 * cp_size
    return -(-seq_len // chunks) * chunks


def cp_token_indices(padded_len: int, cp_rank: int, cp_size: int, device: Any = None) -> Tensor:
    """The global index of each of rank ``cp_rank``'s tokens in a row of ``padded_len``
    (a multiple of 2 * cp_size): chunk r, then chunk 2cp-1-r. [padded_len / cp_size] long."""
    if padded_len % (2 * cp_size):
        raise ValueError(f"a row of {padded_len} tokens cannot be cut into {2 * cp_size} equal chunks")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    chunk = padded_len // (2 * cp_size)
    offsets = torch.arange(chunk, device=device)
    return torch.cat([cp_rank * chunk + offsets, (2 * cp_size - 1 - cp_rank) * chunk + offsets])


def split_for_cp(tensor: Tensor, cp_rank: int, cp_size: int, *, pad_value: Any = 0) -> Tensor:
    """Rank ``cp_rank``'s tokens of rows [B, S, ...]: [B, S_pad / cp_size, ...], S_pad being
    S padded with ``pad_value`` to a multiple of 2 * cp_size (see :func:`cp_token_indices`)."""
    B, S = tensor.shape[:2]
    S_pad = padded_length(S, cp_size)
    if S_pad != S:
        pad = tensor.new_full((B, S_pad - S, *tensor.shape[2:]), pad_value)
        tensor = torch.cat([tensor, pad], dim=1)  # [B, S_pad, ...]
    return tensor.index_select(1, cp_token_indices(S_pad, cp_rank, cp_size, tensor.device))


# what pads each field of a PackedBatch row (0 / False for the others)
ROW_PAD_VALUES = {"segment_ids": -1, "prefix_ids": -1, "sample_index": -1, "temperatures": 1.0}


def split_row_for_cp(row: dict[str, Tensor | None], cp_rank: int, cp_size: int) -> dict[str, Tensor | None]:
    """Rank ``cp_rank``'s part of a :meth:`PackedBatch.rows` dict (``[k, m, ...]`` tensors):
    every per-token tensor split by :func:`split_for_cp` (padding: segment -1, temperature
    1, else 0), ``lengths`` [k] kept (the whole rows' valid tokens), plus ``valid``
    [k, S_local] (this rank's real tokens) and ``token_index`` [S_local] (their global
    indices)."""
    lengths = row["lengths"]
    if lengths is None:
        raise ValueError("a row needs its lengths")
    k, m = row["input_ids"].shape
    out: dict[str, Tensor | None] = {}
    for name, tensor in row.items():
        if name == "lengths" or tensor is None:
            out[name] = tensor
        elif tensor.dim() >= 2 and tensor.shape[:2] == (k, m):
            out[name] = split_for_cp(tensor, cp_rank, cp_size, pad_value=ROW_PAD_VALUES.get(name, 0))
        else:
            raise ValueError(f"row field {name!r} of shape {tuple(tensor.shape)} is not per token ([{k}, {m}, ...])")
    token_index = cp_token_indices(padded_length(m, cp_size), cp_rank, cp_size, lengths.device)
    out["token_index"] = token_index  # [S_local]
    out["valid"] = token_index[None, :] < lengths[:, None]  # [k, S_local]
    return out


# dtypes gloo cannot all-gather, sent as int32
_WIDENED = (torch.bool, torch.int16, torch.uint16)


def gather_from_cp(local: Tensor, cp_group: dist.ProcessGroup | None, *, seq_len: int | None = None) -> Tensor:
    """The whole rows from every rank's part: [B, S_local, ...] -> [B, S_pad, ...] in global
    token order (cut to ``seq_len`` when given). Differentiable: the backward hands each
    rank the sum of the gradients of its tokens."""
    size = dist.get_world_size(cp_group)
    B, S_local = local.shape[:2]
    if local.dtype in _WIDENED:  # gloo gathers no bool or int16 (valid masks, expert ids)
        return gather_from_cp(local.to(torch.int32), cp_group, seq_len=seq_len).to(local.dtype)
    gathered = _AllGatherRows.apply(local, cp_group)  # [cp * B, S_local, ...], rank-major
    src_rank, src_local = _sources(S_local * size, size, local.device)  # [S_pad] each
    rows = gathered.view(size, B, S_local, *local.shape[2:])[src_rank, :, src_local]  # [S_pad, B, ...]
    rows = rows.transpose(0, 1)  # [B, S_pad, ...]
    return rows if seq_len is None else rows[:, :seq_len]


@lru_cache(maxsize=64)
def _sources(padded_len: int, cp_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """For each global index of a row: the rank that holds the token and its local index
    (computed once per row length: every layer of a forward asks)."""
    S_local = padded_len // cp_size
    src_rank = torch.empty(padded_len, dtype=torch.long, device=device)
    src_local = torch.empty(padded_len, dtype=torch.long, device=device)
    local = torch.arange(S_local, device=device)
    for r in range(cp_size):
        index = cp_token_indices(padded_len, r, cp_size, device)
        src_rank[index] = r
        src_local[index] = local
    return src_rank, src_local


class _AllGatherRows(torch.autograd.Function):
    """[B, ...] on every rank -> [cp * B, ...] (rank r's rows at r*B:(r+1)*B). Backward: the
    sum over ranks of the gradient of this rank's rows (a reduce-scatter)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = local.new_empty(size * local.shape[0], *local.shape[1:])
        _all_gather_single(out, local.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        group = ctx.group
        size = dist.get_world_size(group)
        grad = grad.contiguous()
        out = grad.new_empty(grad.shape[0] // size, *grad.shape[1:])
        backend = str(dist.get_backend(group))
        if backend not in _reduce_scatter_missing:
            try:
                _reduce_scatter_single(out, grad, group=group)
                return out, None
            except RuntimeError as exc:  # raised before any communication, the same on every rank
                if "support" not in str(exc):
                    raise
                _reduce_scatter_missing.add(backend)
        total = grad.clone()  # never reduce autograd's own buffer in place
        dist.all_reduce(total, group=group)
        return total.view(size, *out.shape)[dist.get_rank(group)].clone(), None


# ---------------------------------------------------------------------------------------
# The batch of this rank's slice
# ---------------------------------------------------------------------------------------


class ContextParallelShard(RowShard):
    """Builds the :class:`~primerl.models.batch.Batch` of this rank's tokens (see the module
    docstring); installed on a model by :func:`apply_context_parallel_`."""

    def __init__(self, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)
        self.unpack_segments = True  # the model's own choice, read at each forward (enter)
        self._active: list[AbstractContextManager] = []  # one per forward in progress

    def gather_keys(self, new: Tensor) -> Tensor:
        """This rank's keys [B, S_local, *D] -> the whole rows' [B, S_row, *D], global order."""
        return gather_from_cp(new, self.group)

    def make_batch(self, positions: Tensor, lengths: Tensor, segment_ids: Tensor | None,
                   prefix_ids: Tensor | None = None) -> Batch:
        """positions, segment_ids, prefix_ids: [B, S_local] (split by :func:`split_for_cp`;
        ``prefix_ids`` for prompt trees, see ``primerl.trainer.packing``); lengths: [B]
        valid tokens of the whole rows."""
        B, S_local = positions.shape
        S_row = S_local * self.size
        if S_local % 2:
            raise ValueError(f"{S_local} tokens per row on this rank: context-parallel rows must be split by "
                             f"split_for_cp (two equal chunks per rank)")
        if bool((lengths > S_row).any()):
            raise ValueError(f"lengths {lengths.tolist()} exceed the {S_row} tokens of the split rows")
        device = positions.device
        token_index = cp_token_indices(S_row, self.rank, self.size, device)  # [S_local] global indices
        key_index = torch.arange(S_row, device=device)  # [S_row]
        valid = token_index[None, :] < lengths[:, None]  # [B, S_local]
        row_segments = None
        if segment_ids is not None:
            with torch.no_grad():
                row_segments = gather_from_cp(segment_ids, self.group)  # [B, S_row]
            if self.unpack_segments:
                segments = self._segments(positions, lengths, valid, segment_ids, row_segments, token_index,
                                          prefix_ids)
                if segments is not None:
                    return Batch(positions, lengths, valid, None, segment_ids,  # type: ignore[arg-type]
                                 segments=segments, gather_keys=self.gather_keys, prefix_ids=prefix_ids)
        visible = key_index[None, None, :] <= token_index[None, :, None]  # [1, S_local, S_row] causal
        if row_segments is not None:
            same = segment_ids[:, :, None] == row_segments[:, None, :]  # [B, S_local, S_row]
            if prefix_ids is not None:  # and the keys of the prompt the query's segment continues
                same = same | (prefix_ids[:, :, None] == row_segments[:, None, :])
            visible = visible & same
        # padding queries look at key 0 only: finite outputs, no all-masked softmax rows
        visible = torch.where(valid[:, :, None], visible, key_index[None, None, :] == 0)  # [B, S_local, S_row]
        return Batch(positions, lengths, valid, visible, segment_ids, gather_keys=self.gather_keys,
                     prefix_ids=prefix_ids)

    def _segments(self, positions: Tensor, lengths: Tensor, valid: Tensor, segment_ids: Tensor,
                  row_segments: Tensor, token_index: Tensor, prefix_ids: Tensor | None = None) -> Segments | None:
        """This rank's queries one sequence per row, each facing its whole sequence's keys
        (what :class:`~primerl.models.batch.Segments` does in one process): attention costs
        sum(local queries x sequence length) instead of S_local x S_row. With prompt trees
        (``prefix_ids``) a sequence is a whole tree, masked within. None when that is not
        cheaper, or the ids are not runs of increasing ids (the masked rows then)."""
        B, S_local = valid.shape
        S_row = row_segments.shape[1]
        device = valid.device
        flat = valid.flatten().nonzero().squeeze(1)  # [N] this rank's valid tokens, row-major
        if flat.numel() == 0:
            return None
        units, row_units = segment_ids, row_segments  # what makes a sequence: a segment, or a tree
        if prefix_ids is not None:
            units = prefix_ids
            with torch.no_grad():
                row_units = gather_from_cp(prefix_ids, self.group)  # [B, S_row]
        # queries: runs of one unit in a local row (chunk r then chunk 2cp-1-r: global order)
        q_row, q_sid = flat // S_local, units.flatten()[flat]
        first = torch.ones_like(q_sid, dtype=torch.bool)
        first[1:] = (q_sid[1:] != q_sid[:-1]) | (q_row[1:] != q_row[:-1])
        seq = first.cumsum(0) - 1  # [N] sequence of each query
        q_starts = first.nonzero().squeeze(1)  # [n]
        offset = torch.arange(flat.numel(), device=device) - q_starts[seq]
        q_lengths = torch.bincount(seq, minlength=q_starts.numel())  # [n]
        # keys: runs of one segment in the whole rows' valid tokens
        k_valid = torch.arange(S_row, device=device)[None, :] < lengths[:, None]  # [B, S_row]
        k_flat = k_valid.flatten().nonzero().squeeze(1)  # [M] the rows' valid tokens, row-major
        k_row, k_sid = k_flat // S_row, row_units.flatten()[k_flat]
        k_first = torch.ones_like(k_sid, dtype=torch.bool)
        k_first[1:] = (k_sid[1:] != k_sid[:-1]) | (k_row[1:] != k_row[:-1])
        k_seq = k_first.cumsum(0) - 1  # [M] key sequence of each valid key
        k_starts = k_first.nonzero().squeeze(1)  # [m]
        # each query sequence's key sequence, matched by (row, segment id)
        span = int(torch.maximum(q_sid.max(), k_sid.max())) + 1
        k_ident = k_row[k_starts] * span + k_sid[k_starts]  # [m]
        if k_sid.min() < 0 or q_sid.min() < 0 or (k_ident.numel() > 1 and bool((k_ident.diff() <= 0).any())):
            return None  # not runs of increasing ids: leave it to the masked rows
        q_ident = q_row[q_starts] * span + q_sid[q_starts]  # [n]
        match = torch.searchsorted(k_ident, q_ident)  # [n]
        k_lengths = torch.bincount(k_seq, minlength=k_starts.numel())[match]  # [n]
        n, Lq, Lk = q_starts.numel(), int(q_lengths.max()), int(k_lengths.max())
        if n * Lq * Lk >= B * S_local * S_row:
            return None
        q_index = torch.zeros(n, Lq, dtype=torch.long, device=device)
        q_index[seq, offset] = flat  # [n, Lq] local flat position of each query; padding -> 0
        k_slot = torch.arange(Lk, device=device)
        k_has = k_slot[None, :] < k_lengths[:, None]  # [n, Lk]
        k_index = torch.where(k_has, k_flat[k_starts[match]][:, None] + k_slot[None, :], 0)  # [n, Lk] flat in [B*S_row]
        q_global = token_index[q_index % S_local]  # [n, Lq]
        q_has = torch.arange(Lq, device=device)[None, :] < q_lengths[:, None]  # [n, Lq]
        visible = k_has[:, None, :] & (k_index % S_row)[:, None, :].le(q_global[:, :, None])  # [n, Lq, Lk]
        if prefix_ids is not None:  # within a tree: the query's own segment and the prompt it continues
            k_seg = row_segments.flatten()[k_index][:, None, :]  # [n, 1, Lk]
            q_seg, q_pre = segment_ids.flatten()[q_index][:, :, None], prefix_ids.flatten()[q_index][:, :, None]
            visible = visible & ((k_seg == q_seg) | (k_seg == q_pre))
        visible = torch.where(q_has[:, :, None], visible, k_slot[None, None, :] == 0)  # padding queries: key 0

        def gather_sequence_keys(new: Tensor) -> Tensor:
            """[n, Lq, *D] keys of this rank's queries -> [n, Lk, *D] their sequences' keys."""
            rows = gather_from_cp(segments.scatter(new), self.group)  # [B, S_row, *D]
            return rows.flatten(0, 1)[k_index]

        per_sequence = Batch(positions.flatten()[q_index], q_lengths, q_has, visible, gather_keys=gather_sequence_keys)
        segments = Segments(per_sequence, q_index, flat, (seq, offset), (B, S_local))
        return segments

    # forward hooks of the model: make_batch goes through this shard during its forwards

    def enter(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if kwargs.get("cache") is not None:
            raise PrimerlError("a context-parallel model runs training forwards only: no cache")
        if kwargs.get("logits_for", "all") != "all":
            raise PrimerlError("a context-parallel model returns logits for its own tokens: "
                               "logits_for must be 'all'")
        self.unpack_segments = bool(module.unpack_segments)
        active = sharded_rows(self)
        active.__enter__()
        self._active.append(active)

    def exit(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self._active:  # empty when enter refused the forward
            self._active.pop().__exit__(None, None, None)


def context_parallel_shard(model: nn.Module) -> ContextParallelShard | None:
    """The shard :func:`apply_context_parallel_` installed on ``model`` (None: not applied)."""
    return _applied.get(model)


def apply_context_parallel_(model: CausalLM, cp_group: dist.ProcessGroup | None) -> None:
    """Make ``model`` (a :class:`~primerl.models.contract.CausalLM`) run on this rank's part of
    every row, attention seeing the whole rows over ``cp_group`` (None: the default group).

    Raises :class:`~primerl.errors.PrimerlError` for a layer whose sequence mixer cannot be
    split (Mamba-2) or is unknown, and when applied twice. A group of one rank changes
    nothing. Call before wrapping the model with FSDP (the hooks sit on the model itself).
    """
    if dist.get_world_size(cp_group) == 1:
        return
    if model in _applied:
        raise PrimerlError("context parallelism is already applied to this model")
    name = type(model).__name__
    for index, layer in enumerate(model.parallel_plan().layers):
        mixer = layer.mixer
        if mixer is Mixer.MAMBA2:
            raise PrimerlError(
                f"context parallel (cp > 1) cannot split layer {index} of {name}: its sequence mixer is "
                f"'mamba2', a scan over the sequence whose state would have to pass from rank to rank "
                f"(not implemented); train this model with cp = 1"
            )
        if mixer not in SUPPORTED_MIXERS:
            raise PrimerlError(
                f"context parallel (cp > 1) cannot split layer {index} of {name}: its sequence mixer is "
                f"{mixer.value!r} (supported: gqa, mla, mla_dsa); train this model with cp = 1"
            )
    shard = ContextParallelShard(cp_group)
    _applied[model] = shard
    model.register_forward_pre_hook(shard.enter, with_kwargs=True)
    model.register_forward_hook(shard.exit, always_call=True)
