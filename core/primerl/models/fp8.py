"""Block-scaled FP8 weights in DeepSeek's checkpoint format (Kimi K2, GLM-5-FP8, DeepSeek-V3).

A linear weight W [out, in] is stored as ``weight`` (float8_e4m3fn) plus
``weight_scale_inv`` (float32 [ceil(out/128), ceil(in/128)]): each 128 x 128 block is
scaled so its largest magnitude maps to e4m3's 448, and dequantised as
``W = weight * weight_scale_inv`` blockwise. This is the layout DeepGEMM's FP8 GEMMs
consume on Hopper.

Here on the CPU it serves two purposes: loading published FP8 checkpoints (dequantised to
the model dtype as they are read) and emulating FP8-weight inference
(:func:`fp8_round_trip_`: every quantisable weight replaced by its FP8 rounding), which is
how ``bench/router_replay.py`` reproduces the mismatch of an FP8 inference deployment.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["BLOCK", "FP8", "FP8_MAX", "KEEP", "dequantize_blockwise", "fp8_round_trip_", "quantize_blockwise"]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128


def _blocks(n: int, block: int) -> int:
    return (n + block - 1) // block


def quantize_blockwise(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """W [..., out, in] -> (float8_e4m3fn [..., out, in], scale_inv float32 [..., ceil(out/b), ceil(in/b)])."""
    *lead, rows, cols = w.shape
    R, C = _blocks(rows, block), _blocks(cols, block)
    padded = torch.zeros(*lead, R * block, C * block, dtype=torch.float32, device=w.device)
    padded[..., :rows, :cols] = w.float()
    tiles = padded.view(*lead, R, block, C, block)
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., R, C]
    scale_inv = (amax / FP8_MAX).clamp(min=torch.finfo(torch.float32).tiny)
    q = (tiles / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(*lead, R * block, C * block)[..., :rows, :cols].contiguous(), scale_inv


def dequantize_blockwise(q: Tensor, scale_inv: Tensor, dtype: torch.dtype = torch.float32,
                         block: int = BLOCK) -> Tensor:
    """The inverse of :func:`quantize_blockwise` (exact for values it produced)."""
    *lead, rows, cols = q.shape
    R, C = scale_inv.shape[-2:]
    if (R, C) != (_blocks(rows, block), _blocks(cols, block)):
        raise ValueError(
            f"weight_scale_inv shape {tuple(scale_inv.shape)} does not match a {rows}x{cols} weight "
            f"in {block}x{block} blocks (expected [{_blocks(rows, block)}, {_blocks(cols, block)}])"
        )
    scale = scale_inv.float().repeat_interleave(block, -2)[..., :rows, :].repeat_interleave(block, -1)[..., :cols]
    return (q.float() * scale).to(dtype)


# Never quantised (as in DeepSeek's and Kimi's FP8 releases): embeddings, lm_head, norms,
# routers, biases and Mamba's per-head parameters.
KEEP = ("embed_tokens.weight", "embeddings.weight", "lm_head.weight", "gate.weight", "norm.weight",
        "layernorm.weight", "norm_f.weight", "conv1d.weight")


@torch.no_grad()
def fp8_round_trip_(model: nn.Module, block: int = BLOCK) -> list[str]:
    """Replace every quantisable weight (2D linears, 3D experts) by its block-FP8 rounding,
    in place, in the model's dtype. Returns the names of the weights rounded."""
    done = []
    for name, p in model.named_parameters():
        if p.dim() < 2 or name.endswith(KEEP) or not p.is_floating_point():
            continue
        q, s = quantize_blockwise(p.data, block)
        p.data.copy_(dequantize_blockwise(q, s, p.dtype, block))
        done.append(name)
    return done
