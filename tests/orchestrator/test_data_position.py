"""The orchestrator's data position: recorded beside every batch, resumed from a checkpoint
so the task order continues as if the run had never stopped."""

import asyncio
import itertools
import json

from primerl.config import ConfigSources, load_config
from primerl.envs import Task
from primerl.orchestrator import main as orchestrator
from primerl.orchestrator.groups import Group
from primerl.orchestrator.main import Orchestrator
from primerl.orchestrator.positions import DataPosition, SourcePosition
from primerl.rundir import ORCHESTRATOR_STATE, RunDir
from primerl.samples import Sample, read_batch


def make(tmp_path, **orch):
    overrides = [("output_dir", str(tmp_path)), ("max_steps", "4"), ("orchestrator.batch_size", "4"),
                 ("orchestrator.group_size", "2")]
    overrides += [(f"orchestrator.{k}", str(v)) for k, v in orch.items()]
    cfg = load_config(ConfigSources(overrides=overrides), {"env.name": "reverse-text"})
    from primerl_round_robin.router import RoundRobinRouter

    from primerl.orchestrator.client import InferenceClient
    from primerl.registry import get_registry

    client = InferenceClient(["http://127.0.0.1:9"], RoundRobinRouter())  # never called: batches are fed in
    return Orchestrator(cfg, get_registry().load("env", "reverse-text")(cfg.env), client=client)


def finished_group(draw, task_id):
    g = Group(task=Task(id=task_id, prompt="abc", answer="cba"), start_version=0, size=2, temperature=1.0,
              draw=draw, source="reverse-text")
    for r in (0.0, 1.0):
        g.samples.append(Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0],
                                versions=[-1, 0, 0], reward=r, task_id=task_id))
    return g


def test_each_batch_records_the_draws_and_the_unbatched_tasks_before_it_is_written(tmp_path):
    orch = make(tmp_path, max_off_policy_steps=2, async_level=1)
    (src,) = orch.sources
    draws = list(itertools.islice(src.draws(), 5))
    # five drawn: 0 and 1 finished first (batch 1), 2 is in flight, 3 finished and waits, 4 failed
    src.drawn = 5
    src.pending = {i: t for i, t in draws[:4]}
    for i in (1, 0, 3):
        src.finished.put_nowait(finished_group(i, draws[i][1].id))
    orch.cfg.max_steps = 1
    asyncio.run(orch.write_batches())
    run = RunDir(tmp_path)
    record = json.loads(run.batch_state(1).read_text())
    assert record == {"format": "primerl.orchestrator_state", "version": 2, "step": 1,
                      "sources": {"reverse-text": {"drawn": 5, "pending": [[2, draws[2][1].id], [3, draws[3][1].id]]}},
                      "batch": {"reverse-text": [1, 0]}}
    assert sorted({s.task_id for s in read_batch(run.batch(1)).samples}) == sorted([draws[0][1].id, draws[1][1].id])


def test_a_resumed_orchestrator_starts_the_unbatched_tasks_then_continues_the_draws(tmp_path, monkeypatch):
    reference = list(itertools.islice(make(tmp_path / "ref").sources[0].draws(), 40))
    run = RunDir(tmp_path / "run")
    ckpt = run.checkpoint(3)
    ckpt.mkdir(parents=True)
    position = DataPosition(step=3, sources={"reverse-text": SourcePosition(
        drawn=30, pending=((27, reference[27][1].id), (29, reference[29][1].id)))})
    (ckpt / ORCHESTRATOR_STATE).write_text(json.dumps(position.record(batch={"reverse-text": [25, 26]})))
    # the trainer's choice of checkpoint, made alike (primerl.resume.usable_checkpoint)
    monkeypatch.setattr(orchestrator, "usable_checkpoint", lambda run_dir, log=None: (3, ckpt))
    orch = make(tmp_path / "run", async_level=1)
    assert orch.resume_step == 3 and orch.started == 3 * orch.groups_per_batch and orch.sources[0].drawn == 30
    resumed = [(i, t.id) for i, t in itertools.islice(orch.sources[0].tasks, 4)]
    assert resumed == [(27, reference[27][1].id), (29, reference[29][1].id),
                       (30, reference[30][1].id), (31, reference[31][1].id)]
    orch.version = 2  # an older version is served: nothing starts before v3, the checkpoint's
    assert not orch.may_start()
    orch.version = 3
    assert orch.may_start()


def test_a_checkpoint_without_a_position_continues_from_the_estimate(tmp_path, monkeypatch, capsys):
    reference = list(itertools.islice(make(tmp_path / "ref").sources[0].draws(), 20))
    run = RunDir(tmp_path / "run")
    run.checkpoint(2).mkdir(parents=True)
    monkeypatch.setattr(orchestrator, "usable_checkpoint", lambda run_dir, log=None: (2, run.checkpoint(2)))
    orch = make(tmp_path / "run")
    assert "has no data position" in capsys.readouterr().out
    assert [i for i, _ in itertools.islice(orch.sources[0].tasks, 2)] == [4, 5]  # 2 batches x 2 groups
    assert next(orch.sources[0].tasks)[1].id == reference[6][1].id
