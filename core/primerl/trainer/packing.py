"""Packing rollouts into fixed-capacity training rows.

What: samples of different lengths are laid end to end in rows of at most
``trainer.seq_len`` tokens (first-fit decreasing), each with its own positions
(restarting at 0) and its own segment id, so that the model's packed forward keeps them
apart: a token attends only to earlier tokens of its own sample. The only padding is the
tail of each row, and the trainer slices every row to its length before the forward, so
no compute is spent on padding at all.

Why: a batch of RL samples has a long tail of lengths. Padding every sample to the
longest wastes most of the compute; packing wastes none, and packed logprobs are the
same as those of separate forwards (the tests check this to 1e-5).

Next-token layout. A sample of ``L`` tokens occupies ``L - 1`` positions: inputs are
``tokens[:-1]`` and targets ``tokens[1:]``; the target at position ``i`` carries the
loss mask, the inference logprob and the version of ``tokens[i + 1]``. ``tokens[0]``
is never a target (it has no context); it is always a prompt token. Every token with
``loss_mask == 1`` (other than ``tokens[0]``) therefore appears exactly once as a target.

Router replay: ``routed_experts[i]`` are the experts the engine used when it processed
``tokens[i]`` as an input, so position ``i`` replays row ``i``. The engine never feeds
the last sampled token, so both ``L`` and ``L - 1`` rows are accepted.

Shared prompts (``share_prompts``): the samples of a GRPO group start with the same
prompt, and a trainer that runs it once per sample spends most of a step on it when
completions are short (reverse-text: 20 prompt tokens, 5-24 completion tokens). Samples
whose tokens agree up to their first loss token (and, with router replay, whose experts
agree there) are laid out as one *prompt tree*: the prompt's first ``p - 1`` positions
once, as a segment of their own, then each sample's remaining positions (from its last
prompt token on, positions ``p - 1 ..``) as a segment that also sees the prompt's
(``prefix_ids``). Every target keeps exactly one position, so logprobs, the loss and its
gradients equal the unshared layout's (tests compare them); the prompt's positions get the
sum of the gradients its samples send back, as they would through separate copies. A
group too long for one row is split into several trees, each with its own copy of the
prompt. Models with recurrent layers (Mamba) cannot branch a state and do not share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from primerl.samples import Sample

__all__ = ["PackedBatch", "pack"]

# What an empty row (PackedBatch.select's None) holds in each field: one valid token that
# is not a target of the loss, in its own segment.
EMPTY_ROW_FILL = {"input_ids": 0, "positions": 0, "segment_ids": 0, "lengths": 1, "targets": 0, "loss_mask": False,
                  "inference_logprobs": 0.0, "advantages": 0.0, "temperatures": 1.0, "sample_index": -1,
                  "replay_experts": 0, "prefix_ids": 0}


@dataclass
class PackedBatch:
    """A step's samples packed into ``R`` rows of width ``W <= seq_len`` (W = longest row)."""

    input_ids: Tensor  # [R, W] long, tokens[:-1] of each sample, 0 on the row tail
    positions: Tensor  # [R, W] long, 0..n-1 within each sample
    segment_ids: Tensor  # [R, W] long, 0, 1, ... per sample within its row; -1 on the tail
    lengths: Tensor  # [R] long, valid positions per row
    targets: Tensor  # [R, W] long, tokens[1:] of each sample
    loss_mask: Tensor  # [R, W] bool, loss_mask[1:] of each sample
    inference_logprobs: Tensor  # [R, W] float32, logprobs[1:]
    advantages: Tensor  # [R, W] float32, the sample's advantage on every position
    temperatures: Tensor  # [R, W] float32, the sample's temperature on every position (1 on the tail)
    sample_index: Tensor  # [R, W] long, index of the sample in the input list; -1 on the tail
    replay_experts: Tensor | None = None  # [R, W, n_moe_layers, top_k] int16, if every sample has them
    # [R, W] long: the segment whose tokens (a shared prompt) a position also sees, its own
    # segment where there is none, -1 on the tail; None when no prompt is shared
    prefix_ids: Tensor | None = None

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def num_loss_tokens(self) -> int:
        return int(self.loss_mask.sum())

    def rows(self, start: int, end: int) -> dict[str, Tensor | None]:
        """Rows ``start:end`` cut to the longest of them: [k, m, ...] (one forward for several rows)."""
        return self.select(list(range(start, end)))

    def select(self, picks: Sequence[int | None]) -> dict[str, Tensor | None]:
        """Rows ``picks`` cut to the longest of them: [k, m, ...]. A ``None`` is an empty row
        (one padding token, nothing to learn): a rank with fewer rows than the others runs it
        so that every rank takes part in the forward's collectives."""
        index = torch.tensor([r if r is not None else 0 for r in picks], dtype=torch.long)  # [k]
        empty = torch.tensor([r is None for r in picks])  # [k]
        m = max(1, int(self.lengths[index].max()))
        out: dict[str, Tensor | None] = {}
        for f in fields(self):
            t = vars(self)[f.name]
            if t is None:
                out[f.name] = None
                continue
            t = t[index] if f.name == "lengths" else t[index, :m]
            if bool(empty.any()):
                t = t.clone()
                t[empty] = EMPTY_ROW_FILL[f.name]
            out[f.name] = t
        return out

    def row(self, r: int) -> dict[str, Tensor | None]:
        """Row ``r`` sliced to its length, each tensor with a leading batch dim of 1: [1, n, ...]."""
        n = int(self.lengths[r])
        out: dict[str, Tensor | None] = {}
        for f in fields(self):
            t = vars(self)[f.name]
            if f.name == "lengths":
                out[f.name] = t[r : r + 1]  # [1]
            elif t is None:
                out[f.name] = None
            else:
                out[f.name] = t[r : r + 1, :n]
        return out


