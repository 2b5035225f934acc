"""Multi-head Latent Attention (DeepSeek-V3, Kimi K2, GLM-5) over primerl's ragged batch.

Queries go hidden -> q_lora_rank -> heads * (nope + rope) (or straight hidden -> heads *
(nope + rope) when ``q_lora_rank`` is None). Keys and values share one compressed latent
(kv_lora_rank, RMS-normalised) plus one single-head rope key; the cache stores only these
two, and ``kv_b_proj`` expands the latent to per-head k_nope and v. RoPE is "interleaved"
(HF's ``rope_interleave=True``, what DeepSeek, Kimi and GLM ship): pairs (x0, x1),
(x2, x3)... rotate together. HF then de-interleaves them; we keep them in place (queries
and keys alike, so every q.k is the same, summed in another order), which spares a copy.

Decode steps attend in the latent space (DeepSeek's "weight absorption"), prefill and
training expand the latent into per-head keys and values, unless folding ``kv_b_proj``
into the query and output projections costs no more (:meth:`MLAttention._fold_cheaper`: a
latent no wider than the heads' nope and v dims, as in the tiny presets). Then
(:meth:`MLAttention._folded`) queries come out as cache rows and all heads score the cache
rows themselves in one product: on CPU about half the ops of the expanded form.
Subclasses may restrict which keys each query sees by overriding
:meth:`MLAttention.select` (GLM-5's DeepSeek Sparse Attention).

Names and shapes are HF's ``DeepseekV3Attention`` / ``GlmMoeDsaAttention``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.batch import Batch
from primerl.models.contract import Mixer
from primerl.models.tensors import derived, keeps_derived
from primerl_blocks.layers import RMSNorm, partial_rotation, rope_halves, rope_interleaved

__all__ = ["MLAttention", "mla_cache_layout"]


def mla_cache_layout(config: Any) -> dict[str, tuple[int, ...]]:
    """The per-token cache of one MLA layer: one row of the latent followed by the shared
    rope key (kv_lora + rope: 512 + 64 = 576 for DeepSeek-V3, FlashMLA's layout), so a
    decode step writes and reads one tensor per layer and scores both parts in one product."""
    return {"ckv": (config.kv_lora_rank + config.qk_rope_head_dim,)}


class MLAttention(nn.Module):
    """Multi-head latent attention. ``forward(x, batch, carry) -> (out, carry)``.

    ``config`` needs hidden_size, num_attention_heads, q_lora_rank (or None),
    kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, attention_bias;
    ``scaling`` is the softmax scale (YaRN multiplies it by mscale^2); ``interleave``:
    HF's ``rope_interleave`` (False rotates halves, Llama style).
    """

    mixer_kind = Mixer.MLA  # a subclass restricting keys by select (DSA) declares Mixer.MLA_DSA

    def __init__(self, config: Any, layer_idx: int, *, scaling: float | None = None,
                 interleave: bool = True) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.n_heads = c.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        qk_head_dim = self.nope_dim + self.rope_dim
        self.q_lora = c.q_lora_rank is not None  # queries through a low-rank q_a_proj -> q_b_proj
        if not self.q_lora:
            self.q_proj = nn.Linear(c.hidden_size, self.n_heads * qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank)
            self.q_b_proj = nn.Linear(c.q_lora_rank, self.n_heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope_dim, bias=c.attention_bias)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank)
        self.kv_b_proj = nn.Linear(c.kv_lora_rank, self.n_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.scaling = qk_head_dim**-0.5 if scaling is None else scaling
        self.interleave = interleave

    def _query_proj(self) -> nn.Module:
        """The projection that outputs the per-head queries (``q_b_proj`` after the low rank)."""
        return self.q_b_proj if self.q_lora else self.q_proj

    def select(self, x: Tensor, q_latent: Tensor | None, batch: Batch, carry: Any) -> tuple[Tensor, Any]:
        """Which keys each query may attend to: ([B, S, T] bool, carry for the next layer)."""
        return batch.visible, carry

    def forward(self, x: Tensor, batch: Batch, carry: Any = None) -> tuple[Tensor, Any]:
        """x: [B, S, hidden]. Returns the output [B, S, hidden] and the carry."""
        B, S, _ = x.shape
        H, L = self.n_heads, self.layer_idx
        # decode steps absorb kv_b_proj's weight into the query and output: a plain linear's only
        decode = batch.cache is not None and S == 1 and type(self.kv_b_proj) is nn.Linear
        if self._fold_cheaper(B * S, batch, decode=decode):
            return self._folded(x, batch, carry)
        if not self.q_lora:
            q_latent, q = None, self.q_proj(x)
            kv = self.kv_a_proj_with_mqa(x)
        else:
            q_latent, kv = self._down_projections(x)  # [B, S, q_lora], [B, S, kv_lora + rope]
            q_latent = self.q_a_layernorm(q_latent)
            q = self.q_b_proj(q_latent)
        q = q.view(B, S, H, -1).transpose(1, 2)  # [B, H, S, nope+rope]
        q_nope, q_rot = q.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rot = self._rope(q_rot, batch, per_head=True)

        latent, k_rot = kv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)  # [B, S, kv_lora]
        k_rot = self._rope(k_rot, batch, per_head=False)  # [B, S, rope], one head shared by all
        ckv = batch.keys(torch.cat([latent, k_rot], dim=-1), L, "ckv")  # [B, T, kv_lora + rope]
        latent, k_rot = ckv.split([self.kv_lora_rank, self.rope_dim], dim=-1)
        T = ckv.shape[1]

        mask, carry = self.select(x, q_latent, batch, carry)  # [B, S, T]
        if decode:
            out = self._absorbed(q_nope, q_rot, ckv, batch.bias(mask, ckv.dtype))  # [B, H, 1, v]
        else:
            kv = self.kv_b_proj(latent).view(B, T, H, -1).transpose(1, 2)  # [B, H, T, nope+v]
            k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_rot[:, None].expand(B, H, T, self.rope_dim)], dim=-1)  # [B, H, T, nope+rope]
            q = torch.cat([q_nope, q_rot], dim=-1)  # [B, H, S, nope+rope]
            if batch.causal and mask is batch.visible:  # no key selection (DSA) on a plain causal batch
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scaling)  # [B, H, S, v]
            else:
                # HF's eager attention; SDPA would take its math path anyway (q.k and v head
                # dims differ) and add a fully-masked-row check we never need
                bias = batch.bias(mask, q.dtype)[:, None]  # [B, 1, S, T], built once for the layers sharing the mask
                scores = torch.matmul(q, k.transpose(-1, -2)).mul_(self.scaling) + bias  # [B, H, S, T]
                out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)  # [B, H, S, v]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, H * self.v_dim)), carry

    def _fold_cheaper(self, n_queries: int, batch: Batch, *, decode: bool) -> bool:
        """Whether :meth:`_folded` costs no more multiply-adds than the form it replaces
        (``decode``: :meth:`_absorbed`, else the expanded keys and values) for ``n_queries``
        queries (padding included) over this batch's keys, and applies: the three
        projections it folds are plain ``nn.Linear`` (FP8 training and LoRA swap in their own
        linears, which must keep running their own computations)."""
        q_proj = self._query_proj()
        if not all(type(m) is nn.Linear for m in (q_proj, self.kv_b_proj, self.o_proj)):
            return False
        r, nope, rope, v = self.kv_lora_rank, self.nope_dim, self.rope_dim, self.v_dim
        q_in, hidden, H = q_proj.in_features, self.o_proj.out_features, self.n_heads
        # keys per query (every query, at most its row's keys) and keys in all: bounds from the shapes
        T = batch.visible.shape[-1] if batch.visible is not None else n_queries
        keys = n_queries if batch.cache is None else batch.visible.shape[0] * T
        if decode:  # latent attention, kv_b_proj applied to the query and the output of each step
            other = n_queries * H * (q_in * (nope + rope) + nope * r + T * (2 * r + rope) + r * v + v * hidden)
        else:
            other = n_queries * H * (q_in * (nope + rope) + v * hidden + T * (nope + rope + v)) + keys * H * r * (nope + v)
        folded = n_queries * H * (q_in * (r + rope) + r * hidden + T * (2 * r + rope))
        if torch.is_grad_enabled():  # folding the weights (kept between forwards without autograd)
            folded += H * (q_in * nope * r + hidden * v * r)
        return folded <= other

    def _folded_weights(self) -> tuple[Tensor, Tensor]:
        """``kv_b_proj`` folded into the query and output projections, per head h:
        ``q_proj_h' = [W_uk_h^T W_q_nope_h; W_q_rope_h]`` ([H * (kv_lora + rope), q_in]) and
        ``o_proj_h' = W_o_h W_uv_h`` ([hidden, H * kv_lora]). With autograd on they are
        rebuilt every forward (gradients reach the three weights), else kept (``derived``)."""
        H, nope, rope, v = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        q = self._query_proj()
        wq, wb, wo = q.weight, self.kv_b_proj.weight, self.o_proj.weight

        def build() -> tuple[Tensor, Tensor]:
            heads = self._kv_b_heads()  # [H, nope + v, kv_lora]
            wq_h = wq.view(H, nope + rope, -1)  # [H, nope + rope, q_in]
            q_lat = torch.matmul(heads[:, :nope].transpose(1, 2), wq_h[:, :nope])  # [H, kv_lora, q_in]
            wq_f = torch.cat([q_lat, wq_h[:, nope:]], dim=1).flatten(0, 1)  # [H * (kv_lora + rope), q_in]
            wo_h = wo.view(wo.shape[0], H, v).transpose(0, 1)  # [H, hidden, v]
            wo_f = torch.matmul(wo_h, heads[:, nope:]).transpose(0, 1).flatten(1)  # [hidden, H * kv_lora]
            return wq_f, wo_f

        if not keeps_derived(wq, wb, wo):
            return build()
        wq_f = derived(self, "folded_q", lambda: build()[0], wq, wb, wo)
        return wq_f, derived(self, "folded_o", lambda: build()[1], wq, wb, wo)

    def _folded(self, x: Tensor, batch: Batch, carry: Any) -> tuple[Tensor, Any]:
        """Prefill / training attention in the latent space, with ``kv_b_proj`` folded into
        the query and output projections (:meth:`_folded_weights`): the same maths as the
        expanded form (sums in another order). Queries come out as cache rows per head,
        [kv_lora + rope], so every head scores the rows themselves and one product serves
        all heads (the heads sit next to the queries: [B, S * H, ...]); RoPE rotates the
        rope dims of queries and keys in one op each (the latent dims by 1).
        x: [B, S, hidden]. Returns ([B, S, hidden], carry)."""
        B, S, _ = x.shape
        H, r, rope = self.n_heads, self.kv_lora_rank, self.rope_dim
        wq_f, wo_f = self._folded_weights()
        if not self.q_lora:
            q_latent, q_in, kv = None, x, self.kv_a_proj_with_mqa(x)
        else:
            q_latent, kv = self._down_projections(x)  # [B, S, q_lora], [B, S, kv_lora + rope]
            q_latent = q_in = self.q_a_layernorm(q_latent)
        q = F.linear(q_in, wq_f).view(B, S, H, r + rope)  # per head: [latent query, rope query]
        if self.interleave:
            rot = partial_rotation(batch.extra, before=r // 2)  # [B, S, (kv_lora + rope) / 2]: 1 on the latent pairs
            q = rope_interleaved(q, rot[:, :, None])
            latent, k_rot = rope_interleaved(kv, rot).split([r, rope], dim=-1)
        else:
            cos, sin = batch.extra["cos"], batch.extra["sin"]  # [B, S, rope/2]
            q_lat, q_rot = q.split([r, rope], dim=-1)
            q = torch.cat([q_lat, rope_halves(q_rot, cos[:, :, None], sin[:, :, None])], dim=-1)
            latent, k_rot = kv.split([r, rope], dim=-1)
            k_rot = rope_halves(k_rot, cos, sin)
        ckv = batch.keys(torch.cat([self.kv_a_layernorm(latent), k_rot], dim=-1), self.layer_idx, "ckv")  # [B, T, kv_lora + rope]
        T = ckv.shape[1]
        mask, carry = self.select(x, q_latent, batch, carry)  # [B, S, T]
        bias = batch.bias(mask, ckv.dtype)  # [B, S, T] additive (0 or -inf)
        if S == 1:  # decode: the bias row serves every head as it is
            scores = torch.baddbmm(bias, q.view(B, H, r + rope), ckv.transpose(1, 2), alpha=self.scaling)  # [B, H, T]
        else:
            scores = torch.bmm(q.view(B, S * H, r + rope), ckv.transpose(1, 2)).view(B, S, H, T)
            scores = scores.mul_(self.scaling) + bias[:, :, None]  # [B, S, H, T]
        probs = torch.softmax(scores.float(), dim=-1).to(ckv.dtype)
        out = torch.bmm(probs.view(B, S * H, T), ckv[..., :r])  # [B, S * H, kv_lora]
        return F.linear(out.view(B, S, H * r), wo_f, self.o_proj.bias), carry

    def _rope(self, t: Tensor, batch: Batch, *, per_head: bool) -> Tensor:
        """RoPE on the queries ([B, H, S, rope], ``per_head``) or the shared key ([B, S, rope])."""
        if self.interleave:
            rot = batch.extra["rot"]  # [B, S, rope/2] complex
            return rope_interleaved(t, rot[:, None] if per_head else rot)
        cos, sin = batch.extra["cos"], batch.extra["sin"]  # [B, S, rope/2]
        return rope_halves(t, cos[:, None], sin[:, None]) if per_head else rope_halves(t, cos, sin)

    def _down_projections(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``q_a_proj(x)`` and ``kv_a_proj_with_mqa(x)``; without autograd as one matmul with
        the two plain linears' weights stacked (decode steps are dominated by per-op overhead)."""
        qa, kva = self.q_a_proj, self.kv_a_proj_with_mqa
        plain = type(qa) is nn.Linear and type(kva) is nn.Linear  # not FP8's or LoRA's: they compute their own way
        if torch.is_grad_enabled() or not plain or qa.bias is not None or kva.bias is not None:
            return qa(x), kva(x)
        w = derived(self, "down_proj_stacked", lambda: torch.cat([qa.weight, kva.weight]), qa.weight, kva.weight)
        return F.linear(x, w).split([qa.out_features, kva.out_features], dim=-1)

    def _absorbed(self, q_nope: Tensor, q_rot: Tensor, ckv: Tensor, bias: Tensor) -> Tensor:
        """Attention in the latent space, for decode steps (DeepSeek's "weight absorption").

        Expanding every cached latent into per-head keys and values costs
        T * kv_lora * H * (nope + v) per step; folding ``kv_b_proj`` into the query and the
        output instead costs H * T * (kv_lora + rope). Same maths, different rounding.
        q_nope: [B, H, 1, nope]; q_rot: [B, H, 1, rope]; ckv: [B, T, kv_lora + rope] (the
        cache rows: latent, then rope key); bias: [B, 1, T] additive mask (0 or -inf).
        Returns [B, H, 1, v].
        """
        w = self.kv_b_proj.weight
        w_uk = derived(self, "w_uk", lambda: self._kv_b_heads()[:, : self.nope_dim].contiguous(), w)  # [H, nope, kv_lora]
        w_uv = derived(self, "w_uv_t", lambda: self._kv_b_heads()[:, self.nope_dim :].transpose(1, 2).contiguous(),
                       w)  # [H, kv_lora, v]
        # heads play the role of query rows, so every product is a plain bmm (no broadcast copies)
        q_lat = torch.bmm(q_nope.squeeze(2).transpose(0, 1), w_uk).transpose(0, 1)  # [B, H, kv_lora]
        q = torch.cat([q_lat, q_rot.squeeze(2)], dim=-1)  # [B, H, kv_lora + rope], the cache row's layout
        scores = torch.baddbmm(bias, q, ckv.transpose(1, 2), alpha=self.scaling)  # [B, H, T]
        probs = torch.softmax(scores.float(), dim=-1).to(ckv.dtype)
        out_lat = torch.bmm(probs, ckv[..., : self.kv_lora_rank])  # [B, H, kv_lora]
        out = torch.bmm(out_lat.transpose(0, 1), w_uv)  # [H, B, v]
        return out.permute(1, 0, 2).unsqueeze(2)  # [B, H, 1, v]

    def _kv_b_heads(self) -> Tensor:
        """``kv_b_proj``'s weight per head: [H, nope + v, kv_lora] (k_nope rows, then v rows)."""
        return self.kv_b_proj.weight.view(self.n_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
