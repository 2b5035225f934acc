"""Block-scaled FP8 matmuls, the DeepSeek-V3 recipe (``trainer.fp8``): the trainer's, and the engine's beside it.

What is quantized, all to float8 e4m3 with one float32 scale per block or tile
(``scale = amax / 448``, the value dequantises as ``q * scale``):

* weights in 128 x 128 blocks (``primerl.models.fp8.quantize_blockwise``: the same
  function, blocks and rounding as DeepSeek's FP8 checkpoints and the FP8 inference
  weights of ``fp8_round_trip_``), re-quantized from the float32 master weights at every
  forward; the optimizer keeps updating the float32 masters;
* activations (the linear's input) in 1 x 128 tiles along the contracted dimension: one
  scale per token and 128 channels, for the forward GEMM;
* output gradients in 1 x 128 tiles along the output channels (one scale per token and
  128 channels) for the input-gradient GEMM ``dX = dY W``, which reuses the forward's
  FP8 weight (128 x 128 blocks are the same for ``W`` and ``W^T``);
* for the weight-gradient GEMM ``dW = dY^T X``, which contracts over tokens, both ``dY``
  and ``X`` in 1 x 128 tiles along the tokens (128 x 1 tiles of the ``[tokens, channels]``
  matrices: one scale per channel and 128 tokens), as DeepSeek-V3 does. ``X`` is kept for
  the backward in that FP8 form (1 byte per element), not in float32.

Every GEMM accumulates in float32; the bias (if any) is added in high precision and its
gradient summed from the unquantized ``dY``. Routers (``gate``), norms, embeddings, the
LM head, Mamba's conv and per-head parameters, and everything outside the linears
(attention scores, softmax, SwiGLU, the MoE combine) stay in high precision. Dimensions
that are not multiples of 128 (the tiny presets' 64-wide projections, MLA's 576-row
``kv_a_proj_with_mqa``) quantize their last partial block or tile on its own (as if
zero-padded, which changes no scale).

How: :func:`apply_fp8_matmuls_` swaps the class of every eligible ``nn.Linear`` to
:class:`Fp8Linear` and of every routed-experts module the model's plan declares (an
:class:`~primerl.models.experts.Experts`) to :class:`Fp8Experts` (subclasses; parameter names, shapes and dtypes unchanged, so HF
checkpoints, publishing and optimizer state are untouched, and a dynamic subclass that
wraps the experts, such as an expert-parallel mixin calling ``super().forward``, still
composes with it). Both compute through :class:`Fp8Matmul`, one autograd function.

Where the GEMMs run: on the CPU (and wherever no FP8 kernel applies) they are emulated:
quantize to ``torch.float8_e4m3fn`` with the scales, dequantize to float32, and one
float32 matmul, which is what an FP8 GEMM with float32 accumulation computes up to the
order of the sums (and the rounding of ``q * scale`` to float32). On a CUDA GPU with FP8
tensor cores the plain linears and the per-expert GEMMs call DeepGEMM's ``fp8_gemm_nt``
(Hopper, when installed, forward and input-gradient GEMMs) or
``torch.nn.functional.scaled_mm`` with ``BlockWise1x128`` / ``BlockWise128x128`` scales
(torch 2.13 has it; torch's own tests run these scales on Hopper with CUDA >= 12.9). Each kernel is
checked once against the emulation on its first call; an error or a disagreement logs
one line and the emulation takes over. The experts' dense path (every expert on every
token: small presets, few tokens) is emulated everywhere. None of the GPU code has run on a
GPU yet: its operand layouts are only checked against torch's shape rules (meta tensors).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from primerl.errors import PrimerlError
from primerl.models.contract import CausalLM
from primerl.models.experts import Experts
from primerl.models.fp8 import BLOCK, FP8, FP8_MAX, KEEP, dequantize_blockwise, quantize_blockwise

__all__ = [
    "Fp8Experts",
    "Fp8Linear",
    "Fp8Matmul",
    "apply_fp8_matmuls_",
    "dequantize_tiles",
    "fp8_experts_",
    "fp8_linear",
    "fp8_matmul",
    "quantize_tiles",
]

_TINY = torch.finfo(torch.float32).tiny


# ---------------------------------------------------------------------------------------
# 1 x 128 tiles
# ---------------------------------------------------------------------------------------


def quantize_tiles(x: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], scale float32 [..., ceil(K/block)]): one scale
    per 1 x ``block`` tile of the last dimension (the last tile may be partial).

    The rounding is :func:`primerl.models.fp8.quantize_blockwise`'s (``amax / 448``,
    divide, clamp, round to nearest), on tiles instead of square blocks."""
    *lead, K = x.shape
    C = -(-K // block)
    xf = x.float()
    if C * block != K:
        xf = F.pad(xf, (0, C * block - K))  # zeros change no amax
    tiles = xf.reshape(*lead, C, block)  # [..., C, block]
    scale = (tiles.abs().amax(dim=-1) / FP8_MAX).clamp(min=_TINY)  # [..., C]
    q = (tiles / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.reshape(*lead, C * block)[..., :K].contiguous(), scale


def dequantize_tiles(q: Tensor, scale: Tensor, block: int = BLOCK) -> Tensor:
    """The inverse of :func:`quantize_tiles`, in float32 (exact for values it produced)."""
    K = q.shape[-1]
    if scale.shape[-1] != -(-K // block):
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match {K} columns in 1x{block} tiles")
    return q.float() * scale.repeat_interleave(block, dim=-1)[..., :K]


# ---------------------------------------------------------------------------------------
# FP8 GEMM kernels (CUDA only; the emulation below is the reference they are checked against)
# ---------------------------------------------------------------------------------------

# per (kernel, B's scaling, output dtype): missing = untried, True = checked once against
# the emulation and in use, False = failed or disagreed (logged once): emulated from then on
_KERNEL_OK: dict[tuple[str, bool, torch.dtype], bool] = {}
_LOGGED: set[str] = set()


def _log_once(key: str, msg: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        from primerl.trainer import log

        log(msg)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _pad2(t: Tensor, rows: int, cols: int, value: float = 0.0) -> Tensor:
    """t [r, c] padded at the end to [rows, cols] (a view when nothing is padded)."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return t
    if t.dtype == FP8:  # F.pad has no float8 kernel: pad the bytes
        return F.pad(t.view(torch.uint8), (0, cols - c, 0, rows - r)).view(FP8)
    return F.pad(t, (0, cols - c, 0, rows - r), value=value)


@functools.cache
def _has_deep_gemm() -> bool:
    """Whether DeepGEMM (``deep_gemm``, with its ``fp8_gemm_nt``) is importable; asked once."""
    try:
        import deep_gemm  # optional, GPU only
    except ImportError:
        return False
    return hasattr(deep_gemm, "fp8_gemm_nt")


def _deep_gemm_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor) -> Tensor:
    """A @ B^T with DeepGEMM (Hopper): A [M, K] 1x128 tiles, B [N, K] 128x128 blocks, bf16
    out. K and N are multiples of 128 (the caller pads)."""
    import deep_gemm  # optional, GPU only

    out = torch.empty(a_q.shape[0], b_q.shape[0], dtype=torch.bfloat16, device=a_q.device)
    deep_gemm.fp8_gemm_nt((a_q, a_s.contiguous()), (b_q, b_s.contiguous()), out)
    return out


def _scaled_mm_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, b_blocks: bool, out_dtype: torch.dtype) -> Tensor:
    """A @ B^T with ``torch.nn.functional.scaled_mm`` (cuBLASLt), in the scale layouts torch
    checks (torch/_meta_registrations.py, ``_check_scaled_mm_sizes_v2``): A row-major, B
    column-major; 1x128 scales [rows, K/128] with stride [1, rows]; 128x128 scales of B as
    [round_up(K/128, 4), N/128] with stride [1, round_up(K/128, 4)]. K and N are multiples
    of 128 and M of 16 (the caller pads)."""
    from torch.nn.functional import ScalingType

    sa = a_s.t().contiguous().t()  # [M, K/128], stride [1, M]
    if b_blocks:
        L4 = _round_up(b_s.shape[1], 4)
        sb = _pad2(b_s, b_s.shape[0], L4, 1.0).contiguous().t()  # [L4, N/128], stride [1, L4]
        recipe_b = ScalingType.BlockWise128x128
    else:
        sb = b_s.t().contiguous().t()  # [N, K/128], stride [1, N]
        recipe_b = ScalingType.BlockWise1x128
    return F.scaled_mm(a_q, b_q.t(), sa, ScalingType.BlockWise1x128, sb, recipe_b, output_dtype=out_dtype)


def _padded_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, b_blocks: bool) -> tuple[Tensor, ...]:
    """The operands of :func:`_kernel_nt` zero-padded to what the kernels take: K and N to
    multiples of 128, M to a multiple of 16; data K-major (contiguous), padded scales 1."""
    M, K = a_q.shape
    N = b_q.shape[0]
    Mp, Kp, Np = _round_up(M, 16), _round_up(K, BLOCK), _round_up(N, BLOCK)
    a_q, a_s = _pad2(a_q, Mp, Kp).contiguous(), _pad2(a_s, Mp, Kp // BLOCK, 1.0)  # [Mp, Kp], [Mp, Kp/128]
    b_q = _pad2(b_q, Np, Kp).contiguous()  # [Np, Kp]
    b_s = _pad2(b_s, Np // BLOCK if b_blocks else Np, Kp // BLOCK, 1.0)  # [Np/128 or Np, Kp/128]
    return a_q, a_s, b_q, b_s


def _kernel_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, b_blocks: bool,
               out_dtype: torch.dtype) -> Tensor | None:
    """A @ B^T (float32 accumulation) on FP8 tensor cores, or None where none applies (the
    caller then emulates). A [M, K] float8 in 1x128 tiles, scales [M, ceil(K/128)]; B [N, K]
    float8 in 128x128 blocks (scales [ceil(N/128), ceil(K/128)]) or 1x128 tiles (scales
    [N, ceil(K/128)]). Returns [M, N] in ``out_dtype``."""
    if a_q.device.type != "cuda" or not hasattr(F, "scaled_mm"):
        if a_q.device.type == "cuda":
            _log_once("no-scaled-mm", f"fp8: torch {torch.__version__} has no torch.nn.functional.scaled_mm "
                                      f"(blockwise scales): FP8 GEMMs are emulated in float32")
        return None
    if torch.cuda.get_device_capability(a_q.device) < (8, 9):
        _log_once("no-fp8-cores", "fp8: this GPU has no FP8 tensor cores: FP8 GEMMs are emulated in float32")
        return None
    M, N = a_q.shape[0], b_q.shape[0]
    a_q, a_s, b_q, b_s = _padded_nt(a_q, a_s, b_q, b_s, b_blocks)

    hopper = torch.cuda.get_device_capability(a_q.device)[0] == 9
    deep = b_blocks and out_dtype == torch.bfloat16 and hopper and _has_deep_gemm()
    candidates = ["deep_gemm", "scaled_mm"] if deep else ["scaled_mm"]
    for name in candidates:
        key = (name, b_blocks, out_dtype)
        what = f"{name} (1x128 x {'128x128' if b_blocks else '1x128'} scales, {str(out_dtype).replace('torch.', '')} out)"
        if _KERNEL_OK.get(key) is False:
            continue
        try:
            if name == "deep_gemm":
                out = _deep_gemm_nt(a_q, a_s, b_q, b_s)
            else:
                out = _scaled_mm_nt(a_q, a_s, b_q, b_s, b_blocks, out_dtype)
        except Exception as exc:  # noqa: BLE001 - any kernel failure falls back to the emulation
            _KERNEL_OK[key] = False
            _log_once(f"{key}-failed", f"fp8: {what} failed ({type(exc).__name__}: {exc}); emulating instead")
            continue
        if key not in _KERNEL_OK:  # first call: check against the emulation once
            ref = _emulated_nt(a_q, a_s, b_q, b_s, b_blocks)
            err = float((out.float() - ref).abs().max())
            tol = 1e-2 * float(ref.abs().max()) + 1e-6
            if not err <= tol:
                _KERNEL_OK[key] = False
                _log_once(f"{key}-wrong", f"fp8: {what} disagrees with the emulation (max error {err:.3g}, "
                                          f"tolerance {tol:.3g}); emulating instead")
                continue
            _KERNEL_OK[key] = True
            _log_once(f"{key}-ok", f"fp8: using {what}")
        return out[:M, :N]
    return None


def _emulated_nt(a_q: Tensor, a_s: Tensor, b_q: Tensor, b_s: Tensor, b_blocks: bool) -> Tensor:
    """A @ B^T as :func:`_kernel_nt` defines it, emulated: dequantize, float32 matmul."""
    b = dequantize_blockwise(b_q, b_s) if b_blocks else dequantize_tiles(b_q, b_s)
    return F.linear(dequantize_tiles(a_q, a_s), b)


# ---------------------------------------------------------------------------------------
# The autograd function
# ---------------------------------------------------------------------------------------


def _stack(w: Tensor, groups: str) -> Tensor:
    """[G, N, K] per-group weights as one matrix: "out" [G*N, K] (groups side by side in the
    output), "in" [N, G*K] (groups side by side in the input, outputs summed)."""
    G, N, K = w.shape
    return w.reshape(G * N, K) if groups == "out" else w.transpose(0, 1).reshape(N, G * K)


def _unstack(w2: Tensor, shape: torch.Size, groups: str) -> Tensor:
    """The inverse of :func:`_stack` (a gradient back to the weight's [G, N, K])."""
    G, N, K = shape
    return w2.reshape(G, N, K) if groups == "out" else w2.reshape(N, G, K).transpose(0, 1)


class Fp8Matmul(torch.autograd.Function):
    """``y = x @ W^T (+ b)`` with block-scaled FP8 operands (see the module docstring for
    exactly what is quantized in the forward and in each backward GEMM).

    x: [T, Kx]; w: [N, K] (a linear), or [G, N, K] (G experts' weights, each quantized in
    its own 128 x 128 blocks) with ``groups``: "out": Kx = K and y [T, G*N] (every expert
    on the same input, outputs side by side); "in": Kx = G*K and y [T, N] (each expert on
    its own K-wide slice of x, tiles never straddling two experts, outputs summed).
    bias: [N] or None. ``activations=False`` quantizes only the weights (W8A16: the numbers
    an engine serving FP8 weights with high-precision activations computes).
    Returns y in x's dtype.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor, bias: Tensor | None, groups: str = "out",
                activations: bool = True, grad_enabled: bool = True) -> Tensor:
        w3 = w if w.dim() == 3 else w.unsqueeze(0)  # [G, N, K]
        G, N, K = w3.shape
        T = x.shape[0]
        wq, ws = quantize_blockwise(w3.detach())  # [G, N, K] e4m3, [G, ceil(N/128), ceil(K/128)]
        b = bias.detach().float() if bias is not None else None
        kernel = G == 1 and activations and x.is_cuda
        with torch.autocast(x.device.type, enabled=False):  # the emulation's matmuls stay float32
            y = None
            if activations:
                xg = x.detach().reshape(T, G, K) if groups == "in" and G > 1 else x.detach()  # tiles within an expert
                xq, xs = quantize_tiles(xg)  # [T, (G,) K] e4m3, [T, (G,) ceil(K/128)]
                if kernel:
                    y = _kernel_nt(xq, xs, wq[0], ws[0], True, x.dtype)  # [T, N]
                    if y is not None and b is not None:
                        y = y.float() + b
                x_used = dequantize_tiles(xq, xs).reshape(x.shape) if y is None else None  # [T, Kx]
            else:
                x_used = x.detach().float()
            if y is None:
                y = F.linear(x_used, _stack(dequantize_blockwise(wq, ws), groups), b)  # [T, G*N] or [T, N]
        # the weight-gradient GEMM contracts over tokens: keep X in 1 x 128 tiles along them
        x_saved = x_scale = None
        if ctx.needs_input_grad[1] and grad_enabled:  # (autograd's grad mode is off in here)
            if activations:
                x_saved, x_scale = quantize_tiles(x.detach().t())  # [Kx, T] e4m3, [Kx, ceil(T/128)]
            else:
                x_saved = x.detach()  # [T, Kx]
        ctx.save_for_backward(wq, ws, x_saved, x_scale)
        ctx.meta = (tuple(w.shape), w.dtype, x.dtype, groups, activations, bias is not None, kernel)
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        wq, ws, x_saved, x_scale = ctx.saved_tensors
        w_shape, w_dtype, x_dtype, groups, activations, has_bias, kernel = ctx.meta
        G, N, K = wq.shape
        T = dy.shape[0]
        dx = dw = db = None
        with torch.autocast(dy.device.type, enabled=False):
            if ctx.needs_input_grad[0]:  # dX = dY W: dY in 1 x 128 tiles along the outputs
                if activations:
                    dyg = dy.reshape(T, G, N) if groups == "out" and G > 1 else dy  # tiles within an expert
                    dyq, dys = quantize_tiles(dyg)
                    dx = _kernel_nt(dyq, dys, wq[0].t(), ws[0].t(), True, x_dtype) if kernel else None
                    dy_used = dequantize_tiles(dyq, dys).reshape(dy.shape) if dx is None else None  # [T, Ny]
                else:
                    dy_used = dy.float()
                if dx is None:
                    dx = dy_used @ _stack(dequantize_blockwise(wq, ws), groups)  # [T, Kx]
                dx = dx.to(x_dtype)
            if ctx.needs_input_grad[1]:  # dW = dY^T X: both in 1 x 128 tiles along the tokens
                if activations:
                    dyt_q, dyt_s = quantize_tiles(dy.t())  # [Ny, T] e4m3, [Ny, ceil(T/128)]
                    dw2 = _kernel_nt(dyt_q, dyt_s, x_saved, x_scale, False, torch.float32) if kernel else None
                    if dw2 is None:
                        dw2 = _emulated_nt(dyt_q, dyt_s, x_saved, x_scale, False)  # [Ny, Kx]
                else:
                    dw2 = dy.float().t() @ x_saved.float()  # [Ny, Kx]
                dw = _unstack(dw2, wq.shape, groups).reshape(w_shape).to(w_dtype)
            if has_bias and ctx.needs_input_grad[2]:
                db = dy.float().sum(0)
        return dx, dw, db, None, None, None


def fp8_matmul(x: Tensor, w: Tensor, bias: Tensor | None = None, groups: str = "out", *,
               activations: bool = True) -> Tensor:
    """:class:`Fp8Matmul` (x: [T, Kx]; w: [N, K] or [G, N, K]); nothing is kept for a
    backward under ``torch.no_grad``."""
    return Fp8Matmul.apply(x, w, bias, groups, activations, torch.is_grad_enabled())


def fp8_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, activations: bool = True) -> Tensor:
    """``F.linear`` with block-scaled FP8 operands. x: [..., K]; weight: [N, K]. Returns [..., N]."""
    lead = x.shape[:-1]
    y = fp8_matmul(x.reshape(-1, x.shape[-1]), weight, bias, activations=activations)
    return y.reshape(*lead, weight.shape[0])


# ---------------------------------------------------------------------------------------
# The modules
# ---------------------------------------------------------------------------------------


class Fp8Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul is block-scaled FP8 (:func:`fp8_linear`); its float32
    ``weight`` and ``bias`` are the master copies the optimizer updates. Made by
    :func:`apply_fp8_matmuls_` (class swap), never constructed."""

    fp8_activations: bool = True

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.bias, activations=self.fp8_activations)


class Fp8Experts(Experts):
    """:class:`~primerl.models.experts.Experts` with block-scaled FP8 GEMMs: same parameters,
    same ``forward(x, ids, weights, valid)`` contract and the same choice between the
    per-expert loop and the dense path. Each expert's weights are quantized in their own
    128 x 128 blocks (as ``quantize_blockwise`` does on the 3D tensors, so exactly the FP8
    inference weights), and the activations in 1 x 128 tiles that never straddle two
    experts. Made by :func:`apply_fp8_matmuls_` (class swap), never constructed."""

    fp8_activations: bool = True

    def linear(self, x: Tensor, w: Tensor) -> Tensor:
        """One expert's GEMM in FP8 (the per-expert loop of :meth:`Experts.forward` calls it)."""
        return fp8_linear(x, w, activations=self.fp8_activations)

    def _dense(self, x: Tensor, ids: Tensor, weights: Tensor, valid: Tensor) -> Tensor:
        """:meth:`Experts._dense` in FP8: every expert on every token (one grouped GEMM with
        the experts' outputs side by side), hidden states scaled by the routing weights, then
        one grouped GEMM summing the experts' down projections."""
        w_in = self.in_proj
        E, rows, H = w_in.shape
        N = x.shape[0]
        combine = torch.zeros(N, E, dtype=weights.dtype, device=x.device).scatter(1, ids, weights)
        combine = (combine * valid[:, None]).to(x.dtype)  # [N, E]
        h = fp8_matmul(x, w_in, None, "out", activations=self.fp8_activations)  # [N, E * rows]
        h = self._hidden(h.view(N, E, rows))  # [N, E, I]
        h = (h * combine[:, :, None]).reshape(N, -1)  # [N, E * I]
        return fp8_matmul(h, self.down_proj, None, "in", activations=self.fp8_activations)  # [N, hidden]


_FP8_CLASSES: dict[type, type] = {}


def _fp8_experts_class(cls: type) -> type:
    """Fp8Experts for Experts; for a subclass (an expert-parallel wrapper made by a
    dynamic subclass), a subclass of it and Fp8Experts, so its ``super().forward`` reaches
    the FP8 forward: MRO [cls..., Fp8Experts, Experts]."""
    if cls is Experts:
        return Fp8Experts
    if cls not in _FP8_CLASSES:
        _FP8_CLASSES[cls] = type(f"Fp8{cls.__name__}", (cls, Fp8Experts), {"__module__": cls.__module__})
    return _FP8_CLASSES[cls]


def _eligible_linear(name: str, module: nn.Module, tied: set[int]) -> bool:
    """A plain nn.Linear that FP8 inference quantizes too (``primerl.models.fp8.KEEP``: not
    lm_head, a ``gate`` router, an embedding), and whose weight is not tied to an embedding."""
    return (type(module) is nn.Linear and not f"{name}.weight".endswith(KEEP)
            and name.split(".")[-1] not in ("lm_head", "gate") and id(module.weight) not in tied)


def fp8_experts_(module: nn.Module, *, activations: bool = True) -> None:
    """Make one routed-experts module compute with block-scaled FP8 GEMMs, in place (class
    swap to :class:`Fp8Experts`, or a subclass of it and the module's own class)."""
    if not isinstance(module, Experts):
        raise PrimerlError(f"trainer.fp8: {type(module).__name__} is declared as routed experts but is not a "
                           f"primerl.models.experts.Experts module: its experts cannot compute in FP8")
    if not isinstance(module, Fp8Experts):
        module.__class__ = _fp8_experts_class(type(module))
    module.fp8_activations = activations


def apply_fp8_matmuls_(model: CausalLM, *, activations: bool = True) -> list[str]:
    """Make ``model`` train with block-scaled FP8 GEMMs, in place: every eligible
    ``nn.Linear`` becomes :class:`Fp8Linear` and every routed-experts module its plan
    declares (``parallel_plan().experts``) :class:`Fp8Experts` (class swap: parameter
    names, shapes, dtypes and values unchanged). Routers, norms, embeddings and the LM head
    stay high precision. Idempotent.

    ``activations=False``: weights only (W8A16), the numbers of an engine serving FP8
    weights with high-precision activations (``fp8_round_trip_``).
    Returns the names of the modules computing in FP8. Raises PrimerlError when there is
    none (no linear or experts module to convert).
    """
    experts = set(model.parallel_plan().experts)
    tied = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    done = []
    for name, module in model.named_modules():
        if name in experts:
            fp8_experts_(module, activations=activations)
        elif isinstance(module, Fp8Linear) or _eligible_linear(name, module, tied):
            module.__class__ = Fp8Linear
            module.fp8_activations = activations
        else:
            continue
        done.append(name)
    if not done:
        raise PrimerlError(
            f"trainer.fp8: {type(model).__name__} has nothing to compute in FP8: no nn.Linear other than "
            f"the LM head, routers and embeddings, and no routed experts in its plan. Set "
            f"--trainer.fp8 false, or build the model's linears from nn.Linear / primerl.models.experts.Experts"
        )
    return done
