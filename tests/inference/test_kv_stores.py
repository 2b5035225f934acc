"""The kv_store extension point: the protocol the engine calls, the memory plugin, the
config that selects it, and the block keys of the shared store to come."""

import inspect
import random

import pytest
import torch
from primerl_embedded.engine import Engine, SamplingParams
from primerl_kv_memory.store import MemoryStore, common_prefix

from primerl.kv_blocks import block_keys
from primerl.kv_stores import BlockKVStore, HandoffUnavailable, KVStore, SlotPool
from primerl.models import ModelConfig
from primerl.registry import get_registry


@pytest.fixture(scope="module")
def setup():
    adapter = get_registry().load("model", "glm5")()
    cfg = ModelConfig(name="glm5", preset="tiny", seed=1)
    return adapter.build(cfg), adapter.tokenizer(cfg)


def protocol_methods(proto) -> dict[str, inspect.Signature]:
    return {n: inspect.signature(f) for n, f in vars(proto).items() if callable(f) and not n.startswith("_")}


def test_memory_store_is_the_registered_default_and_implements_the_protocol():
    assert get_registry().load("kv_store", "memory") is MemoryStore
    for name, sig in protocol_methods(KVStore).items():
        assert list(inspect.signature(getattr(MemoryStore, name)).parameters) == list(sig.parameters), name


class Forgetful:
    """The smallest KV store: keeps nothing (every finished slot goes straight back)."""

    current_weights_only = False

    def handoff_blocks(self):
        raise HandoffUnavailable("Forgetful keeps nothing")

    def bind(self, pool: SlotPool) -> None:
        self.pool, self.kept = pool, 0

    def lookup(self, tokens):
        return None

    def load(self, hit, slot, n):
        raise AssertionError("nothing was stored")

    def vacate(self, slot, keep=None):
        pass

    def keep(self, slot, tokens, routed):
        self.kept += 1
        self.pool.release(slot)

    def clear(self):
        pass

    def slots(self):
        return ()


class Recording(MemoryStore):
    """The memory store, with a log of what the engine asked of it."""

    def __init__(self):
        super().__init__()
        self.log = []

    def lookup(self, tokens):
        hit = super().lookup(tokens)
        self.log.append(("lookup", len(tokens), hit.length if hit else 0))
        return hit

    def load(self, hit, slot, n):
        self.log.append(("load", "take-over" if hit.slot == slot else "copy", n))
        return super().load(hit, slot, n)

    def keep(self, slot, tokens, routed):
        self.log.append(("keep", len(tokens), sum(len(c) for c in routed)))
        super().keep(slot, tokens, routed)

    def clear(self):
        self.log.append(("clear",))
        super().clear()


def run_turns(engine: Engine, tok, turns: int = 3) -> list[list[int]]:
    """A multi-turn episode: each turn's prompt is the last prompt + its output + new text."""
    prompt, outs = tok.encode("Reverse: apple"), []
    for t in range(turns):
        (seq,) = engine.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                        return_routed_experts=True))
        outs.append(seq.output_ids)
        assert seq.routed_experts().shape[0] == len(seq.tokens) - 1  # every token ran once, reused or not
        prompt = seq.tokens + tok.encode(f" turn {t}")
    return outs


def test_the_engine_runs_on_any_kv_store_and_asks_the_store_for_prefixes(setup):
    model, tok = setup
    kw = dict(eos_token_ids=[tok.eos_token_id], max_batch_size=4, max_model_len=128, kv_slots=6)
    forgetful, recording = Forgetful(), Recording()
    cold = Engine(model, kv_store=forgetful, **kw)
    warm = Engine(model, kv_store=recording, **kw)
    assert run_turns(cold, tok) == run_turns(warm, tok)  # the store changes no token
    assert cold.stats.prefix_hit_tokens == 0 and forgetful.kept == 3 and cold.free_slots == set(range(6))
    assert warm.stats.prefix_hit_tokens > 0
    loads = [e for e in recording.log if e[0] == "load"]
    lookups = [e for e in recording.log if e[0] == "lookup"]
    keeps = [e for e in recording.log if e[0] == "keep"]
    assert len(lookups) == 3 and len(keeps) == 3 and len(loads) == 2  # turns 2 and 3 reuse turn 1 and 2
    assert all(kind == "take-over" for _, kind, _ in loads)  # one sequence at a time: it lands in the idle slot
    assert all(n_tokens == n_routed for _, n_tokens, n_routed in keeps)  # experts travel with the KV
    assert len(recording.slots()) == 1 and warm.kv_usage() == 0.0
    warm.update_weights(lambda: None)
    assert recording.log[-1] == ("clear",) and not recording.slots() and warm.free_slots == set(range(6))


