"""Block-scaled FP8 training (primerl.models.fp8_matmul): the autograd function against a plain
quantize-dequantize-matmul reference (exact) and against float32 (within FP8 error); the
model conversion (names, what stays high precision, experts, an expert-parallel style
mixin); the weights agree with the FP8 inference weights; a few optimizer steps learn.

All on the CPU, where the FP8 GEMMs are emulated; the CUDA kernels' scale layouts are
checked against torch's own shape rules on meta tensors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from primerl_blocks.layers import RMSNorm
from primerl_blocks.moe import SigmoidRouter, SoftmaxRouter
from torch import nn

from primerl.errors import PrimerlError
from primerl.models import ModelConfig
from primerl.models.contract import ParallelPlan
from primerl.models.experts import Experts
from primerl.models.fp8 import FP8, dequantize_blockwise, fp8_round_trip_, quantize_blockwise
from primerl.models.fp8_matmul import (
    Fp8Experts,
    Fp8Linear,
    _padded_nt,
    _scaled_mm_nt,
    apply_fp8_matmuls_,
    dequantize_tiles,
    fp8_experts_,
    fp8_linear,
    fp8_matmul,
    quantize_tiles,
)
from primerl.registry import get_registry

FP8_REL = 0.06  # relative error of a GEMM with both operands in e4m3 (3 mantissa bits): ~3-4%


def ref_tiles(x: torch.Tensor) -> torch.Tensor:
    """x [R, K] through 1 x 128 e4m3 tiles and back, one tile at a time (float32)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for r in range(x.shape[0]):
        for c in range(0, x.shape[1], 128):
            tile = x[r, c : c + 128].float()
            scale = (tile.abs().max() / 448.0).clamp(min=torch.finfo(torch.float32).tiny)
            out[r, c : c + 128] = (tile / scale).clamp(-448, 448).to(FP8).float() * scale
    return out


def ref_blocks(w: torch.Tensor) -> torch.Tensor:
    """w through the FP8 inference weights' 128 x 128 blocks and back."""
    return dequantize_blockwise(*quantize_blockwise(w))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


def build(name: str, seed: int = 0) -> nn.Module:
    adapter = get_registry().load("model", name)()
    return adapter.build(ModelConfig(name=name, preset="tiny", seed=seed))


# ---------------------------------------------------------------------------------------
# quantization and the autograd function
# ---------------------------------------------------------------------------------------


def test_tiles_round_trip_and_scales():
    x = torch.randn(5, 300) * torch.logspace(-6, 3, 5)[:, None]  # rows across 9 orders of magnitude
    q, s = quantize_tiles(x)
    assert q.dtype == FP8 and q.shape == x.shape and s.shape == (5, 3)  # 300 = 128 + 128 + 44
    torch.testing.assert_close(s[:, 2], x[:, 256:].abs().amax(-1) / 448.0)  # the partial tile on its own
    y = dequantize_tiles(q, s)
    assert torch.equal(y, ref_tiles(x))
    assert rel(y, x) < 0.04 and all(rel(y[r], x[r]) < 0.04 for r in range(5))  # every row keeps its precision
    assert torch.equal(dequantize_tiles(*quantize_tiles(torch.zeros(2, 130))), torch.zeros(2, 130))


@pytest.mark.parametrize("T,K,N", [(37, 200, 150), (256, 256, 128), (3, 64, 48)])
def test_linear_exact_against_quantize_dequantize_reference(T, K, N):
    """Forward, input gradient and weight gradient equal the straightforward reference bit
    for bit; the bias gradient is the unquantized sum."""
    torch.manual_seed(0)
    x = torch.randn(T, K, requires_grad=True)
    w = (torch.randn(N, K) * 0.05).requires_grad_()
    b = torch.randn(N, requires_grad=True)
    dy = torch.randn(T, N)
    y = fp8_linear(x, w, b)
    y.backward(dy)

    x_dq, w_dq = ref_tiles(x.detach()), ref_blocks(w.detach())
    assert torch.equal(y, F.linear(x_dq, w_dq, b.detach()))
    assert torch.equal(x.grad, ref_tiles(dy) @ w_dq)  # dY in 1 x 128 tiles along the outputs
    # dW = dY^T X, both in 1 x 128 tiles along the tokens
    assert torch.equal(w.grad, F.linear(ref_tiles(dy.t()), ref_tiles(x.detach().t())))
    assert torch.equal(b.grad, dy.sum(0))


