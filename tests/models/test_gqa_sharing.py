"""Grouped-query attention on the CPU lets the kernel share each key/value head with its
query heads (``scaled_dot_product_attention(..., enable_gqa=True)``) instead of copying the
keys and values once per query head (HF's ``repeat_kv``). The two must give the same model:
the same logits on packed rows, masked rows and cached ragged steps, the same gradients.
(test_architectures.py compares every model with transformers as well.)"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import primerl_blocks.attention as attention

from primerl.models import ModelConfig
from primerl.registry import get_registry
from primerl.tokenizer import VOCAB_SIZE

SDPA = torch.nn.functional.scaled_dot_product_attention


def repeated_kv(q, k, v, *, enable_gqa=False, **kw):
    """The same call with the heads repeated first, as the attention did before."""
    if enable_gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return SDPA(q, k, v, **kw)


@pytest.fixture(params=["llama", "qwen3", "minimax"])
def model(request):
    name = request.param
    m = get_registry().load("model", name)().build(ModelConfig(name=name, preset="tiny", seed=0))
    attn = next(mod for mod in m.modules() if isinstance(mod, attention.GQAttention))
    assert attn.kv_heads < attn.heads, "the tiny preset must group its query heads"
    return m


def ids(*shape, seed=0):
    return torch.randint(0, VOCAB_SIZE, shape, generator=torch.Generator().manual_seed(seed))


def both(fn, monkeypatch):
    """``fn()`` with the kernel's grouping, then with the heads repeated."""
    calls = []
    real = attention.F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append(kw.get("enable_gqa", False))
        return real(*a, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    shared = fn()
    assert calls and all(calls), "the CPU path asks the kernel to share the kv heads"
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", repeated_kv)
    return shared, fn()


def test_packed_and_masked_rows_give_the_same_logits_and_gradients(model, monkeypatch):
    B, S = 2, 40
    x = ids(B, S, seed=1)
    positions = torch.cat([torch.arange(25), torch.arange(15)]).expand(B, S)
    segments = torch.cat([torch.zeros(25), torch.ones(15)]).long().expand(B, S)
    lengths = torch.tensor([S, 33])

    def run():
        model.zero_grad()
        out = model(x, positions, lengths, segment_ids=segments).logits
        out.logsumexp(-1).mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    (a, ga), (b, gb) = both(run, monkeypatch)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert ga.keys() == gb.keys() and len(ga) > 10
    for name in ga:
        scale = max(gb[name].abs().max().item(), 1e-3)
        torch.testing.assert_close(ga[name], gb[name], atol=1e-5 * scale, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    model.zero_grad()


def test_cached_ragged_steps_give_the_same_logits(model, monkeypatch):
    """The engine's calls: a prefill of ragged rows, then a decode step, over the slot cache."""
    model.eval()
    prompts = [ids(1, n, seed=10 + n)[0] for n in (9, 23, 16)]

    def run():
        cache = model.new_cache(num_slots=3, max_len=32)
        S = max(len(p) for p in prompts)
        x = torch.zeros(3, S, dtype=torch.long)
        for b, p in enumerate(prompts):
            x[b, : len(p)] = p
        lens = torch.tensor([len(p) for p in prompts])
        with torch.no_grad():
            first = model(x, torch.arange(S).expand(3, S), lens, cache=cache, slots=range(0, 3),
                          past_lens=torch.zeros(3, dtype=torch.long), logits_for="last").logits
            nxt = first.argmax(-1)[:, None]
            second = model(nxt, lens[:, None], torch.ones(3, dtype=torch.long), cache=cache, slots=range(0, 3),
                           past_lens=lens, logits_for="last").logits
        return torch.cat([first, second])

    a, b = both(run, monkeypatch)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