def test_memory_store_moves_copies_and_evicts_least_recent(setup):
    """Idle prefixes move out of the slot the running batch needs; with no slot free the
    least recently used one is evicted, never the prefix being reused; a prefix idling in
    another slot is copied and stays. Tokens are those of an engine that reuses nothing."""
    model, tok = setup
    store = Recording()
    eng = Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=2, max_model_len=128, kv_slots=3,
                 kv_store=store)
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a, b, c = tok.encode("alpha beta"), tok.encode("gamma delta"), tok.encode("epsilon")
    for p in (a, b, c):  # each runs in slot 0; the one before moves to a free slot
        eng.generate(p, greedy)
    assert sorted(store.slots()) == [0, 1, 2] and not eng.free_slots
    long = eng.submit(tok.encode("zeta"), SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))[0]
    eng.step()  # slot 0 is needed and nothing is free: a (least recent) is evicted, c moves there
    assert long.slot == 0 and store.lookup(a) is None and len(store.slots()) == 2
    reuse = eng.submit(b + tok.encode(" more"), greedy)[0]
    eng.step()  # slot 1 (c's) is needed, b's prefix is the hit: c is evicted, b copied into slot 1
    assert reuse.slot == 1 and store.log[-1][:2] == ("load", "copy") and store.log[-1][2] >= len(b)
    assert store.lookup(c) is None and store.lookup(b).length >= len(b)
    while eng.has_work():
        eng.step()
    fresh = Engine(model, eos_token_ids=[tok.eos_token_id], max_batch_size=2, max_model_len=128, kv_slots=3,
                   kv_store=Forgetful())
    assert reuse.output_ids == fresh.generate(b + tok.encode(" more"), greedy)[0].output_ids
    assert long.output_ids == fresh.generate(tok.encode("zeta"), long.params)[0].output_ids


def test_common_prefix_matches_a_plain_loop():
    rng = random.Random(0)
    for _ in range(500):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        ref = 0
        for x, y in zip(a, b):
            if x != y:
                break
            ref += 1
        assert common_prefix(a, b) == ref == common_prefix(b, a)


def test_block_keys_name_whole_prefixes_within_a_namespace():
    tokens = list(range(100, 140))
    keys = block_keys(tokens, 16, "glm5@v3")
    assert len(keys) == 2  # the trailing 8 tokens make no block
    assert block_keys(tokens[:32] + [7] * 16, 16, "glm5@v3")[:2] == keys  # same prefix, same keys
    changed = block_keys([99] + tokens[1:], 16, "glm5@v3")
    assert changed[0] != keys[0] and changed[1] != keys[1]  # block 1's key covers block 0's tokens
    assert set(block_keys(tokens, 16, "glm5@v4")).isdisjoint(keys)  # new weights: every block misses
    assert block_keys(tokens, 16, "glm5@v3") == keys  # stable (content-addressed, any server)
    with pytest.raises(ValueError):
        block_keys(tokens, 0, "x")
    assert {"put", "get", "contains"} <= set(protocol_methods(BlockKVStore))


def test_backend_builds_the_engine_with_the_configured_store():
    from primerl_embedded.backend import EmbeddedBackend

    from primerl.config import ConfigSources, load_config
    from primerl.errors import PrimerlError
    from primerl.preflight import load_checked

    cfg = load_config(ConfigSources(overrides=[("inference.max_model_len", "64"), ("inference.kv_slots", "64")]))
    assert cfg.inference.kv_store == "memory"
    try:
        engine, _, _ = EmbeddedBackend().build(cfg)
    finally:
        torch.set_grad_enabled(True)  # build() turns autograd off for its (server) process
    assert isinstance(engine.kv_store, MemoryStore) and engine.kv_store.pool is engine.slots
    with pytest.raises(PrimerlError, match="kv_store"):  # the preflight finds the named store
        load_checked(ConfigSources(overrides=[("inference.kv_store", "no-such-store")]))
