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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor

from primerl.samples import Sample

# What an empty row (PackedBatch.select's None) holds in each field: one valid token that
# is not a target of the loss, in its own segment.
EMPTY_ROW_FILL = {"input_ids": 0, "positions": 0, "segment_ids": 0, "lengths": 1, "targets": 0, "loss_mask": False,
                  "inference_logprobs": 0.0, "advantages": 0.0, "temperatures": 1.0, "sample_index": -1,
                  "replay_experts": 0}


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
            t = getattr(self, f.name)
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
            t = getattr(self, f.name)
            if f.name == "lengths":
                out[f.name] = t[r : r + 1]  # [1]
            elif t is None:
                out[f.name] = None
            else:
                out[f.name] = t[r : r + 1, :n]
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


def pack(samples: Sequence[Sample], seq_len: int) -> PackedBatch:
    """Pack samples (:class:`primerl.samples.Sample`) into rows.

    Read: ``tokens``, ``loss_mask``, ``logprobs`` (None: 0), ``advantage``,
    ``temperature`` and ``routed_experts`` (used only if every sample has them). Samples
    of fewer than 2 tokens have nothing to predict and are skipped.
    """
    toks, masks, lps, sizes, keep = [], [], [], [], []
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
        toks.append(t)
        masks.append(m)
        lps.append(lp)
        sizes.append(len(t) - 1)
        keep.append(idx)

    bins = first_fit_decreasing(sizes, seq_len)
    R = max(len(bins), 1)
    W = max((sum(sizes[i] for i in b) for b in bins), default=1)
    input_ids = torch.zeros(R, W, dtype=torch.long)
    positions = torch.zeros(R, W, dtype=torch.long)
    segment_ids = torch.full((R, W), -1, dtype=torch.long)
    lengths = torch.zeros(R, dtype=torch.long)
    targets = torch.zeros(R, W, dtype=torch.long)
    loss_mask = torch.zeros(R, W, dtype=torch.bool)
    inference_logprobs = torch.zeros(R, W, dtype=torch.float32)
    advantages = torch.zeros(R, W, dtype=torch.float32)
    temperatures = torch.ones(R, W, dtype=torch.float32)
    sample_index = torch.full((R, W), -1, dtype=torch.long)

    routed = [samples[i].routed_experts for i in keep]
    replay = None
    if routed and all(r is not None for r in routed):
        shape = tuple(torch.as_tensor(routed[0]).shape[1:])  # (n_moe_layers, top_k)
        replay = torch.zeros(R, W, *shape, dtype=torch.int16)

    # One slice assignment per sample (no per-token Python work).
    for r, b in enumerate(bins):
        off = 0
        for seg, j in enumerate(b):
            n, t, src = sizes[j], torch.tensor(toks[j], dtype=torch.long), samples[keep[j]]
            sl = slice(off, off + n)
            input_ids[r, sl] = t[:-1]
            targets[r, sl] = t[1:]
            positions[r, sl] = torch.arange(n)
            segment_ids[r, sl] = seg
            loss_mask[r, sl] = torch.tensor(masks[j][1:], dtype=torch.bool)
            inference_logprobs[r, sl] = torch.tensor(lps[j][1:], dtype=torch.float32)
            advantages[r, sl] = float(src.advantage)
            temperatures[r, sl] = float(src.temperature)
            sample_index[r, sl] = keep[j]
            if replay is not None:
                re = torch.as_tensor(routed[j])
                if re.shape[0] not in (n, n + 1) or tuple(re.shape[1:]) != tuple(replay.shape[2:]):
                    raise ValueError(
                        f"sample {keep[j]}: routed_experts has shape {tuple(re.shape)}, expected "
                        f"[{n + 1} or {n}, {', '.join(map(str, replay.shape[2:]))}]"
                    )
                replay[r, sl] = re[:n].to(torch.int16)
            off += n
        lengths[r] = off

    return PackedBatch(
        input_ids=input_ids,
        positions=positions,
        segment_ids=segment_ids,
        lengths=lengths,
        targets=targets,
        loss_mask=loss_mask,
        inference_logprobs=inference_logprobs,
        advantages=advantages,
        temperatures=temperatures,
        sample_index=sample_index,
        replay_experts=replay,
    )