def test_linear_close_to_float32():
    torch.manual_seed(1)
    x = torch.randn(4, 33, 384, requires_grad=True)
    w = (torch.randn(640, 384) * 0.02).requires_grad_()
    dy = torch.randn(4, 33, 640)
    fp8_linear(x, w).backward(dy)
    gx, gw = x.grad, w.grad
    x32, w32 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y32 = F.linear(x32, w32)
    y32.backward(dy)
    assert rel(fp8_linear(x.detach(), w.detach()), y32.detach()) < FP8_REL
    assert rel(gx, x32.grad) < FP8_REL and rel(gw, w32.grad) < FP8_REL
    assert gw.dtype == torch.float32 and gx.shape == x.shape


def test_no_grad_forward_equals_grad_forward():
    x, w = torch.randn(9, 130), torch.randn(70, 130, requires_grad=True)
    with torch.no_grad():
        y0 = fp8_linear(x, w)
    assert torch.equal(y0, fp8_linear(x, w).detach())


def test_no_tokens():
    """An expert or a rank's share with no tokens: empty outputs, zero weight gradient."""
    w = torch.randn(70, 130, requires_grad=True)
    x = torch.randn(0, 130, requires_grad=True)
    y = fp8_linear(x, w)
    y.sum().backward()
    assert y.shape == (0, 70) and x.grad.shape == (0, 130) and not w.grad.any()


def test_grouped_weights_equal_one_linear_per_group():
    """[G, N, K] weights: "out" puts the groups' outputs side by side, "in" sums the groups
    over their own K-wide input slices; each group is quantized in its own blocks and tiles."""
    torch.manual_seed(2)
    G, N, K, T = 3, 64, 96, 11
    w = (torch.randn(G, N, K) * 0.1).requires_grad_()
    x = torch.randn(T, K, requires_grad=True)
    y = fp8_matmul(x, w, groups="out")  # [T, G*N]
    y.backward(torch.ones_like(y))
    ref_w = w.detach().clone().requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    ref = torch.cat([fp8_linear(ref_x, ref_w[g]) for g in range(G)], dim=-1)
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.grad, ref_w.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=1e-5, atol=1e-5)

    h = torch.randn(T, G * K, requires_grad=True)
    wd = (torch.randn(G, N, K) * 0.1).requires_grad_()
    y = fp8_matmul(h, wd, groups="in")  # [T, N]
    y.backward(torch.ones_like(y))
    ref_h = h.detach().clone().requires_grad_()
    ref_wd = wd.detach().clone().requires_grad_()
    ref = sum(fp8_linear(ref_h[:, g * K : (g + 1) * K], ref_wd[g]) for g in range(G))
    ref.backward(torch.ones_like(ref))
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(wd.grad, ref_wd.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h.grad, ref_h.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("T,K,N", [(37, 200, 150), (256, 512, 384), (5, 7168, 576)])
def test_gpu_kernel_operands_pass_torch_scaled_mm_shape_rules(T, K, N):
    """The forward, input-gradient and weight-gradient GEMMs' operands, padded and laid out
    as the CUDA path hands them to torch.nn.functional.scaled_mm, pass torch's own checks
    for BlockWise1x128 x BlockWise128x128 and 1x128 x 1x128 (meta tensors: no GPU here)."""
    if not hasattr(F, "scaled_mm"):
        pytest.skip("torch without torch.nn.functional.scaled_mm")

    def fp8(*shape):
        return torch.empty(*shape, dtype=FP8, device="meta")

    def f32(*shape):
        return torch.empty(*shape, device="meta")

    kb, nb, tb = -(-K // 128), -(-N // 128), -(-T // 128)
    w, ws = fp8(N, K), f32(nb, kb)
    out = _scaled_mm_nt(*_padded_nt(fp8(T, K), f32(T, kb), w, ws, True), True, torch.bfloat16)
    assert out.shape[0] >= T and out.shape[1] >= N
    out = _scaled_mm_nt(*_padded_nt(fp8(T, N), f32(T, nb), w.t(), ws.t(), True), True, torch.bfloat16)
    assert out.shape[0] >= T and out.shape[1] >= K
    out = _scaled_mm_nt(*_padded_nt(fp8(N, T), f32(N, tb), fp8(K, T), f32(K, tb), False), False, torch.float32)
    assert out.shape[0] >= N and out.shape[1] >= K


# ---------------------------------------------------------------------------------------
# the model conversion
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["glm5", "qwen3-moe", "nemotron", "qwen3", "minimax", "llama"])
def test_conversion_keeps_names_and_leaves_high_precision_modules_alone(name):
    model = build(name)
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    kinds = {n: type(m) for n, m in model.named_modules()}
    done = apply_fp8_matmuls_(model)

    after = model.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[n], t) and after[n].dtype == t.dtype for n, t in before.items())
    modules = dict(model.named_modules())
    for n, m in modules.items():
        if isinstance(m, (SigmoidRouter, SoftmaxRouter, RMSNorm, nn.LayerNorm, nn.Embedding)) or n == "lm_head":
            assert type(m) is kinds[n], n  # untouched
        elif kinds[n] is nn.Linear:
            assert type(m) is Fp8Linear and n in done, n
        elif kinds[n] is Experts:
            assert type(m) is Fp8Experts and n in done, n
    assert "lm_head" not in done
    assert any(isinstance(modules[n], Fp8Experts) for n in done) == bool(model.moe_layers)  # a dense model has none
    # exactly the weights FP8 inference rounds (primerl.models.fp8.fp8_round_trip_)
    converted = {f"{n}.{p}" for n in done for p, _ in modules[n].named_parameters(recurse=False) if _.dim() >= 2}
    assert converted == set(fp8_round_trip_(copy.deepcopy(build(name))))
    assert apply_fp8_matmuls_(model) == done  # idempotent