def join_rows(rows: dict[str, Tensor | None]) -> dict[str, Tensor | None]:
    """Packed rows ``[k, m, ...]`` (:meth:`PackedBatch.select`) as one row ``[1, N, ...]`` of
    their ``N = sum(lengths)`` valid positions, row after row, each row's segments renumbered
    after the previous row's: no padding left for the linear layers to compute. Only for a
    model whose attention follows the segments, not the rows (``varlen_rows``): with a
    masked row, attention would cost N^2 instead of the sum of the rows' m^2."""
    lengths = rows["lengths"]
    ids = rows["input_ids"]
    if lengths is None or ids is None or ids.shape[0] == 1:
        return rows
    k, m = ids.shape
    valid = torch.arange(m, device=ids.device)[None, :] < lengths[:, None]  # [k, m]
    segments = rows["segment_ids"]
    assert segments is not None, "packed rows carry segment ids"
    count = segments.max(1).values + 1  # [k] segments per row (ids 0.., -1 on the tail)
    first = count.cumsum(0) - count  # [k] the first new id of each row's segments
    out: dict[str, Tensor | None] = {}
    for name, t in rows.items():
        if t is None:
            out[name] = None
        elif name == "lengths":
            out[name] = lengths.sum().reshape(1)  # [1]
        elif name in ("segment_ids", "prefix_ids"):
            out[name] = (t + first[:, None])[valid][None]  # [1, N]
        else:
            out[name] = t[valid][None]  # [1, N, ...]
    return out


def _as_list(value: Any) -> list:
    return value.tolist() if isinstance(value, Tensor) else list(value)


def first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of item indices: longest first, each into the first bin with room. O(items * bins)."""
    order = sorted(range(len(sizes)), key=lambda i: -sizes[i])  # stable: equal sizes keep input order
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        for b, free in enumerate(room):
            if sizes[i] <= free:
                bins[b].append(i)
                room[b] -= sizes[i]
                break
        else:
            bins.append([i])
            room.append(capacity - sizes[i])
    return bins


@dataclass
class _Tree:
    """A packing unit: one sample (``prompt`` 0), or the first ``prompt`` positions of
    ``samples[0]`` followed by each sample's positions from ``prompt`` on."""

    samples: list[int]  # indices into the kept samples
    prompt: int  # shared positions (p - 1), 0 for a lone sample
    size: int  # positions the unit takes in a row


