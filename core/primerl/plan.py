"""``primerl plan``: per-GPU memory of training a model preset on a cluster, and a layout that fits.

What: a model plugin describes its preset's layers (``ModelAdapter.shape(hf_config)``, built
with this module's building blocks: :func:`decoder_shape` for a plain decoder, the mixers,
MLPs and MoE blocks layer by layer for anything else), so every parameter is counted
analytically — no model is built, a full preset would need terabytes — and this module
estimates, per GPU, the bytes of
parameters, gradients, AdamW state, activations and FSDP2 all-gather buffers for a layout
``dp_replicate x dp_shard x cp`` (= nodes x GPUs per node) with expert parallel ``ep``
carved out of ``dp_shard x cp`` as torchtitan does. It then searches every valid layout of
the same GPUs for the one that fits with the least estimated communication.

Why: at GLM-5 / Kimi K2 scale the first question of a run is whether it fits at all; the
answer depends on the layout in ways that are easy to get wrong by hand (experts are
sharded by ``ep`` *then* by FSDP; one MoE layer of GLM-5 is ~40 GB in fp32, so without
expert parallel the all-gather alone does not fit; at 128k tokens GLM-5's per-layer
checkpoints alone take 126 GB of a GPU unless the row is split over ``cp``).

The parameter count is exact: for the tiny presets it equals ``sum(p.numel())`` of the
built model (``tests/test_plan.py``). It covers MLA (with and without the query LoRA), the
DSA indexer (GLM-5's "full" layers; "shared" layers have none), GQA with and without
per-head q/k norms, Mamba-2, dense MLPs (gated SwiGLU and non-gated relu2), routed and
shared experts, Nemotron's latent MoE projections, and tied embeddings. Multi-token
prediction layers (``num_nextn_predict_layers``, GLM-5 has one) are counted and reported
but *not* planned for: primerl's models do not load or train them (the checkpoint loader
skips them). The routers' ``e_score_correction_bias`` is a buffer, not a parameter: it is
replicated on every GPU in fp32 and counted apart.

Formulas (``N_dense`` = parameters outside the routed experts, ``N_exp`` = routed-expert
parameters; ``shard = dp_shard * cp``, the FSDP2 dimension torchtitan names ``dp_shard_cp``):

* parameters: fp32 master weights, ``4 * (N_dense / shard + N_exp / ep / (shard / ep))``
  bytes; routed experts are split whole over ``ep`` and each rank's experts are sharded
  again over the remaining ``shard / ep`` ranks, so both terms come to ``N / shard``;
  ``dp_replicate`` (HSDP) replicates. Shards are taken as even (FSDP2's dim-0 padding
  is ignored).
* gradients: fp32, the same sharding: ``4 * N / shard``.
* optimizer: AdamW's two fp32 moments: ``8 * N / shard``.
* all-gather buffers: FSDP2 with a bf16 mixed-precision policy gathers one unit (a
  decoder layer, the embeddings, the head) at a time in bf16 and prefetches the next;
  in backward the unit's unsharded gradients exist in fp32 (the reduce dtype) until
  reduce-scattered. Peak: ``(2 + 2) * U + 4 * U`` bytes for the largest unit of ``U``
  gathered parameters, where a rank gathers only its own ``E / ep`` experts. (With
  ``--fp8``, ``+ 2 * U_q`` for the fp8 copies of the quantisable weights and their
  transposes; gathers stay bf16.) ``layer_allgather_gb_fp32`` is the largest decoder
  layer, all experts included, in fp32: what one layer weighs unsharded.
* activations, per micro-batch of ``R`` rows of ``L`` tokens, each row split over ``cp``
  (``T = R * L / cp`` tokens per GPU, ``L`` padded to a multiple of ``2 * cp``), with
  activation checkpointing per decoder layer:
  the checkpoints ``n_layers * T * hidden * 2`` bytes (plus the DSA selection a "shared"
  layer reuses), plus the larger of (a) the recomputed layer whose saved tensors are
  largest, listed tensor by tensor in this module with an O(T) attention kernel
  (flash/sparse: q, k, v, output and log-sum-exp; never the T x T scores nor a mask),
  the all-to-all buffers of expert parallel and, for its gradient, its largest tensor
  once more; and (b) the head: the trainer computes full-vocabulary logits,
  temperature-scaled logits, their log-softmax and its gradient, ``4 * T * vocab * 2``
  bytes (no chunked loss).
  Routing is assumed balanced (each GPU's experts receive ``T * top_k`` tokens); an
  imbalanced router raises the MoE terms. Context parallel is primerl's
  (``primerl_fsdp.context_parallel``): each rank keeps a zigzag share of the row (padded
  to a multiple of ``2 * cp``) and all-gathers the *keys* of the whole row, so the keys
  are row-sized: GQA's k and v, MLA's latent and rope key and the per-head k and v that
  ``kv_b_proj`` expands from it, GLM-5's indexer keys. Mamba-2 layers cannot be split
  (state passing between ranks is not implemented), so Nemotron plans with ``cp = 1``.
  With ``--fp8`` the inputs that the FP8 linears save are e4m3 with a fp32 scale per
  1x128 tile (DeepSeek-V3's recipe, ``primerl.models.fp8_matmul``).
* fits: ``total <= (1 - margin) * GPU memory`` (default 10% of 141 GB left for the CUDA
  caching allocator's fragmentation, NCCL buffers and the CUDA context).

Communication, used only to rank layouts, is estimated per GPU and micro-batch as bytes
over bandwidth: FSDP2 all-gathers (forward and again in backward) and reduce-scatters,
the HSDP all-reduce over ``dp_replicate``, expert-parallel all-to-alls (dispatch and
combine in the forward, the recompute and the backward), and context parallel's key
all-gathers (forward and recompute) and their gradients' reduce-scatter. A group whose
ranks share a node moves at NVLink speed (450 GB/s per GPU), one that spans nodes at the
network's (50 GB/s per GPU, a 400 Gb/s NIC each); ranks are laid out as torchtitan's
mesh, ``dp_replicate`` outermost, ``cp`` innermost and ``ep`` the innermost ranks of
``dp_shard x cp``. Layouts are ranked by that time divided by the rows the cluster
trains per micro-batch (``R * dp_replicate * dp_shard``): communication per row trained,
so that a layout splitting rows over many GPUs pays for training fewer rows at once.
These are coarse figures for ranking, not predictions of step time.

Light at import (no torch): ``primerl plan`` must answer for a 744B model on a laptop.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from primerl.errors import PrimerlError

__all__ = ["Layer", "ModelShape", "assemble_shape", "decoder_shape", "dense_mlp", "experts_of", "gqa_mixer",
           "mamba2_mixer", "merge_block", "mla_mixer", "moe_block", "norm_residual", "plan"]

GB = 1e9
H200_MEMORY_GB = 141.0
DEFAULT_MARGIN = 0.10
NVLINK_GB_PER_S = 450.0
NETWORK_GB_PER_S = 50.0
FP8_BYTES = 1 + 4 / 128  # e4m3 plus one fp32 scale per 1x128 tile

ASSUMPTIONS = (
    "fp32 master weights, fp32 gradients and AdamW's two fp32 moments, sharded by FSDP2 over dp_shard x cp "
    "and replicated over dp_replicate; routed experts split over ep, then sharded over dp_shard x cp / ep",
    "FSDP2 gathers one unit (decoder layer, embeddings, head) at a time in bf16 and prefetches the next; "
    "the unit's unsharded gradients are fp32 until reduce-scattered",
    "activation checkpointing per decoder layer: each layer's bf16 input is kept, one layer is recomputed "
    "at a time in backward",
    "attention runs an O(tokens) kernel (flash/sparse attention: q, k, v, output, log-sum-exp; no score matrix "
    "or mask); cp ranks hold a zigzag share of each row and all-gather the whole row's keys (MLA: the latent, "
    "expanded per head); Mamba-2 runs a chunked scan keeping one state per chunk and cannot be split over cp",
    "routing balanced across experts; the head computes full-vocabulary logits (no chunked loss)",
    "multi-token-prediction layers are not trained (primerl's loader skips them) and not counted in memory",
    "communication ranks layouts only: 450 GB/s per GPU within a node, 50 GB/s across nodes",
)


FP8_ASSUMPTION = ("--fp8: the FP8 linears save their inputs in e4m3 with a fp32 scale per 1x128 tile and keep fp8 "
                  "copies of the gathered unit's weights; parameters, gradients, optimizer state and gathers unchanged")


# ---------------------------------------------------------------------------------------
# The model: parameters and per-token activations, from the HF config
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Saved:
    """A tensor of one layer alive for its backward: ``per_token`` elements for every
    token of the GPU's slice (``over="local"``) or of the whole row (``over="row"``:
    keys all-gathered over cp). ``dtype``: bf16 | fp32 | int32 | linear (a quantisable
    linear's bf16 input, e4m3 under --fp8)."""

    name: str
    per_token: float
    dtype: str = "bf16"
    over: str = "local"
    cp_only: bool = False  # a copy that exists only when the row is split (gathered keys)


@dataclass
class Layer:
    """One decoder layer: its parameters (``dense``: everything but the routed experts;
    ``experts``: the routed experts; ``quantisable``: 2D/3D weights an FP8 recipe
    quantises), buffers, what its recompute saves, and what it communicates per token."""

    index: int
    mixer: str  # mla | mla_dsa | gqa | mamba2 | none
    mlp: str  # dense | moe | none
    dense: int = 0
    experts: int = 0
    quantisable: int = 0
    buffers: int = 0
    saved: list[Saved] = field(default_factory=list)
    gathered_keys_per_token: int = 0  # bf16 elements per token all-gathered over cp (with gradients)
    index_key_dim: int = 0  # DSA indexer key width, all-gathered over cp (no gradient)
    a2a_width: int = 0  # hidden width of the tokens an MoE layer dispatches to its experts
    carry: Saved | None = None  # state handed to the next layer (kept with the checkpoint)

    @property
    def params(self) -> int:
        return self.dense + self.experts


@dataclass
class ModelShape:
    """A model preset as the planner sees it: every parameter, per layer and per unit."""

    name: str
    preset: str
    model_type: str
    hidden: int
    vocab: int
    tied: bool
    layers: list[Layer]
    embed: int
    head: int  # 0 when tied to the embeddings
    final_norm: int
    num_experts: int
    top_k: int
    expert_params: int  # one routed expert of one MoE layer
    mtp_layers: int = 0
    mtp_params: int = 0  # not trained: reported, never planned for

    @property
    def params(self) -> int:
        return self.embed + self.head + self.final_norm + sum(layer.params for layer in self.layers)

    @property
    def has_mamba(self) -> bool:
        return any(layer.mixer == "mamba2" for layer in self.layers)

    @property
    def expert_params_total(self) -> int:
        return sum(layer.experts for layer in self.layers)

    @property
    def buffers(self) -> int:
        return sum(layer.buffers for layer in self.layers)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through: everything but the routed experts it skips."""
        moe = sum(1 for layer in self.layers if layer.mlp == "moe")
        return self.params - moe * (self.num_experts - self.top_k) * self.expert_params


def _linear(n_in: int, n_out: int, bias: bool = False) -> int:
    return n_in * n_out + (n_out if bias else 0)


def dense_mlp(hidden: int, inter: int, *, gated: bool, bias: bool = False) -> tuple[int, list[Saved]]:
    """A dense MLP's parameters and saved tensors (SwiGLU when ``gated``, else relu2)."""
    params = (3 if gated else 2) * hidden * inter + ((2 if gated else 1) * inter + hidden if bias else 0)
    saved = ([Saved("mlp gate and up", 2 * inter)] if gated else [Saved("mlp up", inter)]) + [
        Saved("mlp activation (down input)", inter, "linear"),
        Saved("mlp output", hidden),
    ]
    return params, saved


def moe_block(hf: Mapping[str, Any], hidden: int, *, n_experts: int, top_k: int, inter: int, gated: bool,
         shared_inter: int, shared_bias: bool, router_bias: bool, latent: int | None) -> tuple[Layer, int]:
    """An MoE block (routed experts, router, shared expert, latent projections) as a partial
    Layer, and the parameters of one routed expert."""
    width = latent or hidden
    per_expert = (3 if gated else 2) * width * inter
    layer = Layer(-1, "none", "moe", experts=n_experts * per_expert, a2a_width=width)
    layer.dense += n_experts * hidden  # the router (fp32 in the model)
    layer.buffers += n_experts if router_bias else 0  # e_score_correction_bias
    layer.quantisable += n_experts * per_expert
    layer.saved += [
        Saved("router logits and scores", 2 * n_experts, "fp32"),
        Saved("dispatched tokens (expert input)", top_k * width, "linear"),
        Saved("expert gate and up" if gated else "expert up", top_k * (2 if gated else 1) * inter),
        Saved("expert activation (down input)", top_k * inter, "linear"),
        Saved("expert outputs", top_k * width),
        Saved("combined expert output", hidden),
    ]
    if latent:
        bias = hf.get("mlp_bias", False)
        layer.dense += _linear(hidden, latent, bias) + _linear(latent, hidden, bias)
        layer.quantisable += 2 * hidden * latent
        layer.saved += [Saved("latent projection output", latent), Saved("latent output (fc2 input)", latent, "linear")]
    if shared_inter:
        params, saved = dense_mlp(hidden, shared_inter, gated=gated, bias=shared_bias)
        layer.dense += params
        layer.quantisable += (3 if gated else 2) * hidden * shared_inter
        layer.saved += [Saved("shared " + s.name, s.per_token, s.dtype) for s in saved]
    return layer, per_expert


def norm_residual(hidden: int, norms: int) -> list[Saved]:
    """What the pre-norm residual structure of a layer saves besides its mixer and MLP."""
    saved = [Saved("normalised input (projection input)", hidden, "linear"), Saved("norm statistics", norms, "fp32")]
    if norms == 2:
        saved += [Saved("residual after attention", hidden), Saved("normalised residual (MLP input)", hidden, "linear")]
    return saved


def mla_mixer(hf: Mapping[str, Any], layer: Layer, *, dsa: bool, seq_len: int) -> None:
    """Multi-head latent attention (DeepSeek-V3, Kimi K2, GLM-5), with GLM-5's DSA indexer
    on its "full" layers (``dsa``)."""
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    q_lora, kv_lora = hf.get("q_lora_rank"), hf["kv_lora_rank"]
    nope, rope, v = hf["qk_nope_head_dim"], hf["qk_rope_head_dim"], hf["v_head_dim"]
    qk, bias = nope + rope, bool(hf.get("attention_bias", False))
    proj = [(h, kv_lora + rope, bias), (kv_lora, heads * (nope + v), False), (heads * v, h, bias)]
    proj += [(h, q_lora, bias), (q_lora, heads * qk, False)] if q_lora else [(h, heads * qk, False)]
    layer.dense += sum(_linear(*p) for p in proj) + kv_lora + (q_lora or 0)  # + the two latent norms
    layer.quantisable += sum(a * b for a, b, _ in proj)
    layer.saved += [Saved("q latent", q_lora), Saved("normalised q latent", q_lora, "linear")] if q_lora else []
    layer.saved += [
        Saved("q projection", heads * qk), Saved("q with rope", heads * qk),
        Saved("kv latent and rope key", kv_lora + rope), Saved("normalised kv latent", kv_lora),
        Saved("the row's latent and rope key (kv_b input)", kv_lora + rope, "linear", over="row"),
        Saved("the row's k_nope and v", heads * (nope + v), over="row"),
        Saved("the row's k with rope", heads * qk, over="row"),
        Saved("attention output (o_proj input)", heads * v, "linear"), Saved("log-sum-exp", heads, "fp32"),
        Saved("attention block output", h),
    ]
    layer.gathered_keys_per_token = kv_lora + rope
    if dsa:
        n_idx, d_idx, topk = hf["index_n_heads"], hf["index_head_dim"], hf["index_topk"]
        idx = [(q_lora, n_idx * d_idx), (h, d_idx), (h, n_idx)]
        layer.dense += sum(_linear(*p) for p in idx) + 2 * d_idx  # + k_norm (LayerNorm: weight and bias)
        layer.quantisable += q_lora * n_idx * d_idx + h * d_idx
        layer.saved += [Saved("indexer queries and head weights", n_idx * d_idx + 2 * n_idx),
                        Saved("indexer keys (all-gathered over cp)", d_idx, over="row")]
        if seq_len > topk:  # shorter rows attend to every key: no selection is made
            layer.saved.append(Saved("DSA top-k key indices", topk, "int32"))
        layer.index_key_dim = d_idx


def gqa_mixer(hf: Mapping[str, Any], layer: Layer, *, qk_norm: str | None, rope: bool) -> None:
    """Grouped-query attention: q/k RMSNorms per head (``qk_norm="head"``, Qwen3) or over the
    whole projection (``"layer"``, MiniMax-M2) or none, with RoPE or without (Nemotron-H)."""
    h, heads, kv = hf["hidden_size"], hf["num_attention_heads"], hf["num_key_value_heads"]
    d = hf.get("head_dim") or h // heads
    bias = bool(hf.get("attention_bias", False))
    proj = [(h, heads * d, bias), (h, kv * d, bias), (h, kv * d, bias), (heads * d, h, bias)]
    layer.dense += sum(_linear(*p) for p in proj) + {"head": 2 * d, "layer": (heads + kv) * d, None: 0}[qk_norm]
    layer.quantisable += sum(a * b for a, b, _ in proj)
    layer.saved += [Saved("q, k, v projections", (heads + 2 * kv) * d)]
    if qk_norm:
        layer.saved.append(Saved("normalised q and k", (heads + kv) * d))
    if rope:
        layer.saved.append(Saved("q and k with rope", (heads + kv) * d))
    layer.saved.append(Saved("the row's k and v (gathered over cp)", 2 * kv * d, over="row", cp_only=True))
    layer.saved += [Saved("attention output (o_proj input)", heads * d, "linear"), Saved("log-sum-exp", heads, "fp32"),
                    Saved("attention block output", h)]
    layer.gathered_keys_per_token = 2 * kv * d


def mamba2_mixer(hf: Mapping[str, Any], layer: Layer) -> None:
    """Nemotron-H's Mamba-2 mixer (names and shapes of ``primerl_blocks.mamba2``)."""
    h = hf["hidden_size"]
    heads, head_dim = hf["mamba_num_heads"], hf["mamba_head_dim"]
    groups = hf.get("n_groups", hf.get("mamba_n_groups", 8))
    state = hf["ssm_state_size"]
    kernel = hf.get("conv_kernel", hf.get("mamba_d_conv", 4))
    conv_bias = hf.get("use_conv_bias", hf.get("mamba_conv_bias", True))
    bias = bool(hf.get("use_bias", False))
    chunk = hf.get("chunk_size", 128)
    inner = heads * head_dim
    conv_dim = inner + 2 * groups * state
    layer.dense += (_linear(h, inner + conv_dim + heads, bias) + conv_dim * kernel + (conv_dim if conv_bias else 0)
                    + 3 * heads + inner + _linear(inner, h, bias))  # dt_bias, A_log, D; gated norm
    layer.quantisable += h * (inner + conv_dim + heads) + inner * h
    layer.saved += [
        Saved("in_proj output (z, xBC, dt)", inner + conv_dim + heads),
        Saved("conv output and its silu", 2 * conv_dim), Saved("dt", heads, "fp32"),
        Saved("chunk states", heads * head_dim * state / chunk, "fp32"),
        Saved("scan output", inner, "fp32"), Saved("gated values", inner, "fp32"),
        Saved("gated norm output (out_proj input)", inner, "linear"), Saved("mixer output", h),
    ]


def _mtp_params(hf: Mapping[str, Any], moe_layer: Layer | None) -> tuple[int, int]:
    """(MTP layers, their parameters): DeepSeek-V3's module per layer is one decoder layer
    (an MoE one) plus two input norms, ``eh_proj`` [hidden, 2 hidden] and the shared head's
    norm; embeddings and head are shared with the model."""
    n = int(hf.get("num_nextn_predict_layers") or 0)
    if not n or moe_layer is None:
        return n, 0
    h = hf["hidden_size"]
    return n, n * (moe_layer.params + 3 * h + 2 * h * h)


def decoder_shape(hf: Mapping[str, Any], moe_layers: Iterable[int], *, attention: str,
                  qk_norm: str | None = None, indexers: Sequence[str] | None = None, router_bias: bool = False,
                  shared_experts: bool = False, expert_inter: str = "moe_intermediate_size", name: str = "",
                  preset: str = "", seq_len: int = 4096) -> ModelShape:
    """The shape of a plain decoder (every layer: two norms, attention, then a SwiGLU MLP or
    an MoE block), from its HF config and the indices of its MoE layers. ``attention`` is
    ``"gqa"`` (``qk_norm``: ``"head"``, per-head q/k RMSNorms as Qwen3, or ``"layer"``, over
    the whole projection as MiniMax-M2) or ``"mla"``; ``indexers`` gives each MLA layer's
    DSA indexer kind (``"full"`` runs it, ``"shared"`` reuses the previous layer's selection;
    None: no DSA). MoE blocks: ``router_bias``, a sigmoid router's score-correction bias
    (DeepSeek-V3, MiniMax-M2); ``shared_experts``, ``n_shared_experts`` shared experts
    (DeepSeek-V3); ``expert_inter``, the config key of an expert's width. ``seq_len``
    matters only with DSA (rows no longer than ``index_topk`` make no key selection). Model
    plugins call it from ``ModelAdapter.shape``."""
    if attention not in ("gqa", "mla"):
        raise ValueError(f"attention must be 'gqa' or 'mla', got {attention!r}")
    h = hf["hidden_size"]
    n = hf["num_hidden_layers"]
    moe = set(moe_layers)
    n_experts, top_k = experts_of(hf) if moe else (0, 0)
    expert_params = 0
    layers: list[Layer] = []
    for i in range(n):
        layer = Layer(i, attention, "moe" if i in moe else "dense")
        layer.dense += 2 * h  # input and post-attention norms
        layer.saved += norm_residual(h, 2)
        if attention == "mla":
            full_indexer = indexers is not None and indexers[i] == "full"
            layer.mixer = "mla_dsa" if indexers is not None else "mla"
            mla_mixer(hf, layer, dsa=full_indexer, seq_len=seq_len)
            if full_indexer and i + 1 < n and indexers[i + 1] == "shared" and seq_len > hf["index_topk"]:
                layer.carry = Saved("DSA selection reused by the next layer", hf["index_topk"], "int32")
        else:
            gqa_mixer(hf, layer, qk_norm=qk_norm, rope=True)
        if i in moe:
            block, expert_params = moe_block(
                hf, h, n_experts=n_experts, top_k=top_k, inter=hf[expert_inter], gated=True,
                shared_inter=hf[expert_inter] * (hf.get("n_shared_experts") or 0) if shared_experts else 0,
                shared_bias=False, router_bias=router_bias, latent=None,
            )
            merge_block(layer, block)
        else:
            params, saved = dense_mlp(h, hf["intermediate_size"], gated=True, bias=bool(hf.get("mlp_bias", False)))
            layer.dense += params
            layer.quantisable += 3 * h * hf["intermediate_size"]
            layer.saved += saved
        layers.append(layer)
    return assemble_shape(hf, layers, num_experts=n_experts, top_k=top_k, expert_params=expert_params,
                          name=name, preset=preset)


def experts_of(hf: Mapping[str, Any]) -> tuple[int, int]:
    """(routed experts, experts per token) of an HF config, under the names HF configs use."""
    n = hf.get("n_routed_experts", hf.get("num_experts", hf.get("num_local_experts", 0)))
    return int(n or 0), int(hf.get("num_experts_per_tok", 0) or 0)


def assemble_shape(hf: Mapping[str, Any], layers: list[Layer], *, num_experts: int, top_k: int,
                   expert_params: int, name: str = "", preset: str = "") -> ModelShape:
    """A :class:`ModelShape` from a model's decoder layers (built with the functions above):
    embeddings, the head (none when tied), the final norm and the MTP layers' count."""
    h, vocab = hf["hidden_size"], hf["vocab_size"]
    moe = any(layer.mlp == "moe" for layer in layers)
    tied = bool(hf.get("tie_word_embeddings", False))
    first_moe = next((layer for layer in layers if layer.mlp == "moe"), None)
    mtp_layers, mtp = _mtp_params(hf, first_moe)
    return ModelShape(
        name=name, preset=preset, model_type=hf.get("model_type", ""), hidden=h, vocab=vocab, tied=tied,
        layers=layers, embed=vocab * h, head=0 if tied else vocab * h, final_norm=h,
        num_experts=num_experts if moe else 0, top_k=top_k if moe else 0, expert_params=expert_params,
        mtp_layers=mtp_layers, mtp_params=mtp,
    )


def merge_block(layer: Layer, block: Layer) -> None:
    layer.dense += block.dense
    layer.experts += block.experts
    layer.quantisable += block.quantisable
    layer.buffers += block.buffers
    layer.saved += block.saved
    layer.a2a_width = block.a2a_width


def load_shape(model: str, preset: str, seq_len: int = 4096) -> ModelShape:
    """The :class:`ModelShape` of an installed model plugin's preset (no torch)."""
    from primerl.errors import PluginError
    from primerl.registry import get_registry

    try:
        adapter = get_registry().load("model", model)()
    except PluginError as exc:
        raise PrimerlError(f"--model: {exc}") from None
    if preset not in adapter.presets:
        raise PrimerlError(f"--preset: model '{model}' has no preset '{preset}'; use one of {', '.join(adapter.presets)}")
    shape = adapter.shape(adapter.hf_config(preset), seq_len=seq_len)
    shape.name, shape.preset = model, preset
    return shape


# ---------------------------------------------------------------------------------------
# Layouts, memory and communication
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int

    def describe(self) -> str:
        return f"dp_replicate={self.dp_replicate} dp_shard={self.dp_shard} cp={self.cp} ep={self.ep}"


@dataclass(frozen=True)
class Cluster:
    nodes: int
    gpus_per_node: int
    gpu_memory_gb: float = H200_MEMORY_GB
    margin: float = DEFAULT_MARGIN

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> float:
        return (1 - self.margin) * self.gpu_memory_gb * GB

    def same_node(self, size: int, stride: int = 1) -> bool:
        """Whether a group of ``size`` ranks ``stride`` apart (mesh order) stays in one node."""
        span = (size - 1) * stride + 1
        return size == 1 or (span <= self.gpus_per_node and self.gpus_per_node % (size * stride) == 0)


def _dtype_bytes(dtype: str, fp8: bool) -> float:
    if dtype == "linear":
        return FP8_BYTES if fp8 else 2
    return {"bf16": 2, "fp32": 4, "int32": 4}[dtype]


def cp_tokens(seq_len: int, cp: int) -> tuple[int, int]:
    """(tokens of a row each cp rank holds, the row's length once padded): context parallel
    pads a row to a multiple of ``2 * cp`` (its zigzag chunks)."""
    if cp == 1:
        return seq_len, seq_len
    padded = -(-seq_len // (2 * cp)) * 2 * cp
    return padded // cp, padded


def _saved_bytes(saved: Iterable[Saved], layout: Layout, seq_len: int, rows: int, fp8: bool) -> tuple[float, float]:
    """(total bytes, the largest tensor's bytes) of some saved tensors."""
    local, row = cp_tokens(seq_len, layout.cp)
    sizes = [s.per_token * rows * (row if s.over == "row" else local) * _dtype_bytes(s.dtype, fp8)
             for s in saved if layout.cp > 1 or not s.cp_only]
    return sum(sizes), max(sizes, default=0.0)


def layer_activation_bytes(layer: Layer, layout: Layout, seq_len: int, rows: int, fp8: bool) -> float:
    """Bytes alive while one layer is recomputed and back-propagated (see the module doc)."""
    total, largest = _saved_bytes(layer.saved, layout, seq_len, rows, fp8)
    local = rows * cp_tokens(seq_len, layout.cp)[0]
    if layer.mlp == "moe" and layout.ep > 1:
        total += 2 * local * layer.a2a_width * 2  # all-to-all send buffers, dispatch and combine
    return total + largest  # + the largest tensor's gradient


def memory(shape: ModelShape, layout: Layout, seq_len: int, rows: int = 1, fp8: bool = False) -> dict[str, float]:
    """Per-GPU bytes of each component for ``layout`` (see the module doc for the formulas)."""
    shard = layout.dp_shard * layout.cp
    dense_params = shape.params - shape.expert_params_total
    local_params = dense_params / shard + shape.expert_params_total / layout.ep / (shard // layout.ep)

    units = [(layer.dense + layer.experts / layout.ep, layer.quantisable - layer.experts * (1 - 1 / layout.ep))
             for layer in shape.layers]
    units += [(shape.embed, 0), (shape.head, 0)]
    gathered, quantisable = max(units)
    gather_bytes = (2 + 2 + 4) * gathered + (2 * quantisable if fp8 else 0)

    local = rows * cp_tokens(seq_len, layout.cp)[0]
    checkpoints = len(shape.layers) * local * shape.hidden * 2
    checkpoints += sum(_saved_bytes([layer.carry], layout, seq_len, rows, fp8)[0]
                       for layer in shape.layers if layer.carry)
    head = local * (shape.hidden * 2 + 4 * shape.vocab * 2)
    working = max((layer_activation_bytes(layer, layout, seq_len, rows, fp8) for layer in shape.layers), default=0)
    out = {
        "parameters": 4 * local_params + 4 * shape.buffers,
        "gradients": 4 * local_params,
        "optimizer": 8 * local_params,
        "activations": checkpoints + max(head, working),
        "allgather_buffers": gather_bytes,
    }
    out["total"] = sum(out.values())
    return out


def communication_seconds(shape: ModelShape, layout: Layout, cluster: Cluster, seq_len: int, rows: int = 1) -> float:
    """Coarse seconds of communication per GPU for one micro-batch (module doc), to rank layouts."""
    shard = layout.dp_shard * layout.cp
    ep_shard = shard // layout.ep

    def bw(size: int, stride: int = 1) -> float:
        return (NVLINK_GB_PER_S if cluster.same_node(size, stride) else NETWORK_GB_PER_S) * GB

    def ring(size: int) -> float:
        return (size - 1) / size if size > 1 else 0.0

    seconds = 0.0
    dense_gathered = shape.embed + shape.head + shape.final_norm + sum(layer.dense for layer in shape.layers)
    expert_gathered = shape.expert_params_total / layout.ep
    # all-gather bf16 twice (forward, backward), reduce-scatter fp32 gradients once
    seconds += dense_gathered * (2 * 2 + 4) * ring(shard) / bw(shard)
    seconds += expert_gathered * (2 * 2 + 4) * ring(ep_shard) / bw(ep_shard, layout.ep)
    # HSDP: all-reduce of the sharded fp32 gradients over the replicas
    local_params = shape.params / shard
    seconds += 2 * 4 * local_params * ring(layout.dp_replicate) / bw(layout.dp_replicate, shard)
    local, row = (rows * n for n in cp_tokens(seq_len, layout.cp))
    for layer in shape.layers:
        if layer.mlp == "moe" and layout.ep > 1:  # dispatch + combine in forward, recompute, backward
            seconds += 6 * local * shape.top_k * layer.a2a_width * 2 * ring(layout.ep) / bw(layout.ep)
        if layout.cp > 1:
            # the row's keys all-gathered in forward and recompute, their gradients
            # reduce-scattered in backward; the indexer's keys take no gradient
            keys = (3 * layer.gathered_keys_per_token + 2 * layer.index_key_dim) * row * 2
            seconds += keys * ring(layout.cp) / bw(layout.cp)
    return seconds


# ---------------------------------------------------------------------------------------
# Validation and search
# ---------------------------------------------------------------------------------------


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layout_error(shape: ModelShape, layout: Layout, cluster: Cluster, seq_len: int) -> str | None:
    """Why ``layout`` cannot run (a one-line message naming the flag and the fix), or None."""
    world = cluster.world
    product = layout.dp_replicate * layout.dp_shard * layout.cp
    if product != world:
        return (f"--dp-replicate {layout.dp_replicate} x --dp-shard {layout.dp_shard} x --cp {layout.cp} = {product} "
                f"ranks, but --nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node} = {world} GPUs; "
                f"make the product {world} (or leave --dp-shard out to fill it)")
    if layout.cp > 1 and shape.has_mamba:
        return (f"--cp {layout.cp}: {shape.name or 'the model'}'s Mamba-2 layers cannot be split over context "
                f"parallel ranks (state passing between ranks is not implemented); use --cp 1")
    shard = layout.dp_shard * layout.cp
    if layout.ep > 1 and not shape.num_experts:
        return f"--ep {layout.ep}: {shape.name or 'this model'} has no routed experts; use --ep 1"
    if layout.ep > 1 and (shape.num_experts % layout.ep or shard % layout.ep):
        valid = [e for e in _divisors(math.gcd(shape.num_experts, shard))]
        return (f"--ep {layout.ep} must divide the {shape.num_experts} routed experts of {shape.name or 'the model'} "
                f"and dp_shard x cp = {shard}; valid: {', '.join(map(str, valid))}")
    return None


def resolve_layout(cluster: Cluster, *, dp_replicate: int | None, dp_shard: int | None, cp: int | None,
                   ep: int | None) -> Layout:
    """The layout the flags name; ``--dp-shard`` left out fills the GPUs the others leave."""
    for flag, value in (("--dp-replicate", dp_replicate), ("--dp-shard", dp_shard), ("--cp", cp), ("--ep", ep)):
        if value is not None and value < 1:
            raise PrimerlError(f"{flag} must be a positive integer, got {value}")
    r, c, e = dp_replicate or 1, cp or 1, ep or 1
    if dp_shard is None:
        if cluster.world % (r * c):
            raise PrimerlError(f"--dp-replicate {r} x --cp {c} = {r * c} does not divide the {cluster.world} GPUs "
                               f"(--nodes {cluster.nodes} x --gpus-per-node {cluster.gpus_per_node}); pick divisors")
        dp_shard = cluster.world // (r * c)
    return Layout(r, dp_shard, c, e)


def candidate_layouts(shape: ModelShape, cluster: Cluster, seq_len: int) -> list[Layout]:
    """Every valid (dp_replicate, dp_shard, cp, ep) of the cluster's GPUs."""
    out = []
    for r in _divisors(cluster.world):
        for c in _divisors(cluster.world // r):
            if c > 1 and shape.has_mamba:
                continue
            s = cluster.world // (r * c)
            eps = _divisors(math.gcd(shape.num_experts, s * c)) if shape.num_experts else [1]
            out += [Layout(r, s, c, e) for e in eps]
    return out


@dataclass(frozen=True)
class Evaluated:
    layout: Layout
    rows: int
    bytes: dict[str, float]
    comm_seconds: float  # per GPU and micro-batch
    fits: bool

    @property
    def comm_seconds_per_row(self) -> float:
        """Communication per row trained: the cluster trains ``R * dp`` rows per micro-batch."""
        return self.comm_seconds / (self.rows * self.layout.dp_replicate * self.layout.dp_shard)


def evaluate(shape: ModelShape, layout: Layout, cluster: Cluster, seq_len: int, rows: int, fp8: bool) -> Evaluated:
    b = memory(shape, layout, seq_len, rows, fp8)
    return Evaluated(layout, rows, b, communication_seconds(shape, layout, cluster, seq_len, rows),
                     b["total"] <= cluster.usable_bytes)


def suggest(shape: ModelShape, cluster: Cluster, seq_len: int, rows: int = 1, fp8: bool = False) -> dict[str, Any]:
    """The layout that fits with the least estimated communication (ties: least memory); if
    none fits, the one needing the least memory. One line says why."""
    results = [evaluate(shape, lay, cluster, seq_len, rows, fp8) for lay in candidate_layouts(shape, cluster, seq_len)]
    fitting = [r for r in results if r.fits]
    if fitting:
        best = min(fitting, key=lambda r: (r.comm_seconds_per_row, r.bytes["total"]))
        least_memory = min(fitting, key=lambda r: r.bytes["total"])
        why = (f"{best.layout.describe()}: fits in {_gb(best.bytes['total'])} of {_gb(cluster.usable_bytes)} with the "
               f"least estimated communication ({best.comm_seconds_per_row:.3g} s per row trained) of {len(fitting)} "
               f"fitting layouts out of {len(results)}")
        if least_memory is not best:
            why += f"; the leanest, {least_memory.layout.describe()}, needs {_gb(least_memory.bytes['total'])}"
    else:
        best = min(results, key=lambda r: (r.bytes["total"], r.comm_seconds))
        why = (f"nothing fits in {_gb(cluster.usable_bytes)}: the leanest of {len(results)} layouts, "
               f"{best.layout.describe()}, needs {_gb(best.bytes['total'])}; add nodes or shorten --seq-len")
    return {**_evaluated_json(best), "why": why}


def _gb(n_bytes: float) -> str:
    gb = n_bytes / GB
    return f"{gb:.1f} GB" if gb >= 1 else f"{gb:.2g} GB"


def _evaluated_json(r: Evaluated) -> dict[str, Any]:
    return {
        "layout": asdict(r.layout),
        "per_gpu_gb": {k: round(v / GB, 2) for k, v in r.bytes.items()},
        "total_gb": round(r.bytes["total"] / GB, 2),
        "fits": r.fits,
        "comm_seconds_per_row": round(r.comm_seconds_per_row, 4),
    }


def plan(model: str, preset: str = "full", *, nodes: int, gpus_per_node: int, seq_len: int,
         dp_replicate: int | None = None, dp_shard: int | None = None, cp: int | None = None,
         ep: int | None = None, micro_batch_rows: int = 1, fp8: bool = False,
         gpu_memory_gb: float = H200_MEMORY_GB, margin: float = DEFAULT_MARGIN) -> dict[str, Any]:
    """The whole report of ``primerl plan`` as a JSON-able dict. With no layout flag the
    layout planned is the suggested one; otherwise the one the flags name (checked)."""
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node), ("--seq-len", seq_len),
                        ("--micro-batch-rows", micro_batch_rows)):
        if value < 1:
            raise PrimerlError(f"{flag} must be a positive integer, got {value}")
    if gpu_memory_gb <= 0 or not 0 <= margin < 1:
        raise PrimerlError("--gpu-memory-gb must be positive and --margin in [0, 1), e.g. --margin 0.1")
    cluster = Cluster(nodes, gpus_per_node, gpu_memory_gb, margin)
    shape = load_shape(model, preset, seq_len)
    suggested = suggest(shape, cluster, seq_len, micro_batch_rows, fp8)
    if all(v is None for v in (dp_replicate, dp_shard, cp, ep)):
        layout, source = Layout(**suggested["layout"]), "suggested"
    else:
        layout = resolve_layout(cluster, dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep)
        source = "flags"
        error = layout_error(shape, layout, cluster, seq_len)
        if error:
            raise PrimerlError(error)
    chosen = evaluate(shape, layout, cluster, seq_len, micro_batch_rows, fp8)
    largest = max(shape.layers, key=lambda layer: layer.params)
    gathered = largest.dense + largest.experts / layout.ep
    return {
        "model": model, "preset": preset, "model_type": shape.model_type,
        "nodes": nodes, "gpus_per_node": gpus_per_node, "world_size": cluster.world,
        "seq_len": seq_len, "micro_batch_rows": micro_batch_rows, "fp8": fp8,
        "params": {
            "total": shape.params, "routed_experts": shape.expert_params_total,
            "other": shape.params - shape.expert_params_total, "active_per_token": shape.active_params,
            "buffers": shape.buffers, "layers": len(shape.layers),
            "moe_layers": sum(1 for layer in shape.layers if layer.mlp == "moe"),
            "routed_experts_per_layer": shape.num_experts, "experts_per_token": shape.top_k,
            "mtp_layers_skipped": shape.mtp_layers, "mtp_params_skipped": shape.mtp_params,
        },
        "layout": asdict(layout), "layout_source": source,
        "per_gpu_bytes": {k: int(v) for k, v in chosen.bytes.items()},
        "per_gpu_gb": {k: round(v / GB, 2) for k, v in chosen.bytes.items()},
        "layer_allgather_gb_fp32": round(largest.params * 4 / GB, 2),
        "layer_allgather_gb_bf16": round(gathered * 2 / GB, 2),
        "largest_layer": largest.index,
        "gpu_memory_gb": gpu_memory_gb, "margin": margin, "usable_gb": round(cluster.usable_bytes / GB, 2),
        "fits": chosen.fits, "comm_seconds_per_row": round(chosen.comm_seconds_per_row, 4),
        "suggested": suggested,
        "assumptions": list(ASSUMPTIONS) + ([FP8_ASSUMPTION] if fp8 else []),
    }
