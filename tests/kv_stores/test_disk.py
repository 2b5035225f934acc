"""The ``disk`` KV store on a real engine: idle prefixes in free slots, evicted ones written
to files as blocks and restored on a prefix hit, exactly (same tokens, same routed experts);
a bounded directory, least recently used blocks deleted first."""

import inspect

import pytest
import torch
from conftest import greedy
from primerl_embedded.engine import Engine
from primerl_kv_disk.store import DiskBlocks, DiskStore
from primerl_kv_memory.store import MemoryStore

from primerl.kv_stores import KVBlock, KVStore
from primerl.models import ModelConfig
from primerl.registry import get_registry


@pytest.fixture(scope="module", params=["glm5", "qwen3-moe"])  # MLA latents / GQA keys and values
def model(request):
    adapter = get_registry().load("model", request.param)()
    cfg = ModelConfig(name=request.param, preset="tiny", seed=1)
    return adapter.build(cfg), adapter.tokenizer(cfg), adapter.moe_layout(cfg)["num_experts"]


def engine(model, store, **kw):
    m, tok, experts = model
    return Engine(m, kv_store=store, eos_token_ids=[tok.eos_token_id], num_experts=experts,
                  **{"max_batch_size": 1, "max_model_len": 512, "kv_slots": 2, **kw})


def test_registered_and_implements_the_protocol(tmp_path):
    store_cls = get_registry().load("kv_store", "disk")
    assert store_cls is DiskStore
    for name, f in vars(KVStore).items():
        if callable(f) and not name.startswith("_"):
            assert list(inspect.signature(getattr(DiskStore, name)).parameters)[:len(inspect.signature(f).parameters)] \
                == list(inspect.signature(f).parameters)
    s = DiskStore(root=tmp_path)
    assert s.files.dir.parent == tmp_path and s.files.block_size == 64 and s.files.max_bytes == 8 << 30


