"""The block level of the KV stores, with no plugin: the cache's read/write, the block codec,
and the slot-level adapter over a block store (BlockSlotStore, TieredKVStore) on a real engine."""

import pytest
import torch
from conftest import greedy
from primerl_embedded.engine import Engine, model_identity
from primerl_kv_memory.store import MemoryStore

from primerl.kv_blocks import BlockSlotStore, TieredKVStore, block_keys, decode_block, encode_block
from primerl.kv_stores import KVBlock, KVStore
from primerl.models import ModelConfig
from primerl.models.batch import SlotCache
from primerl.registry import get_registry


class DictBlocks:
    """The smallest block store: encoded blocks in a dict (what a file or a Mooncake object holds)."""

    def __init__(self, block_size: int) -> None:
        self.block_size, self.data = block_size, {}

    def contains(self, keys):
        n = 0
        while n < len(keys) and keys[n] in self.data:
            n += 1
        return n

    def get(self, keys):
        return [decode_block(self.data[k]) if k in self.data else None for k in keys]

    def put(self, blocks):
        for b in blocks:
            self.data.setdefault(b.key, encode_block(b))


def test_cache_read_and_write_round_trip_a_span_of_positions():
    layout = [{"per_token": {"k": (2, 3), "v": (2, 3)}}, {"per_token": {"ckv": (5,)}}]
    cache = SlotCache(layout, 3, 16, dtype=torch.float32, device="cpu")
    for t in cache.tensors():
        t.normal_()
    assert cache.names() == ["0.k", "0.v", "1.ckv"]
    span = {k: v.clone() for k, v in cache.read(0, 4, 6).items()}
    assert span["0.k"].shape == (6, 2, 3) and span["1.ckv"].shape == (6, 5)
    cache.write(2, 10, span)
    assert all(torch.equal(cache.read(2, 10, 6)[k], span[k]) for k in span)
    with pytest.raises(ValueError, match="outside the cache"):
        cache.read(0, 12, 6)
    with pytest.raises(ValueError, match="do not match"):
        cache.write(0, 0, {"0.k": span["0.k"]})
    with pytest.raises(ValueError, match=r"1\.ckv"):
        cache.write(0, 0, {**span, "1.ckv": span["1.ckv"].double()})
    mamba = SlotCache([{"state": {"ssm": ((4,), None)}}], 2, 8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="recurrent state"):
        mamba.read(0, 0, 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_block_round_trips_through_bytes(dtype):
    kv = {"0.ckv": torch.randn(4, 7).to(dtype), "0.index_k": torch.randn(4, 3).to(dtype), "1.k": torch.randn(4, 2, 5).to(dtype)}
    routed = torch.randint(0, 255, (4, 3, 2), dtype=torch.uint8)
    for r in (routed, None):
        back = decode_block(encode_block(KVBlock("abc", (1, 2, 3, 4), kv, r, 7)))
        assert (back.key, back.tokens, back.policy_version) == ("abc", (1, 2, 3, 4), 7)
        assert all(torch.equal(back.kv[k], kv[k]) and back.kv[k].dtype == dtype for k in kv)
        assert (back.routed_experts is None) if r is None else torch.equal(back.routed_experts, r)
    with pytest.raises(ValueError, match="not a primerl KV block"):
        decode_block(b"something else entirely")
    with pytest.raises(ValueError, match="truncated"):
        decode_block(encode_block(KVBlock("abc", (1, 2, 3, 4), kv, routed, 7))[:-40])


def test_model_identity_names_the_weights_not_the_object(glm5):
    model, _ = glm5
    adapter = get_registry().load("model", "glm5")()
    same = adapter.build(ModelConfig(name="glm5", preset="tiny", seed=1))
    other = adapter.build(ModelConfig(name="glm5", preset="tiny", seed=2))
    assert model_identity(model) == model_identity(same) != model_identity(other)
    assert model_identity(model).startswith("Glm5ForCausalLM-")


def test_block_store_serves_a_prefix_into_another_engine_with_its_routed_experts(glm5):
    """Engine A keeps nothing in its slots (BlockSlotStore): its finished KV is cut into
    blocks; engine B, same weights, restores the prompt's blocks and generates exactly what
    a cold engine generates, reporting the same routed experts for every token."""
    model, tok = glm5
    blocks = DictBlocks(16)
    kw = dict(eos_token_ids=[tok.eos_token_id], max_batch_size=2, max_model_len=256, kv_slots=4, num_experts=8)
    a, b = BlockSlotStore(blocks), BlockSlotStore(blocks)
    ea, eb = Engine(model, kv_store=a, **kw), Engine(model, kv_store=b, **kw)
    prompt = tok.encode("Reverse: the quick brown fox jumps over the lazy dog " * 3)
    (cold,) = ea.generate(prompt, greedy())
    assert ea.free_slots == set(range(4)) and not a.slots()  # nothing held in slots
    stored = (len(cold.tokens) - 1) // 16
    assert a.stats.saved_blocks == stored == len(blocks.data)
    (warm,) = eb.generate(prompt, greedy())
    assert b.stats.restored_tokens == eb.stats.prefix_hit_tokens == (len(prompt) // 16) * 16 > 0
    assert warm.output_ids == cold.output_ids
    assert torch.equal(warm.routed_experts(), cold.routed_experts())  # router replay: every token's experts
    assert warm.routed_experts().shape[0] == len(warm.tokens) - 1
    # keys carry the model and the policy version: new weights, every block misses
    eb.update_weights(lambda: None)
    assert b.lookup(prompt) is None and len(blocks.data) == stored
    # a hash that matches with other tokens (a collision) is a miss, not wrong KV
    key0 = block_keys(prompt, 16, f"/{ea.slots.namespace}")[0]
    forged = decode_block(blocks.data[key0])
    blocks.data[key0] = encode_block(KVBlock(key0, (0,) * 16, forged.kv, forged.routed_experts, 0))
    assert a.lookup(prompt) is None


def test_tiered_store_prefers_idle_slots_and_restores_longer_prefixes_from_blocks(glm5):
    model, tok = glm5
    blocks = DictBlocks(16)
    store = TieredKVStore(MemoryStore(), blocks, write_through=True)
    eng = Engine(model, kv_store=store, eos_token_ids=[tok.eos_token_id], max_batch_size=1, max_model_len=256,
                 kv_slots=2, num_experts=8)
    prompt = tok.encode("Reverse: pack my box with five dozen liquor jugs " * 2)
    (first,) = eng.generate(prompt, greedy())
    assert len(store.slots()) == 1 and store.stats.saved_blocks == (len(first.tokens) - 1) // 16
    (again,) = eng.generate(prompt, greedy())  # the idle slot covers the prompt: no block is read
    assert store.stats.restored_blocks == 0 and again.output_ids == first.output_ids
    store.idle.clear()  # as if the idle prefix had been evicted: the blocks serve it
    (third,) = eng.generate(prompt, greedy())
    assert store.stats.restored_tokens == (len(prompt) // 16) * 16
    assert third.output_ids == first.output_ids and torch.equal(third.routed_experts(), first.routed_experts())
    TieredKVStore(MemoryStore(), blocks, write_through=False)  # the memory store reports its evictions
    with pytest.raises(TypeError, match="on_evict"):
        TieredKVStore(BlockSlotStore(blocks), blocks, write_through=False)  # write-back needs eviction reports


def test_a_sequence_that_ran_across_a_weight_update_reaches_only_stores_that_accept_it(glm5):
    """Its KV mixes two policies: the memory store keeps it as before; a store that
    publishes blocks under the new version (current_weights_only) never sees it."""
    model, tok = glm5
    prompt = tok.encode("Reverse: sphinx of black quartz")
    for store, kept in ((MemoryStore(), 1), (TieredKVStore(MemoryStore(), DictBlocks(4), write_through=True), 0)):
        eng = Engine(model, kv_store=store, eos_token_ids=[tok.eos_token_id], max_batch_size=1, max_model_len=128,
                     kv_slots=2)
        (seq,) = eng.submit(prompt, greedy(12))
        eng.step()
        eng.update_weights(lambda: None)  # not threaded: applied now, between two steps
        while eng.has_work():
            eng.step()
        assert seq.versions[0] == 0 and seq.versions[-1] == 1
        assert len(store.slots()) == kept
        if kept == 0:
            assert not store.blocks.blocks.data and eng.free_slots == {0, 1}
        (after,) = eng.generate(prompt, greedy(2))  # admitted under v1: kept by both
        assert len(store.slots()) == 1 and after.versions == [1, 1]


def test_the_adapters_implement_the_kv_store_protocol():
    import inspect

    for cls in (BlockSlotStore, TieredKVStore):
        for name, f in vars(KVStore).items():
            if callable(f) and not name.startswith("_"):
                want = list(inspect.signature(f).parameters)
                assert list(inspect.signature(getattr(cls, name)).parameters)[: len(want)] == want, (cls, name)
