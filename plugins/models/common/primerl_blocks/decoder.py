"""The ragged decoder forward every primerl model implements: packed rows, slot caches, R3.

Why: RL needs one forward that HF models do not offer, the same for every architecture,

* ragged batches: each row has its own number of new tokens (``lengths``), right-padded;
* packed training rows: ``segment_ids`` keep several sequences in one row apart; attention
  runs one sequence per row (:class:`~primerl.models.batch.Segments`, what varlen attention
  kernels do), so its cost is that of each sequence, not of the whole row, and so does the
  whole forward when that layout has no more positions than the packed rows (token-wise
  work pads less, and the hidden states are laid out once, not twice per layer);
* a slot-indexed cache for continuous batching: in one call some rows prefill a prompt
  while others decode one token, each at its own past length, and a prefix can be copied
  from slot to slot;
* router replay ("R3"): the trainer forces the experts the inference engine used, while
  the router still receives gradients through its scores;
* the expert ids every MoE layer used *and* the ones its router would have chosen, so the
  trainer can measure routing agreement with inference while replaying.

A :class:`DecoderLM` is a :class:`primerl.models.contract.HFCausalLM`: the model contract
the trainer, the engine and the parallelism plugins call. A model plugin subclasses it: it
builds ``self.model`` (``embed_tokens``, ``layers``, ``norm``; other names via
:meth:`input_embeddings` and :meth:`final_norm`) and ``self.lm_head``, describes its cache
in :meth:`cache_layout`, and may add per-batch tensors (RoPE angles) in :meth:`prepare`.
Each layer is a :class:`DecoderLayer`, called as ``layer(x, batch, valid, carry, replay)
-> (x, carry, routing | None)``, ``batch`` being the :class:`~primerl.models.batch.Batch`
of the forward; ``carry`` passes state from one layer to the next (GLM-5's shared DSA
selection), ``routing`` is the :class:`~primerl_blocks.moe.Routing` of an MoE layer. Each
layer declares its part of the model's :class:`~primerl.models.contract.ParallelPlan`
(:meth:`DecoderLayer.layer_plan`): its sequence mixer (the mixer's ``mixer_kind``) and, for
an MoE layer, its block's router, experts and correction bias
(:meth:`~primerl_blocks.moe.MoEBlock.moe_plan`).
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from primerl.models.batch import Batch, LayerCache, Segments, SlotCache, make_batch, mix
from primerl.models.contract import LayerPlan, Mixer, ModelOutput, ParallelPlan
from primerl.models.tensors import cast_
from primerl_blocks.layers import RMSNorm, init_normal_, rope_angles, rope_rotation, without_autocast
from primerl_blocks.moe import MoEBlock, Routing

__all__ = ["DecoderLM", "DecoderLayer", "PreNormLayer", "SequenceMixer"]


class SequenceMixer(Protocol):
    """A layer's sequence mixer (GQA, MLA, Mamba-2): ``mixer_kind`` says which, for the plan."""

    mixer_kind: ClassVar[Mixer]


@runtime_checkable
class DecoderLayer(Protocol):
    """One layer of a :class:`DecoderLM`'s ``model.layers``."""

    is_moe: bool  # it routes tokens: it returns a Routing and takes replayed expert ids

    def __call__(self, x: Tensor, batch: Batch, valid: Tensor, carry: Any,
                 replay: Tensor | None) -> tuple[Tensor, Any, Routing | None]: ...

    def layer_plan(self, name: str) -> LayerPlan:
        """Its part of the model's plan; ``name``: its module name in the model."""
        ...


# ---------------------------------------------------------------------------------------
# The pre-norm decoder layer
# ---------------------------------------------------------------------------------------