class _HeadOnly(nn.Module):
    """Embeddings, a norm and a head: nothing FP8 computes (the head stays high precision)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens, self.norm, self.lm_head = nn.Embedding(10, 8), RMSNorm(8), nn.Linear(8, 10)

    def parallel_plan(self) -> ParallelPlan:
        return ParallelPlan(layers=(), embeddings="embed_tokens", head="lm_head")


def test_nothing_to_convert_is_an_error():
    with pytest.raises(PrimerlError, match="nothing to compute in FP8"):
        apply_fp8_matmuls_(_HeadOnly())


def test_declared_experts_that_are_no_experts_module_are_refused():
    with pytest.raises(PrimerlError, match="declared as routed experts but is not"):
        fp8_experts_(nn.Linear(8, 8))


def make_experts(gated: bool, E=4, H=96, I=64, seed=0) -> Experts:  # noqa: E741
    torch.manual_seed(seed)
    ex = Experts(E, H, I, act="silu" if gated else "relu2", gated=gated)
    with torch.no_grad():
        ex.in_proj.normal_(0, 0.1)
        ex.down_proj.normal_(0, 0.1)
    return ex


def routing(N=24, E=4, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])  # [N, k]
    weights = torch.rand(N, k, generator=g)
    valid = torch.ones(N, dtype=torch.bool)
    valid[-3:] = False  # padding skips the experts
    x = torch.randn(N, 96, generator=g)
    return x, ids, weights, valid


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("dense", [True, False], ids=["dense", "per-expert"])
def test_fp8_experts_equal_experts_with_dequantized_weights(gated, dense, monkeypatch):
    """Weight-only (activations=False): exactly Experts holding the FP8-rounded weights.
    Full FP8: the per-expert loop equals a quantize-dequantize reference exactly; both paths
    stay within FP8 error of float32, gradients included."""
    from primerl.models import experts as experts_module

    monkeypatch.setattr(experts_module, "DENSE_EXPERTS_MAX_RATIO", 8 if dense else 0)
    x, ids, weights, valid = routing()
    ref = make_experts(gated)
    rounded = copy.deepcopy(ref)
    fp8_round_trip_(rounded)
    wonly = copy.deepcopy(ref)
    fp8_experts_(wonly, activations=False)
    assert torch.equal(wonly(x, ids, weights, valid), rounded(x, ids, weights, valid))

    fp8 = copy.deepcopy(ref)
    fp8_experts_(fp8)
    out = fp8(x, ids, weights, valid)
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))
    assert rel(out, ref(x, ids, weights, valid)) < 2 * FP8_REL
    if not dense:  # the loop, by hand: x and h in 1 x 128 tiles, each expert's weights in its blocks
        expected = torch.zeros_like(x)
        w_in, w_down = ref_blocks(ref.in_proj.detach()), ref_blocks(ref.down_proj.detach())
        for n in range(x.shape[0]):
            for s in range(ids.shape[1]):
                if valid[n]:
                    e = int(ids[n, s])
                    h = ref._hidden(F.linear(ref_tiles(x[n : n + 1]), w_in[e]))
                    expected[n] += (F.linear(ref_tiles(h), w_down[e]) * weights[n, s])[0]
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)

    out.square().sum().backward()
    ref(x, ids, weights, valid).square().sum().backward()
    assert rel(fp8.in_proj.grad, ref.in_proj.grad) < 3 * FP8_REL
    assert rel(fp8.down_proj.grad, ref.down_proj.grad) < 3 * FP8_REL


def test_dense_and_per_expert_paths_agree(monkeypatch):
    from primerl.models import experts as experts_module

    x, ids, weights, valid = routing()
    ex = make_experts(True)
    fp8_experts_(ex)
    monkeypatch.setattr(experts_module, "DENSE_EXPERTS_MAX_RATIO", 8)
    dense = ex(x, ids, weights, valid)
    monkeypatch.setattr(experts_module, "DENSE_EXPERTS_MAX_RATIO", 0)
    loop = ex(x, ids, weights, valid)
    # the dense path quantizes w * h where the loop quantizes h (then scales): rounding only
    assert rel(dense, loop) < 0.02


class CountingMixin:
    """Stands for an expert-parallel wrapper: a mixin whose forward calls super().forward."""

    calls = 0

    def forward(self, x, ids, weights, valid):
        self.calls += 1
        return super().forward(x, ids, weights, valid)


@pytest.mark.parametrize("wrapped_first", [True, False])
def test_composes_with_a_subclass_mixin_on_the_experts(wrapped_first):
    x, ids, weights, valid = routing()
    plain = make_experts(True)
    fp8_experts_(plain)
    ex = make_experts(True)
    if wrapped_first:
        ex.__class__ = type("EPExperts", (CountingMixin, Experts), {})
        fp8_experts_(ex)
    else:
        fp8_experts_(ex)
        ex.__class__ = type("EPExperts", (CountingMixin, type(ex)), {})
    assert isinstance(ex, Fp8Experts) and isinstance(ex, CountingMixin)
    assert torch.equal(ex(x, ids, weights, valid), plain(x, ids, weights, valid)) and ex.calls == 1
    assert [n for n, _ in ex.named_parameters()] == ["gate_up_proj", "down_proj"]


# ---------------------------------------------------------------------------------------
# against FP8 inference weights, and training
# ---------------------------------------------------------------------------------------


def fp8_exact_input(shape, seed=0) -> torch.Tensor:
    """Activations whose 1 x 128 tiles are already e4m3 values times a power of two, each
    tile holding a +-448 * 2^k element: FP8 tiling returns them unchanged."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 100).clamp(-440, 440).to(FP8).float()
    x[..., ::128] = 448.0
    return x * 2.0**-10


