"""The Mamba-2 mixer (Nemotron-H's "M" layers) over primerl's ragged batch.

A selective state-space layer: per head h, a state S_h [head_dim, state] evolves as

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t B_t^T,      y_t = S_t C_t + D_h * x_t

with dt, B, C computed from the input (after a causal depthwise conv of width
``conv_kernel``), then gated by silu(z) inside a grouped RMSNorm. Names and shapes are
HF's ``NemotronHMamba2Mixer`` (``in_proj``, ``conv1d``, ``dt_bias``, ``A_log``, ``D``,
``norm``, ``out_proj``).

What RL needs that HF's torch path lacks:

* packed rows: at the first token of a segment the state and the conv window restart
  (``segment_ids``), so packed sequences never see each other;
* ragged continuous batching: each slot keeps its conv window and SSM state in the
  :class:`~primerl.models.batch.SlotCache` ("state" entries); a row whose past length
  is 0 starts from zeros, and the state written back is the one after the row's last
  *valid* token (right padding never leaks into it).

The scan here is the plain recurrence, one step per token (``torch`` ops on [B, H, P, N]
tensors): exact, simple and fast enough for CPU presets. On GPUs the same maths runs in
mamba_ssm's chunked kernels (``seq_idx`` handles packed rows); wiring them in is future
work. ``dt`` is clamped below at ``time_step_min`` in both prefill and decode (HF clamps
only in its chunked path), so that training and inference compute the same function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.models.batch import Batch
from primerl.models.contract import Mixer

__all__ = ["GatedRMSNorm", "Mamba2Mixer", "mamba2_state_layout"]


class GatedRMSNorm(nn.Module):
    """RMSNorm of x * silu(gate) over groups of ``group_size`` channels (float32 inside)."""

    def __init__(self, dim: int, group_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.group_size, self.eps = group_size, eps

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float() * F.silu(gate.float())
        groups = h.view(*h.shape[:-1], -1, self.group_size)
        h = F.rms_norm(groups, (self.group_size,), eps=self.eps).view_as(h)
        return self.weight * h.to(dtype)


def mamba2_state_layout(config: Any) -> dict[str, tuple[tuple[int, ...], torch.dtype | None]]:
    """The per-slot state of one Mamba-2 layer: the conv window and the SSM state (float32)."""
    inner = config.mamba_num_heads * config.mamba_head_dim
    conv_dim = inner + 2 * config.n_groups * config.ssm_state_size
    return {
        "conv": ((conv_dim, config.conv_kernel - 1), None),
        "ssm": ((config.mamba_num_heads, config.mamba_head_dim, config.ssm_state_size), torch.float32),
    }


class Mamba2Mixer(nn.Module):
    """``forward(u [B, S, hidden], batch) -> [B, S, hidden]``: the scan above, per slot state in
    ``batch.cache`` (see the module docstring)."""

    mixer_kind = Mixer.MAMBA2

    def __init__(self, config: Any, layer_idx: int) -> None:
        super().__init__()
        c = config
        self.layer_idx = layer_idx
        self.heads, self.head_dim, self.state_size = c.mamba_num_heads, c.mamba_head_dim, c.ssm_state_size
        self.n_groups, self.kernel = c.n_groups, c.conv_kernel
        self.inner = self.heads * self.head_dim
        self.conv_dim = self.inner + 2 * self.n_groups * self.state_size
        self.dt_min = c.time_step_min
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, c.conv_kernel, groups=self.conv_dim,
                                bias=c.use_conv_bias, padding=c.conv_kernel - 1)
        self.in_proj = nn.Linear(c.hidden_size, self.inner + self.conv_dim + self.heads, bias=c.use_bias)
        self.dt_bias = nn.Parameter(torch.ones(self.heads))
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.norm = GatedRMSNorm(self.inner, self.inner // self.n_groups, c.layer_norm_epsilon)
        self.D = nn.Parameter(torch.ones(self.heads))
        self.out_proj = nn.Linear(self.inner, c.hidden_size, bias=c.use_bias)

    @torch.no_grad()
    def init_weights_(self, normal_) -> None:
        """HF's init: A = 1..heads (A_log = log A), D = 1, dt_bias = 1; normal linears."""
        self.A_log.copy_(torch.log(torch.arange(1, self.heads + 1, dtype=torch.float32)))
        self.D.fill_(1.0)
        self.dt_bias.fill_(1.0)
        self.norm.weight.fill_(1.0)
        normal_(self.conv1d.weight)
        if self.conv1d.bias is not None:
            self.conv1d.bias.zero_()

    # -- conv ------------------------------------------------------------------------

    def _conv(self, xbc: Tensor, batch: Batch) -> Tensor:
        """Causal depthwise conv + silu. xbc: [B, S, C] -> [B, S, C]."""
        B, S, C = xbc.shape
        K = self.kernel
        w = self.conv1d.weight  # [C, 1, K]
        seq = xbc.transpose(1, 2)  # [B, C, S]
        if batch.cache is not None:
            store = batch.cache.state[self.layer_idx]["conv"]
            hist = batch.slot_rows(store).to(seq.dtype)  # [B, C, K-1]
            hist = hist * (batch.past_lens > 0).to(seq.dtype)[:, None, None]  # a new sequence starts at zero
            full = torch.cat([hist, seq], dim=-1)  # [B, C, K-1+S]; token t at index t+K-1
            out = F.conv1d(full, w, self.conv1d.bias, groups=C)  # [B, C, S]
            # the window after each row's last valid token: indices len .. len+K-2
            idx = batch.lengths[:, None] + torch.arange(K - 1, device=seq.device)  # [B, K-1]
            store[batch.slots] = full.gather(2, idx[:, None].expand(B, C, K - 1)).to(store.dtype)
        elif batch.segment_ids is None:
            out = F.conv1d(seq, w, self.conv1d.bias, padding=K - 1, groups=C)[..., :S]
        else:
            # packed rows: tap j reads token t-(K-1)+j only if it is in t's segment
            seg = batch.segment_ids
            out = self.conv1d.bias[None, :, None].expand(B, C, S).clone() if self.conv1d.bias is not None \
                else seq.new_zeros(B, C, S)
            for j in range(K):
                shift = K - 1 - j
                src = F.pad(seq, (shift, 0))[..., :S]  # token t - shift
                same = F.pad(seg, (shift, 0), value=-1)[:, :S] == seg  # [B, S]
                out = out + w[:, 0, j][None, :, None] * src * same[:, None].to(src.dtype)
        return F.silu(out).transpose(1, 2)  # [B, S, C]

    # -- scan ------------------------------------------------------------------------

    def _scan(self, x: Tensor, dt: Tensor, Bm: Tensor, Cm: Tensor, batch: Batch) -> Tensor:
        """x: [B, S, H, P]; dt: [B, S, H]; Bm, Cm: [B, S, G, N]. Returns y [B, S, H, P] (float32)."""
        B, S, H, P = x.shape
        rep = H // self.n_groups
        x, Bm, Cm = x.float(), Bm.float().repeat_interleave(rep, 2), Cm.float().repeat_interleave(rep, 2)
        dt = F.softplus(dt.float() + self.dt_bias.float()).clamp(min=self.dt_min)  # [B, S, H]
        A = -torch.exp(self.A_log.float())  # [H]
        decay = torch.exp(dt * A)  # [B, S, H]
        valid = batch.valid  # [B, S]
        if batch.segment_ids is not None:  # the first token of a segment forgets the state
            seg = batch.segment_ids
            starts = torch.ones_like(valid)
            starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
            decay = decay * (~starts)[..., None]
        if batch.cache is not None:
            store = batch.cache.state[self.layer_idx]["ssm"]
            h = batch.slot_rows(store).float() * (batch.past_lens > 0).float()[:, None, None, None]
        else:
            h = x.new_zeros(B, H, P, self.state_size)
        dtx = dt[..., None] * x  # [B, S, H, P]
        ys = []
        for t in range(S):
            new = h * decay[:, t, :, None, None] + dtx[:, t, :, :, None] * Bm[:, t, :, None, :]  # [B, H, P, N]
            h = torch.where(valid[:, t, None, None, None], new, h)  # padding keeps the state
            ys.append(torch.einsum("bhpn,bhn->bhp", h, Cm[:, t]))
        if batch.cache is not None:
            store[batch.slots] = h.to(store.dtype)
        y = torch.stack(ys, dim=1)  # [B, S, H, P]
        return y + x * self.D.float()[:, None]

    def forward(self, u: Tensor, batch: Batch) -> Tensor:
        """u: [B, S, hidden] -> [B, S, hidden]."""
        B, S, _ = u.shape
        if batch.prefix_ids is not None:
            raise ValueError("a Mamba layer cannot run prompt trees (prefix_ids): its state would have to "
                             "branch where the samples leave the shared prompt; pack without share_prompts")
        u = u * batch.valid[..., None].to(u.dtype)  # padding enters as zeros (HF's padding mask)
        z, xbc, dt = self.in_proj(u).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = self._conv(xbc, batch) * batch.valid[..., None].to(u.dtype)
        gn = self.n_groups * self.state_size
        x, Bm, Cm = xbc.split([self.inner, gn, gn], dim=-1)
        y = self._scan(
            x.view(B, S, self.heads, self.head_dim), dt,
            Bm.view(B, S, self.n_groups, self.state_size), Cm.view(B, S, self.n_groups, self.state_size), batch,
        )
        y = self.norm(y.reshape(B, S, self.inner), z)  # [B, S, inner] in float32 inside
        return self.out_proj(y.to(u.dtype))
