"""The orchestrator's stages one by one, as the batch writer composes them: the filters, the
advantage stage (shaping, estimator, episodes), the batch's metrics and its data position."""

import asyncio

import pytest

from primerl.algorithms import OverlongShaping, build_advantage
from primerl.envs import Task
from primerl.orchestrator.advantages import assign_advantages
from primerl.orchestrator.filters import GroupFilter, staleness, uniform
from primerl.orchestrator.groups import Group
from primerl.orchestrator.metrics import batch_metrics, shaping_metrics
from primerl.samples import Sample


def sample(reward, completion=2, versions=(0,), episode=None, turns=None):
    """A sample of a one-token prompt and ``completion`` sampled tokens (their versions cycle)."""
    vs = [versions[i % len(versions)] for i in range(completion)]
    return Sample(tokens=list(range(1 + completion)), loss_mask=[0] + [1] * completion,
                  logprobs=[0.0] + [-1.0] * completion, versions=[-1, *vs], reward=reward, episode=episode,
                  turns=turns)


def group(*samples, start=0, source="s"):
    return Group(task=Task(id="t", prompt="p"), start_version=start, size=len(samples), temperature=1.0,
                 samples=list(samples), source=source)


def test_the_filters_drop_stale_groups_skip_uniform_ones_up_to_the_limit_and_count_them():
    filters = GroupFilter(max_off_policy_steps=1, skip_uniform=True, skip_limit=2)
    fresh, stale = group(sample(0.0, versions=(2,)), sample(1.0, versions=(2,))), group(sample(0.0), sample(1.0))
    assert staleness(fresh, step=3) == 0 and staleness(stale, step=3) == 2  # batch 3 trains on v2
    alike = [group(sample(0.5), sample(0.5), start=2) for _ in range(3)]
    assert all(uniform(g) for g in alike) and not uniform(fresh)
    for g in alike:
        for s in g.samples:
            s.versions = [-1, 2, 2]
    assert filters.admit(fresh, 3) and not filters.admit(stale, 3)
    assert [filters.admit(g, 3) for g in alike] == [False, False, True]  # the third: past the skip limit
    assert filters.take_metrics() == {"dropped_stale": 2, "skipped_uniform": 2}
    assert filters.take_metrics() == {"dropped_stale": 0, "skipped_uniform": 0}  # counted anew per batch
    # in flight: started at v0, it could not enter batch 3 even if every token came from v0
    assert filters.hopeless(group(start=0), next_step=3) and not filters.hopeless(group(start=1), next_step=3)
    assert GroupFilter(max_off_policy_steps=1).take_metrics() == {"dropped_stale": 0}  # no skipping: no key


def test_overlong_shaping_is_zero_before_the_buffer_then_linear_to_the_penalty():
    shaping = OverlongShaping(max_tokens=10, buffer=4, penalty=2.0)
    assert [shaping([sample(0.0, completion=n)]) for n in (6, 8, 10, 12)] == [0.0, -1.0, -2.0, -2.0]
    # a multi-turn episode: tokens per model turn
    assert shaping([sample(0.0, completion=16, turns=2)]) == -1.0
    assert OverlongShaping(max_tokens=10)([sample(0.0, completion=10)]) == 0.0 and not OverlongShaping(10).enabled


def test_the_advantage_stage_shapes_rewards_runs_the_estimator_and_gives_each_sample_its_episodes():
    shaping = OverlongShaping(max_tokens=4, buffer=2, penalty=1.0)
    plain = group(sample(1.0), sample(0.0))
    # an agent env's group: episode 0 trains as two samples, episode 1 as one, too long
    agent = group(sample(1.0, episode=0), sample(1.0, episode=0), sample(1.0, completion=4, episode=1))
    out = assign_advantages([plain, agent], build_advantage("grpo"), shaping, source="mix")
    assert out.samples == [*plain.samples, *agent.samples] and {s.source for s in out.samples} == {"mix"}
    assert out.penalties == [0.0, 0.0, 0.0, -1.0]
    # plain: 1 and 0 around 0.5; agent: episode rewards 1 and 1 - 1 (shaped) around 0.5
    assert [s.advantage for s in out.samples] == [0.5, -0.5, 0.5, 0.5, -0.5]
    assert [s.reward for s in out.samples] == [1.0, 0.0, 1.0, 1.0, 1.0]  # the env's reward stays