@pytest.mark.parametrize("name", ["glm5", "qwen3-moe", "nemotron", "qwen3", "minimax", "llama"])
def test_trainer_fp8_weights_are_the_fp8_inference_weights(name):
    """The trainer's FP8 forward uses exactly the weights FP8 inference serves
    (``fp8_round_trip_``, what bench/router_replay.py's engine runs): weight-only, whole-model
    logits are equal; with activations quantized too, every FP8 linear on activations that
    tiling leaves unchanged equals the engine's linear holding the rounded weights."""
    model = build(name)
    engine = copy.deepcopy(model)
    fp8_round_trip_(engine)
    trainer = copy.deepcopy(model)
    apply_fp8_matmuls_(trainer, activations=False)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    args = (ids, torch.arange(40).expand(2, 40), torch.tensor([40, 29]))
    # grad mode on: under no_grad MLA stacks q_a/kv_a weights itself (one matmul) and
    # bypasses the modules, which the trainer never does
    assert torch.equal(trainer(*args).logits, engine(*args).logits)

    apply_fp8_matmuls_(trainer)  # activations too
    served = dict(engine.named_modules())
    for n, m in trainer.named_modules():
        if isinstance(m, Fp8Linear):
            x = fp8_exact_input((3, m.in_features), seed=len(n))
            assert torch.equal(m(x), served[n](x)), n


def test_a_few_fp8_steps_reduce_the_loss():
    torch.manual_seed(0)
    model = build("qwen3-moe")
    apply_fp8_matmuls_(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(3))
    args = (ids, torch.arange(32).expand(4, 32), torch.full((4,), 32))
    master = model.model.layers[0].self_attn.q_proj.weight
    first = master.detach().clone()
    losses = []
    for _ in range(8):
        logits = model(*args).logits[:, :-1]
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        assert master.grad.dtype == torch.float32
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.5, losses
    assert master.dtype == torch.float32 and not torch.equal(master, first)  # fp32 masters, updated