def _prompt_trees(toks: list[list[int]], masks: list[list[int]], sizes: list[int], routed: list[Any] | None,
                  seq_len: int) -> list[_Tree]:
    """Samples grouped by their prompt (tokens up to the first loss token, and the experts
    inference routed them to when replaying), each group cut into trees that fit a row
    (first-fit decreasing over its samples' own positions); everything else alone."""
    groups: dict[tuple, list[int]] = {}
    units: list[_Tree] = []
    for j, (t, m) in enumerate(zip(toks, masks, strict=True)):
        p = next((i for i, v in enumerate(m) if v), 0)  # first loss token
        if p < 2:  # no loss token, or a one-token prompt: nothing worth sharing
            units.append(_Tree([j], 0, sizes[j]))
            continue
        key = (tuple(t[:p]), None if routed is None else torch.as_tensor(routed[j])[: p - 1].numpy().tobytes())
        groups.setdefault(key, []).append(j)
    for key, members in groups.items():
        shared = len(key[0]) - 1  # the prompt's positions: inputs tokens[:p - 1]
        if len(members) == 1:
            units.append(_Tree(members, 0, sizes[members[0]]))
            continue
        own = [sizes[j] - shared for j in members]  # >= 1: a loss token follows the prompt
        for part in first_fit_decreasing(own, seq_len - shared):
            picked = [members[i] for i in part]
            if len(picked) == 1:
                units.append(_Tree(picked, 0, sizes[picked[0]]))
            else:
                units.append(_Tree(picked, shared, shared + sum(own[i] for i in part)))
    return units


@dataclass
class _Kept:
    """The samples that pack (2 tokens or more), as lists, each checked against ``seq_len``."""

    index: list[int]  # each kept sample's index in the input
    tokens: list[list[int]]
    masks: list[list[int]]
    logprobs: list[list[float]]
    sizes: list[int]  # positions: len(tokens) - 1
    routed: list[Any] | None  # each one's routed experts, when every kept sample has them


def _keep(samples: Sequence[Sample], seq_len: int) -> _Kept:
    kept = _Kept([], [], [], [], [], None)
    for idx, s in enumerate(samples):
        t = _as_list(s.tokens)
        m = _as_list(s.loss_mask)
        lp = _as_list(s.logprobs) if s.logprobs is not None else [0.0] * len(t)
        if not len(t) == len(m) == len(lp):
            raise ValueError(
                f"sample {idx}: tokens ({len(t)}), loss_mask ({len(m)}) and logprobs ({len(lp)}) "
                f"must have the same length"
            )
        if len(t) < 2:
            continue
        if len(t) - 1 > seq_len:
            raise ValueError(
                f"sample {idx} has {len(t)} tokens ({len(t) - 1} positions) but trainer.seq_len is "
                f"{seq_len}: raise --trainer.seq_len to at least {len(t) - 1}, or shorten rollouts "
                f"(--orchestrator.max_tokens, shorter prompts)"
            )
        kept.index.append(idx)
        kept.tokens.append(t)
        kept.masks.append(m)
        kept.logprobs.append(lp)
        kept.sizes.append(len(t) - 1)
    routed = [samples[i].routed_experts for i in kept.index]
    kept.routed = routed if routed and all(r is not None for r in routed) else None
    return kept