def test_an_estimator_returning_the_wrong_shape_is_named():
    def bad(groups):
        return [[0.0] for _ in groups]

    with pytest.raises(ValueError, match="advantage 'mine' returned"):
        assign_advantages([group(sample(1.0), sample(0.0))], bad, OverlongShaping(4), source="s", estimator_name="mine")


def test_batch_metrics_keep_their_names_and_order():
    """metrics.jsonl's orchestrator keys, in the order every batch writes them."""
    a = group(sample(1.0, versions=(0, 1), turns=1), sample(0.0, turns=2), source="a")
    a.env_metrics = [{"solved": 1.0}, {"solved": 0.0, "calls": 3.0}]
    b = group(sample(0.5, completion=4, versions=(1,)), sample(0.5, versions=(1,)), source="b")
    counts = {"dropped_stale": 2, "skipped_uniform": 1, **shaping_metrics(OverlongShaping(4, 2), [0.0, -0.5]),
              "errors/task": 0, "errors/rollout": 1, "inference/resent": 0, "inference/servers_up": 1}
    metrics = batch_metrics(2, {"a": [a], "b": [b]}, [*a.samples, *b.samples], counts=counts, policy_version=1,
                            seconds=3.0)
    assert list(metrics) == [
        "step", "reward/mean", "reward/max", "reward/min", "off_policy/max", "off_policy/mean", "dropped_stale",
        "skipped_uniform", "overlong/penalty_mean", "errors/task", "errors/rollout", "inference/resent",
        "inference/servers_up", "inference/policy_version", "batch/sampled_tokens", "orchestrator/batch_seconds",
        "seq_len/mean", "completion_len/mean", "reward/a/mean", "samples/a", "reward/b/mean", "samples/b",
        "turns/mean", "env/calls", "env/solved"]
    assert metrics["reward/mean"] == 0.5 and metrics["off_policy/max"] == 1 and metrics["off_policy/mean"] == 0.5
    assert metrics["overlong/penalty_mean"] == -0.25 and metrics["batch/sampled_tokens"] == 10
    assert metrics["reward/a/mean"] == 0.5 and metrics["samples/b"] == 2 and metrics["turns/mean"] == 1.5
    assert metrics["env/solved"] == 0.5 and metrics["env/calls"] == 3.0
    one = batch_metrics(1, {"a": [a]}, a.samples, counts={}, policy_version=0, seconds=1.0)
    assert "reward/a/mean" not in one  # a run of one source: no per-source figures


def test_a_batch_fills_with_admitted_groups_and_records_the_draws_left_pending():
    from primerl.orchestrator.batching import fill, position_record
    from primerl.orchestrator.sources import Source

    class Cfg:
        name = "s"

    src = Source(cfg=Cfg(), env=None, kind=None, workers=None, quota=2, seed=0, advantage=build_advantage("grpo"))
    groups = [group(sample(1.0), sample(0.0)), group(sample(0.0), sample(0.0)), group(sample(0.0), sample(1.0))]
    for i, g in enumerate(groups):
        g.draw = i
        src.pending[i] = g.task
        src.finished.put_nowait(g)
    src.pending[3] = Task(id="in-flight", prompt="p")
    src.drawn = 4
    asyncio.run(fill(src, 1, GroupFilter(max_off_policy_steps=1, skip_uniform=True, skip_limit=1)))
    assert src.batching == [groups[0], groups[2]]  # the uniform one was skipped, a later one took its place
    assert position_record(1, [src]) == {"format": "primerl.orchestrator_state", "version": 2, "step": 1,
                                         "sources": {"s": {"drawn": 4, "pending": [[3, "in-flight"]]}},
                                         "batch": {"s": [0, 2]}}


def test_each_stage_module_declares_what_it_exports():
    import importlib

    for name in ("advantages", "batching", "failures", "filters", "groups", "metrics", "positions", "sources"):
        module = importlib.import_module(f"primerl.orchestrator.{name}")
        defined = {n for n, v in vars(module).items()
                   if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__}
        assert defined and defined <= set(module.__all__) and all(hasattr(module, n) for n in module.__all__), name
