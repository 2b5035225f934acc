"""Expert parallelism (EP): each rank of an ``ep`` process group holds E/ep whole routed
experts of every MoE layer and computes them for the tokens of every rank.

Why: the routed experts are almost all of a large MoE model's weights (Kimi K2: 384
experts per layer). Sharding them whole, rather than slicing every expert as FSDP does,
lets each rank run its experts' GEMMs on all the tokens routed to them, and a
token-expert pair crosses the network twice (there and back) instead of every expert's
weights being all-gathered every step.

How (torchtitan's ``ExpertParallel`` token dispatcher, in primerl's terms):

1. :func:`shard_experts_` keeps this rank's contiguous slice of experts
   ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` in each routed-experts module the model's plan
   declares (:class:`~primerl.models.experts.Experts`, ``parallel_plan().experts``): its 3D parameters (same names, ``[E/ep, ...]``) and mixes
   :class:`ExpertParallelMixin` into its class, so a subclass of ``Experts`` (FP8
   experts...) keeps its own compute.
2. Forward (:meth:`ExpertParallelMixin.forward`): the valid token-expert pairs are
   sorted by expert, hence by owning rank; the per-expert counts are exchanged
   (``all_to_all_single``, E/ep counts per rank pair), then the pairs' hidden states
   and routing weights travel in one ``all_to_all_single`` with variable splits. The
   owner runs the parent ``Experts.forward`` on what it received, one row per pair
   (``top_k = 1``, local expert ids), and the reverse ``all_to_all_single`` brings each
   pair's weighted output home, where each token sums its pairs in increasing expert
   order, as ``Experts`` does: same results up to float rounding.
3. Backward: :class:`_AllToAll` is an autograd Function whose backward is the same
   exchange with the splits swapped, so hidden states, routing weights (hence the
   routers) and the local experts all get exact gradients. Every rank of the group must
   run every MoE layer forward and backward, with or without valid tokens: a rank that
   receives no pairs still joins the backward exchanges and gives its experts a zero
   gradient (what FSDP2's reduce-scatter expects on every rank).

Order of wrapping: :func:`shard_experts_` before FSDP2's ``fully_shard`` (which then
shards each rank's expert slice over the other dp ranks, torchtitan's
``dp_shard_mod_ep``); both swap the module's class, and they compose.

Router replay (R3) needs nothing here: replayed ids are ids, and reach their owners.
On GPUs, when ``deep_ep`` is importable and the activations are bf16, DeepEP's fused
``dispatch``/``combine`` replace the two exchanges (tokens go once per destination rank,
not once per pair, over NVLink/RDMA with its own kernels); the same Function wrapping
as Megatron-LM's ``fused_a2a``. That path is small and **untested here** (no GPUs, no
DeepEP in CI); the ``all_to_all_single`` path runs on gloo (CPU) and NCCL alike.

Publishing and checkpoints: :func:`gather_experts` rebuilds one module's full ``[E, ...]``
tensors on one rank (module by module, so no rank holds the whole model), and
:func:`local_expert_slice` cuts a rank's share out of a full checkpoint tensor.
Gradient clipping: :func:`expert_grad_sq_norm`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from primerl.errors import PrimerlError
from primerl.models.contract import CausalLM
from primerl.models.experts import Experts

__all__ = [
    "ExpertParallelMixin",
    "expert_grad_sq_norm",
    "expert_parameters",
    "gather_experts",
    "local_expert_slice",
    "shard_experts_",
]

DISPATCHERS = ("auto", "all_to_all", "deep_ep")


# ---------------------------------------------------------------------------------------
# Sharding
# ---------------------------------------------------------------------------------------


def shard_experts_(model: CausalLM, ep_group: dist.ProcessGroup | None = None, *,
                   dispatcher: str = "auto") -> list[str]:
    """Shard every ``Experts`` module of ``model.parallel_plan().experts`` over ``ep_group``,
    in place; returns those module names (a ``Shard("experts", "ep", modules=...)``).

    Each module keeps experts ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)`` in its parameters
    and in any buffer with a leading expert dimension (same names, ``[E/ep, ...]``), and
    becomes ``ExpertParallel<Class>``: its forward dispatches token-expert pairs to their
    owners. Every rank must build the model with the same weights (same seed) or load its
    slice (:func:`local_expert_slice`); works on a model on the ``meta`` device too (shard,
    then ``to_empty`` and load). Call it before FSDP wraps the model.

    ``dispatcher``: ``auto`` (DeepEP for bf16 CUDA activations when ``deep_ep`` imports,
    else ``all_to_all_single``), ``all_to_all`` or ``deep_ep``.
    Raises PrimerlError when E is not a multiple of the ep size.
    """
    if dispatcher not in DISPATCHERS:
        raise PrimerlError(f"expert-parallel dispatcher must be one of {', '.join(DISPATCHERS)}, got {dispatcher!r}")
    ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    names = list(model.parallel_plan().experts)
    modules = [model.get_submodule(name) for name in names]
    for name, module in zip(names, modules):  # check all before changing any
        if not isinstance(module, Experts):
            raise PrimerlError(f"{name} is a {type(module).__name__}, not an Experts module: cannot shard its experts")
        if isinstance(module, ExpertParallelMixin):
            raise PrimerlError(f"{name} is already expert-parallel")
        n_experts = module.down_proj.shape[0]
        if n_experts % ep_size:
            raise PrimerlError(
                f"expert parallel needs the routed experts to split evenly over ep ranks: the model has "
                f"{n_experts} experts per MoE layer ({name}), which ep={ep_size} does not divide; "
                f"choose an ep size that divides {n_experts}"
            )
    for module in modules:
        _shard_module_(module, ep_group, ep_rank, ep_size, dispatcher)
    return names


def _shard_module_(module: Experts, ep_group: Any, ep_rank: int, ep_size: int, dispatcher: str) -> None:
    n_experts = module.down_proj.shape[0]
    per_rank = n_experts // ep_size
    sharded = []
    with torch.no_grad():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.dim() and p.shape[0] == n_experts:
                local = p.detach().narrow(0, ep_rank * per_rank, per_rank).clone()  # [E/ep, ...]: frees the rest
                setattr(module, name, nn.Parameter(local, requires_grad=p.requires_grad))
                sharded.append(name)
        for name, b in list(module.named_buffers(recurse=False)):
            if b is not None and b.dim() and b.shape[0] == n_experts:
                module._buffers[name] = b.narrow(0, ep_rank * per_rank, per_rank).clone()
                sharded.append(name)
    module.__dict__.pop("_derived", None)  # tensors cached from the full weights
    module.ep_group, module.ep_rank, module.ep_size = ep_group, ep_rank, ep_size
    module.num_experts, module.experts_per_rank = n_experts, per_rank  # global E, E/ep
    module.ep_sharded, module.ep_dispatcher = tuple(sharded), dispatcher
    module.__class__ = _expert_parallel_class(type(module))


_EP_CLASSES: dict[type, type] = {}


def _expert_parallel_class(cls: type) -> type:
    """``ExpertParallel<cls>``: the mixin first, so its forward wraps ``cls.forward``."""
    if cls not in _EP_CLASSES:
        _EP_CLASSES[cls] = type("ExpertParallel" + cls.__name__, (ExpertParallelMixin, cls), {})
    return _EP_CLASSES[cls]


def local_expert_slice(full_tensor: Tensor, ep_rank: int, ep_size: int) -> Tensor:
    """Rank ``ep_rank``'s experts of a full ``[E, ...]`` tensor (a checkpoint's): a view of
    rows ``[ep_rank * E/ep, (ep_rank + 1) * E/ep)``, to copy into the sharded parameter."""
    n_experts = full_tensor.shape[0]
    if n_experts % ep_size:
        raise PrimerlError(f"a tensor of {n_experts} experts does not split over ep={ep_size} ranks")
    per_rank = n_experts // ep_size
    return full_tensor.narrow(0, ep_rank * per_rank, per_rank)


def expert_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every expert-sharded parameter of ``model`` (names as in
    ``model.named_parameters()``): the ones FSDP must not shard over the ep ranks and
    :func:`expert_grad_sq_norm` counts."""
    for module_name, module in model.named_modules():
        if isinstance(module, ExpertParallelMixin):
            for name in module.ep_sharded:
                p = module._parameters.get(name)
                if p is not None:
                    yield f"{module_name}.{name}" if module_name else name, p