class _Rows:
    """The packed tensors of ``R`` rows of width ``W``, filled one sample's positions at a time."""

    def __init__(self, R: int, W: int, kept: _Kept, samples: Sequence[Sample]) -> None:
        self.kept, self.samples = kept, samples
        self.input_ids = torch.zeros(R, W, dtype=torch.long)
        self.positions = torch.zeros(R, W, dtype=torch.long)
        self.segment_ids = torch.full((R, W), -1, dtype=torch.long)
        self.prefix_ids = torch.full((R, W), -1, dtype=torch.long)
        self.lengths = torch.zeros(R, dtype=torch.long)
        self.targets = torch.zeros(R, W, dtype=torch.long)
        self.loss_mask = torch.zeros(R, W, dtype=torch.bool)
        self.inference_logprobs = torch.zeros(R, W, dtype=torch.float32)
        self.advantages = torch.zeros(R, W, dtype=torch.float32)
        self.temperatures = torch.ones(R, W, dtype=torch.float32)
        self.sample_index = torch.full((R, W), -1, dtype=torch.long)
        self.replay = None
        if kept.routed is not None:
            shape = tuple(torch.as_tensor(kept.routed[0]).shape[1:])  # (n_moe_layers, top_k)
            self.replay = torch.zeros(R, W, *shape, dtype=torch.int16)

    def place(self, r: int, off: int, j: int, start: int, end: int, seg: int, prefix: int) -> int:
        """Positions ``start:end`` of kept sample ``j`` at row ``r`` from ``off``, in segment
        ``seg`` that also sees segment ``prefix``: one slice assignment per field. Returns
        the row's next free position."""
        k = self.kept
        n, t, src = end - start, torch.tensor(k.tokens[j][start : end + 1], dtype=torch.long), self.samples[k.index[j]]
        sl = slice(off, off + n)
        self.input_ids[r, sl] = t[:-1]
        self.targets[r, sl] = t[1:]
        self.positions[r, sl] = torch.arange(start, end)
        self.segment_ids[r, sl] = seg
        self.prefix_ids[r, sl] = prefix
        self.loss_mask[r, sl] = torch.tensor(k.masks[j][start + 1 : end + 1], dtype=torch.bool)
        self.inference_logprobs[r, sl] = torch.tensor(k.logprobs[j][start + 1 : end + 1], dtype=torch.float32)
        self.advantages[r, sl] = float(src.advantage)
        self.temperatures[r, sl] = float(src.temperature)
        self.sample_index[r, sl] = k.index[j]
        if self.replay is not None:
            re = torch.as_tensor(k.routed[j])
            size = k.sizes[j]
            if re.shape[0] not in (size, size + 1) or tuple(re.shape[1:]) != tuple(self.replay.shape[2:]):
                raise ValueError(
                    f"sample {k.index[j]}: routed_experts has shape {tuple(re.shape)}, expected "
                    f"[{size + 1} or {size}, {', '.join(map(str, self.replay.shape[2:]))}]"
                )
            self.replay[r, sl] = re[start:end].to(torch.int16)
        return off + n

    def fill_row(self, r: int, units: Sequence[_Tree]) -> None:
        """Row ``r``: its units end to end, each sample (or tree branch) a segment of its own."""
        off, seg = 0, 0
        for u in units:
            if u.prompt:  # the prompt once (as its first sample's), then each sample's own positions
                root = seg
                off = self.place(r, off, u.samples[0], 0, u.prompt, root, root)
                for j in u.samples:
                    seg += 1
                    off = self.place(r, off, j, u.prompt, self.kept.sizes[j], seg, root)
            else:
                off = self.place(r, off, u.samples[0], 0, self.kept.sizes[u.samples[0]], seg, seg)
            seg += 1
        self.lengths[r] = off

    def batch(self, shared: bool) -> PackedBatch:
        """The packed batch; ``shared``: some prompt is shared (``prefix_ids`` kept)."""
        return PackedBatch(
            input_ids=self.input_ids,
            positions=self.positions,
            segment_ids=self.segment_ids,
            lengths=self.lengths,
            targets=self.targets,
            loss_mask=self.loss_mask,
            inference_logprobs=self.inference_logprobs,
            advantages=self.advantages,
            temperatures=self.temperatures,
            sample_index=self.sample_index,
            replay_experts=self.replay,
            prefix_ids=self.prefix_ids if shared else None,
        )


def pack(samples: Sequence[Sample], seq_len: int, *, share_prompts: bool = False) -> PackedBatch:
    """Pack samples (:class:`primerl.samples.Sample`) into rows.

    Read: ``tokens``, ``loss_mask``, ``logprobs`` (None: 0), ``advantage``,
    ``temperature`` and ``routed_experts`` (used only if every sample has them). Samples
    of fewer than 2 tokens have nothing to predict and are skipped. ``share_prompts``:
    samples with the same prompt share its positions (prompt trees, see the module's
    docstring).
    """
    kept = _keep(samples, seq_len)
    units = (_prompt_trees(kept.tokens, kept.masks, kept.sizes, kept.routed, seq_len) if share_prompts
             else [_Tree([j], 0, n) for j, n in enumerate(kept.sizes)])
    bins = first_fit_decreasing([u.size for u in units], seq_len)
    rows = _Rows(max(len(bins), 1), max((sum(units[i].size for i in b) for b in bins), default=1), kept, samples)
    for r, b in enumerate(bins):
        rows.fill_row(r, [units[i] for i in b])
    return rows.batch(shared=any(u.prompt for u in units))