def test_an_evicted_prefix_is_restored_from_files_with_the_same_tokens_and_routed_experts(model, tmp_path):
    _, tok, _ = model
    store = DiskStore(root=tmp_path, block_size=16)
    eng = engine(model, store)
    prompt = tok.encode("Reverse: a long shared system prompt, the same for every episode. " * 4)
    (cold,) = eng.generate(prompt, greedy())
    assert store.stats.saved_blocks == 0 and len(store.slots()) == 1  # idle in a free slot, no I/O yet
    for filler in ("alpha", "beta gamma"):  # two slots: the second filler evicts the prompt's prefix
        eng.generate(tok.encode(filler), greedy(4))
    assert store.stats.saved_blocks == (len(cold.tokens) - 1) // 16 == len(store.files)
    assert len(list(store.files.dir.rglob("*"))) > len(store.files)  # block files (in subdirectories)
    assert store.idle.lookup(prompt) is None  # not in any slot any more
    (warm,) = eng.generate(prompt, greedy())
    assert store.stats.restored_tokens == eng.stats.prefix_hit_tokens == (len(prompt) // 16) * 16
    # router replay stays exact: the restored tokens report the experts they were computed with
    assert warm.output_ids == cold.output_ids
    assert torch.equal(warm.routed_experts(), cold.routed_experts())
    # and both equal an engine that never reuses anything
    fresh = engine(model, DiskStore(root=tmp_path, block_size=16))
    (ref,) = fresh.generate(prompt, greedy())
    assert ref.output_ids == cold.output_ids and torch.equal(ref.routed_experts(), cold.routed_experts())


def test_multi_turn_episode_reuses_earlier_turns_from_files(model, tmp_path):
    """Each turn's prompt is the last prompt + its output + new text; between turns other
    traffic evicts the episode from the slots, so every turn after the first restores."""
    _, tok, _ = model
    store = DiskStore(root=tmp_path, block_size=8)
    eng, cold = engine(model, store), engine(model, DiskStore(root=tmp_path, block_size=8), kv_slots=1)
    prompt, restored = tok.encode("Reverse: apple banana cherry"), []
    for t in range(3):
        (a,) = eng.generate(prompt, greedy(6))
        (b,) = cold.generate(prompt, greedy(6))  # one slot: its store never keeps anything idle
        assert a.output_ids == b.output_ids and torch.equal(a.routed_experts(), b.routed_experts())
        restored.append(store.stats.restored_tokens)
        for filler in ("x y", "z"):
            eng.generate(tok.encode(filler), greedy(2))
        prompt = a.tokens + tok.encode(f" turn {t}")
    assert restored[0] == 0 < restored[1] < restored[2]


def test_a_weight_update_makes_every_stored_block_miss(model, tmp_path):
    _, tok, _ = model
    store = DiskStore(root=tmp_path, block_size=16)
    eng = engine(model, store)
    prompt = tok.encode("Reverse: the weights are about to change, " * 3)
    eng.generate(prompt, greedy())
    for filler in ("alpha", "beta"):
        eng.generate(tok.encode(filler), greedy(2))
    assert store.lookup(prompt) is not None
    eng.update_weights(lambda: None)
    assert store.lookup(prompt) is None and not store.slots()
    (seq,) = eng.generate(prompt, greedy())
    assert store.stats.restored_tokens == 0 and seq.versions == [1] * 8


def block(key: str, nbytes: int) -> KVBlock:
    return KVBlock(key, (1, 2), {"0.k": torch.zeros(2, nbytes // 8)}, None, 0)


def test_disk_blocks_are_bounded_and_evict_the_least_recently_used(tmp_path):
    one = len(__import__("primerl.kv_blocks", fromlist=["encode_block"]).encode_block(block("k0", 1024)))
    files = DiskBlocks(tmp_path, max_bytes=3 * one, block_size=2)
    files.put([block(f"k{i}", 1024) for i in range(3)])
    assert files.contains(["k0", "k1", "k2"]) == 3 and files.bytes == 3 * one
    assert files.get(["k0"])[0].tokens == (1, 2)  # k0 is now the most recent
    files.put([block("k3", 1024)])  # over the bound: k1, the least recently used, goes
    assert files.contains(["k1"]) == 0 and files.contains(["k0", "k2", "k3"]) == 3
    assert sorted(p.name for p in files.dir.rglob("k*") if p.is_file()) == ["k0", "k2", "k3"]
    files.put([block("k3", 1024)])  # already there: left as it is
    assert files.bytes == 3 * one
    (files.dir / "k0"[:2] / "k0").write_bytes(b"damaged")
    assert files.get(["k0"]) == [None] and files.contains(["k0"]) == 0  # a damaged file is a miss
    d = files.dir
    files.close()
    assert not d.exists()


def test_the_memory_store_reports_evictions_only(model, tmp_path):
    """Moves (a prefix moved out of a slot the batch needs), hand-overs and clears are not
    evictions; making room is."""
    _, tok, _ = model
    idle, seen = MemoryStore(), []
    idle.on_evict = lambda slot, tokens, routed: seen.append((slot, len(tokens), sum(len(c) for c in routed)))
    eng = engine(model, idle, max_batch_size=1, kv_slots=3)
    for p in ("alpha", "beta beta", "gamma gamma gamma"):  # no common first token: three entries
        eng.generate(tok.encode(p), greedy(3))
    assert seen == [] and len(idle.slots()) == 3
    eng.submit(tok.encode("delta"), greedy(3))
    eng.step()  # slot 0 needed, nothing free: the least recent ("alpha") is evicted, with its experts
    assert len(seen) == 1 and seen[0][1] == seen[0][2] == len(tok.encode("alpha")) + 2
    while eng.has_work():
        eng.step()
    eng.update_weights(lambda: None)
    assert len(seen) == 1 and not idle.slots()


def test_a_shared_directory_serves_one_servers_evicted_prefix_to_another(model, tmp_path):
    _, tok, _ = model
    options = {"root": str(tmp_path / "kv"), "shared": True, "block_size": 16}
    a, b = DiskStore(**options), DiskStore(**options)  # as two servers of one run build them, from kv_store_options
    assert a.files.dir == b.files.dir == tmp_path / "kv" and a.files.shared
    ea, eb = engine(model, a), engine(model, b)
    prompt = tok.encode("Reverse: one prompt, two servers, one directory. " * 3)
    (cold,) = ea.generate(prompt, greedy())
    for filler in ("alpha", "beta"):
        ea.generate(tok.encode(filler), greedy(2))
    assert a.stats.saved_blocks > 0 and not list((tmp_path / "kv").rglob(".*"))  # no half-written file left
    (warm,) = eb.generate(prompt, greedy())
    assert b.stats.restored_tokens == (len(prompt) // 16) * 16 and len(b.files) == 0
    assert warm.output_ids == cold.output_ids and torch.equal(warm.routed_experts(), cold.routed_experts())
    a.files.close()  # a server deletes the files it wrote, and only those
    assert b.blocks.lookup(prompt) is None and not [p for p in (tmp_path / "kv").rglob("*") if p.is_file()]
    with pytest.raises(ValueError, match="must be named"):
        DiskBlocks(None, shared=True)