class PreNormLayer(nn.Module):
    """``h = x + self_attn(norm(x)); y = h + mlp(norm(h))``: the layer of Llama-style
    models (DeepSeek-V3, Kimi K2, GLM-5, Qwen3-MoE), with HF's parameter names.

    ``self_attn(x, batch, carry) -> (out, carry)`` is a :class:`SequenceMixer`; ``mlp`` is a dense MLP (``mlp(h)``) or,
    when ``is_moe``, an :class:`~primerl_blocks.moe.MoEBlock`
    (``mlp(h [N, hidden], valid, replay) -> (out, routing)``).
    """

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, *, is_moe: bool, hidden: int, eps: float) -> None:
        super().__init__()
        if is_moe and not isinstance(mlp, MoEBlock):
            raise TypeError(f"an MoE layer's mlp must be an MoEBlock, got {type(mlp).__name__}")
        self.self_attn, self.mlp, self.is_moe = self_attn, mlp, is_moe
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)

    def layer_plan(self, name: str) -> LayerPlan:
        moe = self.mlp.moe_plan().under(f"{name}.mlp") if self.is_moe else None
        return LayerPlan(name, self.self_attn.mixer_kind, moe)

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

    Subclasses set ``Config`` (with ``from_hf``), ``self.config`` (with ``vocab_size``,
    ``num_experts_per_tok``, ``num_hidden_layers``, ``tie_word_embeddings``,
    ``initializer_range`` and ``to_hf()``), ``self.model`` (``embed_tokens``, ``layers`` of
    :class:`DecoderLayer`, ``norm``), ``self.lm_head`` and ``self.moe_layers`` (indices of
    the MoE layers), and implement :meth:`cache_layout`.
    """

    Config: ClassVar[Any]
    config: Any
    model: nn.Module
    lm_head: nn.Linear
    moe_layers: list[int]
    # RoPE: inverse frequencies [rope_dim/2] and the factor on cos/sin (YaRN); None: no RoPE
    inv_freq: Tensor | None = None
    rope_factor: float = 1.0
    # parameter/buffer name suffixes kept in float32 whatever the model dtype (routers)
    keep_fp32: tuple[str, ...] = ()
    # packed rows: attention one sequence per row when cheaper (False: masked packed rows)
    unpack_segments: bool = True

    def __init__(self) -> None:
        super().__init__()
        self.hf_config: dict[str, Any] = {}  # the HF config dict it was built from (HFModelAdapter sets it)

    # -- hooks -----------------------------------------------------------------------

    def cache_layout(self) -> list[LayerCache]:
        """Per layer, the :class:`~primerl.models.batch.SlotCache` layout (see there)."""
        raise NotImplementedError

    def prepare(self, batch: Batch, dtype: torch.dtype) -> None:
        """Add per-batch tensors every layer shares to ``batch.extra``: RoPE angles
        (``cos``, ``sin`` [B, S, rope/2], and ``rot``, the same as one complex rotation) for
        models that set ``inv_freq`` and ``rope_factor``."""
        if self.inv_freq is not None:
            cos, sin = rope_angles(batch.positions, self.inv_freq, self.rope_factor, dtype)
            batch.extra.update(cos=cos, sin=sin, rot=rope_rotation(cos, sin))

    def input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.norm

    # -- weights ---------------------------------------------------------------------

    def init_weights(self, seed: int) -> None:
        """HF's init, reproducible from ``seed`` (see :func:`primerl_blocks.layers.init_normal_`)."""
        skip = (self.lm_head,) if self.config.tie_word_embeddings else ()
        init_normal_(self, seed, self.config.initializer_range, skip=skip)

    def cast_(self, dtype: torch.dtype) -> DecoderLM:
        """Cast floating tensors to ``dtype`` in place, keeping ``keep_fp32`` in float32."""
        return cast_(self, dtype, self.keep_fp32)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.input_embeddings().weight

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        return self.input_embeddings().weight.dtype

    @property
    def device(self) -> torch.device:
        return self.input_embeddings().weight.device

    def parallel_plan(self) -> ParallelPlan:
        """The model's layout, as its layers declare it (:meth:`DecoderLayer.layer_plan`):
        every decoder layer (one FSDP unit each), its sequence mixer, and each MoE layer's
        router, experts and correction bias; then the embeddings and the head."""
        names = {m: n for n, m in self.named_modules()}
        return ParallelPlan(
            layers=tuple(layer.layer_plan(names[layer]) for layer in self.model.layers),
            embeddings=names[self.input_embeddings()], head=names[self.lm_head],
            tied_embeddings=bool(self.config.tie_word_embeddings),
        )

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
        prefix_ids: Tensor | None = None,
        cache: SlotCache | None = None,
        slots: Tensor | range | None = None,
        past_lens: Tensor | None = None,
        replay_experts: Tensor | None = None,
        logits_for: str | Tensor = "all",
    ) -> ModelOutput:
        """One forward over a right-padded batch of new tokens.

        input_ids, positions: [B, S] long (positions drive RoPE only).
        lengths: [B] long, valid new tokens per row; tokens at i >= lengths[b] are padding.
        segment_ids: [B, S] long (no cache): packed rows; a token sees only earlier tokens
            of its own segment.
        prefix_ids: [B, S] long (with segment_ids): prompt trees; a token also sees the earlier
            tokens of segment ``prefix_ids`` (a prompt shared by several samples).
        cache, slots [B], past_lens [B]: row b's tokens are written to slot ``slots[b]`` at
            positions ``past_lens[b]...`` and attend to everything cached before them.
            ``slots`` may be a ``range`` of B consecutive slots: the cache is then read in
            place instead of gathered.
        replay_experts: [B, S, n_moe_layers, top_k] expert ids to force in each MoE layer
            (ignored at padding); weights still come from the router's own scores.
        logits_for: "all" -> logits [B, S, V]; "last" -> [B, V] at each row's last valid token;
            a bool [B, S] mask -> [N, V] at its N True positions, in row order (the trainer asks
            only for the positions whose next token it trains on: the head and its softmax,
            49k columns for a real vocabulary, are not computed for prompt tokens).
        """
        B, S = input_ids.shape
        self._check(B, S, replay_experts, logits_for)
        x = self.input_embeddings()(input_ids)  # [B, S, hidden]
        batch = make_batch(positions, lengths, segment_ids, cache, slots, past_lens,
                           unpack_segments=self.unpack_segments, prefix_ids=prefix_ids)
        self.prepare(batch, x.dtype)
        seg = self._sequence_rows(batch, B * S)
        if seg is not None:
            # One sequence per row for the whole forward, not only for the sequence
            # mixers: no more positions for the token-wise layers than the packed rows
            # (often fewer), and one gather and one scatter instead of two per layer.
            x = seg.gather(x)  # [n, L, hidden]
            if replay_experts is not None:
                replay_experts = seg.gather(replay_experts)  # [n, L, n_moe_layers, top_k]
            batch = seg.batch
        x, used, own = self._run_layers(x, batch, replay_experts)
        if seg is not None:  # back to the packed rows (zeros at padding)
            x = seg.scatter(x)  # [B, S, hidden]
            used, own = [seg.scatter(t) for t in used], [seg.scatter(t) for t in own]
        logits = self._head(x, lengths, logits_for)
        if used:
            return ModelOutput(logits, torch.stack(used, 2).to(torch.int16), torch.stack(own, 2).to(torch.int16))
        none = torch.zeros(B, S, 0, self.config.num_experts_per_tok, dtype=torch.int16, device=input_ids.device)
        return ModelOutput(logits, none, none)

    def _check(self, B: int, S: int, replay_experts: Tensor | None, logits_for: str | Tensor) -> None:
        """The forward's arguments that shapes alone cannot catch, refused in one line."""
        k = self.config.num_experts_per_tok
        if isinstance(logits_for, Tensor):
            if logits_for.dtype != torch.bool or logits_for.shape != (B, S):
                raise ValueError(f"logits_for as a mask must be bool [B, S] = [{B}, {S}]")
        elif logits_for not in ("all", "last"):
            raise ValueError(f"logits_for must be 'all', 'last' or a bool [B, S] mask, got {logits_for!r}")
        if replay_experts is not None and replay_experts.shape != (B, S, len(self.moe_layers), k):
            raise ValueError(f"replay_experts must be [B, S, {len(self.moe_layers)}, {k}]")

    @staticmethod
    def _sequence_rows(batch: Batch, packed_positions: int) -> Segments | None:
        """The one-sequence-per-row layout to run the whole forward in, when the batch has
        one with no more positions than the packed rows and its mixers read no keys of
        other rows (not under context parallelism, nor with prompt trees laid out one
        segment per row)."""
        seg = batch.segments
        if seg is None:
            return None
        seg.adopt(batch.extra)
        n, L = seg.index.shape
        return seg if n * L <= packed_positions and seg.batch.gather_keys is None else None

    def _run_layers(self, x: Tensor, batch: Batch, replay_experts: Tensor | None
                    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """Every layer in turn. x: [B, S, hidden] (or [n, L, hidden] one sequence per row).
        Returns x and, per MoE layer, the experts used and the router's own ([B, S, top_k] each)."""
        valid = batch.valid.flatten()  # [B*S], or [n*L] one sequence per row
        carry, used, own = None, [], []
        rows = x.shape[:2]  # (B, S), or (n, L) one sequence per row
        for layer in self.model.layers:
            replay = None
            if replay_experts is not None and layer.is_moe:
                replay = replay_experts[:, :, len(used)].flatten(0, 1)  # [B*S, top_k]
            x, carry, routing = layer(x, batch, valid, carry, replay)
            if routing is not None:
                used.append(routing.ids.view(*rows, -1))
                own.append(routing.own_ids.view(*rows, -1))
        return x, used, own

    def _head(self, x: Tensor, lengths: Tensor, logits_for: str | Tensor) -> Tensor:
        """The final norm and the head at the positions ``logits_for`` asks for. x: [B, S, hidden]."""
        if isinstance(logits_for, Tensor):
            x = x[logits_for]  # [N, hidden]
        elif logits_for == "last":
            x = x[torch.arange(x.shape[0], device=x.device), (lengths - 1).clamp(min=0)]  # [B, hidden]
        # a bf16 trainer: the head computes in the dtype of the residual stream and weights
        # (float32, unless FSDP2 casts the parameters to bf16)
        with without_autocast(x.device.type):
            return self.lm_head(self.final_norm()(x))