# ---------------------------------------------------------------------------------------
# The expert-parallel forward
# ---------------------------------------------------------------------------------------


class ExpertParallelMixin:
    """Mixed into an ``Experts`` class by :func:`shard_experts_`: the forward dispatches
    token-expert pairs to the ranks owning their experts and combines the results.

    Attributes set by :func:`shard_experts_`: ``ep_group``, ``ep_rank``, ``ep_size``,
    ``num_experts`` (E, all ranks), ``experts_per_rank`` (E/ep), ``ep_sharded`` (the
    sliced tensor names), ``ep_dispatcher``.
    """

    ep_group: Any
    ep_rank: int
    ep_size: int
    num_experts: int
    experts_per_rank: int
    ep_sharded: tuple[str, ...]
    ep_dispatcher: str

    def forward(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """As ``Experts.forward`` with global expert ids: x [N, hidden]; ids, weights
        [N, top_k]; valid [N] bool. Returns [N, hidden]. Every rank of the ep group must
        call it (it runs collectives), with any N, zero included."""
        if self._use_deep_ep(x):
            return self._forward_deep_ep(x, ids, weights, valid)
        return self._forward_all_to_all(x, ids, weights, valid)

    def _forward_all_to_all(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        group, ep, per_rank = self.ep_group, self.ep_size, self.experts_per_rank
        # The valid pairs, sorted by expert (stable: by token within an expert), so by owner.
        tok, slot = valid[:, None].expand_as(ids).nonzero(as_tuple=True)  # [P] each
        expert = ids[tok, slot]  # [P] global ids
        order = expert.argsort(stable=True)
        tok, slot, expert = tok[order], slot[order], expert[order]

        # Pairs per (rank, local expert), both ways: [ep, E/ep] each.
        send_counts = torch.bincount(expert, minlength=self.num_experts)  # [E]: to rank e // (E/ep)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=group)
        recv_counts = recv_counts.view(ep, per_rank)  # [from rank, local expert]
        send_splits, recv_splits = torch.stack([send_counts.view(ep, per_rank).sum(1),
                                                recv_counts.sum(1)]).tolist()  # one sync

        x_recv, w_recv = _AllToAll.apply(send_splits, recv_splits, group,
                                         x[tok], weights[tok, slot])  # [R, hidden], [R]
        # Received rows come rank by rank, each rank's sorted by local expert.
        local_ids = torch.arange(per_rank, device=x.device).repeat(ep)  # [ep * E/ep]
        local_ids = local_ids.repeat_interleave(recv_counts.flatten())[:, None]  # [R, 1]
        all_valid = torch.ones(x_recv.shape[0], dtype=torch.bool, device=x.device)
        if x_recv.shape[0]:
            y_recv = super().forward(x_recv, local_ids, w_recv[:, None], all_valid)  # [R, hidden]
        else:
            y_recv = self._no_rows_result(x_recv, w_recv)  # [0, hidden]
        (y_back,) = _AllToAll.apply(recv_splits, send_splits, group, y_recv)  # [P, hidden], sent order
        # Each token sums its pairs in increasing expert order (CPU index_add_ adds in index
        # order; on CUDA in atomics' order, as Experts does).
        return torch.zeros_like(x).index_add_(0, tok, y_back.to(x.dtype))

    def _no_rows_result(self, x_recv: Tensor, w_recv: Tensor) -> Tensor:
        """The empty [0, hidden] result of a rank that received no pairs (``Experts`` cannot
        run on zero rows), still *depending* on the received tensors and on every local
        expert parameter: without that, autograd would skip this rank's backward
        exchanges while the other ranks wait in them, and the experts would get no
        gradient at all where FSDP's reduce-scatter needs one (zero) on every rank."""
        y = x_recv * 0 + (w_recv[:, None] * 0).to(x_recv.dtype)  # [0, hidden]
        if torch.is_grad_enabled():
            for p in self.parameters(recurse=False):
                if p.requires_grad:
                    y = y + (p.sum() * 0).to(y.dtype)
        return y

    # -- DeepEP (GPU) ---------------------------------------------------------------

    def _use_deep_ep(self, x: Tensor) -> bool:
        if self.ep_dispatcher == "all_to_all" or not x.is_cuda:
            return False
        wanted = self.ep_dispatcher == "deep_ep"
        if x.dtype != torch.bfloat16:  # DeepEP's normal kernels move bf16 (or FP8) activations
            if wanted:
                raise PrimerlError(f"the deep_ep dispatcher needs bfloat16 activations, got {x.dtype}")
            return False
        if not _deep_ep_importable():
            if wanted:
                raise PrimerlError("dispatcher 'deep_ep' needs the deep_ep package (github.com/deepseek-ai/DeepEP)")
            return False
        return True

    def _forward_deep_ep(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """DeepEP normal-mode dispatch/combine: each token goes once to every rank owning
        one of its experts; received ``topk_idx`` are local ids, -1 for other ranks'.
        UNTESTED here (no GPUs in CI): mirrors Megatron-LM's ``fused_a2a``."""
        routed = torch.where(valid[:, None], ids, -1).long()  # [N, k]; -1: not sent
        x_recv, idx_recv, w_recv, handle = _DeepEPDispatch.apply(
            x.contiguous(), routed, weights.float(), self.num_experts, self.ep_group)  # [M, hidden], [M, k] x2
        row, slot = (idx_recv >= 0).nonzero(as_tuple=True)  # pairs of the local experts
        local = idx_recv[row, slot]
        order = local.argsort(stable=True)
        row, slot, local = row[order], slot[order], local[order]
        all_valid = torch.ones(row.shape[0], dtype=torch.bool, device=x.device)
        w_pairs = w_recv[row, slot].to(weights.dtype)  # [P]
        if row.shape[0]:
            y = super().forward(x_recv[row], local[:, None], w_pairs[:, None], all_valid)  # [P, hidden]
        else:
            y = self._no_rows_result(x_recv[row], w_pairs)
        partial = torch.zeros_like(x_recv).index_add_(0, row, y.to(x_recv.dtype))  # [M, hidden]: this rank's sum
        return _DeepEPCombine.apply(partial, handle, self.ep_group)  # [N, hidden]: summed over ranks


# ---------------------------------------------------------------------------------------
# Autograd collectives
# ---------------------------------------------------------------------------------------


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of row-aligned tensors (each [P, ...], any dtypes) in one
    exchange: their rows are packed as bytes side by side. Rank i sends ``send_splits[j]``
    rows to rank j and receives ``recv_splits[j]`` from it. Backward: the same exchange of
    the gradients with the splits swapped. One autograd node per exchange keeps every
    rank's backward collectives in the same order."""

    @staticmethod
    def forward(ctx, send_splits: list[int], recv_splits: list[int], group: Any, *tensors: Tensor):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(tensors, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        return (None, None, None, *_exchange(grads, ctx.recv_splits, ctx.send_splits, ctx.group))


def _exchange(tensors: tuple[Tensor, ...], send_splits: list[int], recv_splits: list[int],
              group: Any) -> tuple[Tensor, ...]:
    """The all_to_all_single of :class:`_AllToAll`, without autograd."""
    n_recv = sum(recv_splits)
    if len(tensors) == 1:
        t = tensors[0].contiguous()
        out = t.new_empty((n_recv, *t.shape[1:]))
        dist.all_to_all_single(out, t, recv_splits, send_splits, group=group)
        return (out,)
    n_send = tensors[0].shape[0]
    rows = [t.detach().reshape(n_send, math.prod(t.shape[1:])).contiguous().view(torch.uint8)
            for t in tensors]  # [P, bytes_i]
    widths = [r.shape[1] for r in rows]
    packed = torch.cat(rows, dim=1)  # [P, sum(bytes)]
    out = packed.new_empty((n_recv, packed.shape[1]))
    dist.all_to_all_single(out, packed, recv_splits, send_splits, group=group)
    return tuple(
        part.contiguous().view(t.dtype).view(n_recv, *t.shape[1:])
        for part, t in zip(out.split(widths, dim=1), tensors)
    )


_deep_ep_buffer: Any = None


@functools.cache
def _deep_ep_importable() -> bool:
    """Whether ``deep_ep`` imports (asked once: a failing import is slow to repeat)."""
    try:
        import deep_ep  # noqa: F401
    except ImportError:
        return False
    return True


def _deep_ep_buffer_for(group: Any, x: Tensor) -> Any:
    """One DeepEP ``Buffer`` per process, grown as needed (as Megatron-LM's ``get_buffer``)."""
    global _deep_ep_buffer
    from deep_ep import Buffer

    hidden_bytes = x.shape[1] * max(x.element_size(), 2)
    nvl, rdma = 0, 0
    for config in (Buffer.get_dispatch_config(group.size()), Buffer.get_combine_config(group.size())):
        nvl = max(config.get_nvl_buffer_size_hint(hidden_bytes, group.size()), nvl)
        rdma = max(config.get_rdma_buffer_size_hint(hidden_bytes, group.size()), rdma)
    buf = _deep_ep_buffer
    if buf is None or buf.group != group or buf.num_nvl_bytes < nvl or buf.num_rdma_bytes < rdma:
        _deep_ep_buffer = buf = Buffer(group, nvl, rdma)
    return buf


class _DeepEPDispatch(torch.autograd.Function):
    """DeepEP dispatch; backward is a combine of the gradients (untested here)."""

    @staticmethod
    def forward(ctx, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, num_experts: int, group: Any):
        buf = _deep_ep_buffer_for(group, x)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = buf.get_dispatch_layout(topk_idx, num_experts)
        x_recv, idx_recv, w_recv, _, handle, _ = buf.dispatch(
            x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
        ctx.group, ctx.handle = group, handle
        ctx.mark_non_differentiable(idx_recv)
        return x_recv, idx_recv, w_recv, handle

    @staticmethod
    def backward(ctx, grad_x, _grad_idx, grad_w, _grad_handle):
        buf = _deep_ep_buffer_for(ctx.group, grad_x)
        grad_x, grad_w, _ = buf.combine(grad_x.contiguous(), ctx.handle, topk_weights=grad_w.float())
        return grad_x, None, grad_w, None, None


class _DeepEPCombine(torch.autograd.Function):
    """DeepEP combine (sums each token's partial results over ranks); backward is a
    dispatch of the gradients with the cached layout (untested here)."""

    @staticmethod
    def forward(ctx, x: Tensor, handle: Any, group: Any):
        combined, _, _ = _deep_ep_buffer_for(group, x).combine(x, handle=handle)
        ctx.group, ctx.handle = group, handle
        return combined

    @staticmethod
    def backward(ctx, grad):
        grad_x, *_ = _deep_ep_buffer_for(ctx.group, grad).dispatch(grad.contiguous(), handle=ctx.handle)
        return grad_x, None, None


# ---------------------------------------------------------------------------------------
# Publishing, checkpoints, gradient clipping
# ---------------------------------------------------------------------------------------


@torch.no_grad()
def gather_experts(module: nn.Module, ep_group: dist.ProcessGroup | None = None, dst: int = 0) -> dict[str, Tensor]:
    """``{tensor name in module: full [E, ...] tensor}`` of one expert-sharded module on the
    ep group's rank ``dst``; an empty dict on the other ranks. Every rank of the group must
    call it (it runs one ``gather`` per tensor). Call it module by module when publishing,
    so no rank holds more than one layer's full experts. Tensors FSDP shards as DTensors
    are first all-gathered over their own mesh (every rank of that mesh must call too).
    A module that is not expert-parallel gives its own tensors on ``dst``."""
    rank = dist.get_rank(ep_group)
    if not isinstance(module, ExpertParallelMixin):
        return {n: p.detach() for n, p in module.named_parameters(recurse=False)} if rank == dst else {}
    ep = dist.get_world_size(ep_group)
    full: dict[str, Tensor] = {}
    for name in module.ep_sharded:
        local = _full_local(getattr(module, name)).detach().contiguous()  # [E/ep, ...]
        parts = [torch.empty_like(local) for _ in range(ep)] if rank == dst else None
        dist.gather(local, parts, dst=_global_rank(ep_group, dst), group=ep_group)
        if parts is not None:
            full[name] = torch.cat(parts)  # [E, ...]
    return full


def _global_rank(group: Any, group_rank: int) -> int:
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def _full_local(t: Tensor) -> Tensor:
    """A rank's whole expert slice: ``t``, or the all-gathered tensor of an FSDP DTensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def expert_grad_sq_norm(model: nn.Module, ep_group: dist.ProcessGroup | None = None) -> Tensor:
    """The squared L2 norm of the gradients of all experts of all ranks: the sum of squares
    of this rank's expert-sharded gradients (:func:`expert_parameters`), all-reduced over
    ``ep_group`` (and over the shard dims of their mesh when FSDP made them DTensors).
    A float32 scalar, equal on every rank; missing gradients count as zero.

    For gradient clipping, add it to the squared norm of every *other* gradient (computed
    without the expert parameters, so none counts twice, and reduced over the ranks that
    shard those) and clip all gradients by ``max_norm / (sqrt(total) + 1e-6)``::

        dense = [p for n, p in model.named_parameters() if n not in dict(expert_parameters(model))]
        total = dense_sq_norm(dense) + expert_grad_sq_norm(model, ep_group)
        coef = (max_norm / (total.sqrt() + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_([p.grad for p in model.parameters() if p.grad is not None], coef)
    """
    from torch.distributed.tensor import DTensor

    device = next((p.device for _, p in expert_parameters(model)), torch.device("cpu"))
    sums: dict[tuple[Any, ...], Tensor] = {}  # shard groups to reduce over -> local sum of squares
    for _, p in expert_parameters(model):
        groups: tuple[Any, ...] = ()
        if isinstance(p, DTensor):
            groups = tuple(p.device_mesh.get_group(d) for d, pl in enumerate(p.placements) if pl.is_shard())
        g = p.grad
        if isinstance(g, DTensor):
            g = g.to_local()
        sq = g.detach().float().pow(2).sum() if g is not None else torch.zeros((), device=device)
        sums[groups] = sums.get(groups, torch.zeros((), device=device)) + sq
    total = torch.zeros((), device=device)
    for groups, sq in sums.items():  # same keys, same order on every rank (from the parameters)
        for group in groups:
            dist.all_reduce(sq, group=group)
        total = total + sq
    dist.all_reduce(total, group=ep_group)
    return total
