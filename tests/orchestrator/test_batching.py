"""The orchestrator's batch policy: first-come batches, stale samples dropped and counted."""

import asyncio

import torch

from primerl.config import ConfigSources, load_config
from primerl.envs import Task
from primerl.orchestrator.main import Group, Orchestrator


def make_orchestrator(tmp_path, **orch):
    overrides = [("output_dir", str(tmp_path)), ("max_steps", "2")]
    overrides += [(f"orchestrator.{k}", str(v)) for k, v in orch.items()]
    cfg = load_config(ConfigSources(overrides=overrides), {"env.name": "reverse-text"})
    from primerl.registry import get_registry

    env = get_registry().load("env", "reverse-text")(cfg.env)
    return Orchestrator(cfg, env, client=None)


def group(version_span, reward=(0.0, 1.0)):
    g = Group(task=Task(id="t", prompt="abc", answer="cba"), start_version=version_span[0])
    for r in reward:
        g.samples.append({"tokens": [1, 2, 3], "loss_mask": [0, 1, 1], "logprobs": [0.0, -1.0, -1.0],
                          "versions": [-1, *version_span], "reward": r, "temperature": 1.0, "routed_experts": None})
    return g


def test_stale_groups_are_dropped_counted_and_replaced(tmp_path):
    orch = make_orchestrator(tmp_path, batch_size=4, group_size=2, max_off_policy_steps=1, async_level=1)
    orch.started = 10
    # batch 1 (trains on v0): a group from v0 qualifies; batch 2 (v1): one from v0 has staleness 1 (kept)
    for g in [group((0, 0)), group((0, 1)), group((0, 0)), group((-2, 0)), group((1, 1))]:
        orch.finished.put_nowait(g)
    # the (-2, 0) group has staleness 3 at batch 2 > 1: dropped (its oldest token counts)
    asyncio.run(orch.write_batches())
    b1 = torch.load(tmp_path / "rollouts" / "step_000001.pt", weights_only=False)
    b2 = torch.load(tmp_path / "rollouts" / "step_000002.pt", weights_only=False)
    assert len(b1["samples"]) == 4 and b1["metrics"]["dropped_stale"] == 0
    assert len(b2["samples"]) == 4 and b2["metrics"]["dropped_stale"] == 2
    assert b2["metrics"]["off_policy/max"] == 1
    assert orch.started == 9  # the dropped group's slot went back, so a fresh group replaces it
    # GRPO advantages: reward minus group mean
    assert [s["advantage"] for s in b1["samples"][:2]] == [-0.5, 0.5]


def test_async_level_bounds_how_far_generation_runs_ahead(tmp_path):
    for level, allowed in ((0, 1), (2, 3)):
        orch = make_orchestrator(tmp_path, batch_size=4, group_size=2, async_level=level, max_off_policy_steps=4)
        orch.version = 0
        orch.started = allowed * orch.groups_per_batch - 1
        assert orch.may_start()
        orch.started += 1
        assert not orch.may_start()  # needs the trainer to publish the next version first


def test_hopeless_in_flight_groups_are_cancelled(tmp_path):
    orch = make_orchestrator(tmp_path, batch_size=4, group_size=2, max_off_policy_steps=1, async_level=1)

    async def go():
        old = asyncio.create_task(asyncio.sleep(10))
        fresh = asyncio.create_task(asyncio.sleep(10))
        orch.in_flight = {old: group((0, 0)), fresh: group((2, 2))}
        orch.in_flight[old].start_version = 0
        orch.in_flight[fresh].start_version = 2
        orch.started = 2
        orch.cancel_hopeless(next_batch=3)  # batch 3 trains on v2: a group started at v0 is 2 behind
        await asyncio.sleep(0)
        assert old.cancelled() and not fresh.cancelled()
        fresh.cancel()

    asyncio.run(go())
    assert orch.started == 1
