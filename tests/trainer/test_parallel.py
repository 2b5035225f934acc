"""The parallelism extension point: the `single` plugin, the layout, the process group."""

import pytest
import torch
import torch.distributed as dist

from primerl import hookimpl, registry
from primerl.errors import PluginError, PrimerlError
from primerl.models import ModelConfig
from primerl.parallel import ROOT_UNIT, ParallelConfig, Parallelism, ParallelLayout, Shard, device_mesh, unit_of
from primerl.registry import Registry
from primerl.trainer.main import load_parallelism
from primerl.trainer.optim import make_optimizer


@pytest.fixture(scope="module")
def tiny_model():
    adapter = registry.get_registry().load("model", "glm5")()
    return adapter.build(ModelConfig(seed=1))


def test_single_is_found_through_the_registry_and_meets_the_protocol():
    strategy = load_parallelism("single")
    assert isinstance(strategy, Parallelism)
    assert strategy.mesh_shape(1, ParallelConfig()) == {"dp_replicate": 1}
    with pytest.raises(PrimerlError, match="one process"):
        strategy.mesh_shape(2, ParallelConfig())
    with pytest.raises(PrimerlError, match="use trainer.parallelism fsdp"):
        strategy.mesh_shape(1, ParallelConfig(ep=2))
    with pytest.raises(PluginError, match="no parallelism named 'fsdp9'. Available: .*single"):
        load_parallelism("fsdp9")


def test_single_lays_out_by_parallel_plan_and_yields_every_weight_once(tiny_model):
    strategy = load_parallelism("single")
    with device_mesh(strategy.mesh_shape(1, ParallelConfig())) as mesh:
        assert dist.is_initialized() and mesh.mesh_dim_names == ("dp_replicate",)
        model, optimizer, layout = strategy.parallelize(tiny_model, mesh, lambda m: make_optimizer(m, 1e-3, 0.0))
    assert not dist.is_initialized()  # the group made for the run is gone
    assert model is tiny_model and isinstance(optimizer, torch.optim.AdamW)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    plan = model.parallel_plan()
    assert layout == ParallelLayout(strategy="single", mesh={"dp_replicate": 1},
                                    units=(*plan.fsdp_units, ROOT_UNIT))
    assert layout.world_size == 1 and not layout.shards_weights
    assert layout.describe().startswith("single on mesh (dp_replicate=1): nothing sharded")

    parts = list(strategy.full_weights(model))
    assert [unit for unit, _ in parts] == list(layout.units)  # in the layout's order
    state = model.state_dict()
    seen = [name for _, part in parts for name in part]
    assert sorted(seen) == sorted(state) and len(seen) == len(set(seen))  # every tensor once
    layer0 = dict(parts)["model.layers.0"]
    assert layer0 and all(name.startswith("model.layers.0.") for name in layer0)
    assert all(t.data_ptr() == state[n].data_ptr() for _, part in parts for n, t in part.items())  # views


def test_unit_of_matches_whole_module_names():
    units = ("model.layers.1", "model.layers.10", "lm_head", ROOT_UNIT)
    assert unit_of("model.layers.1.mlp.w", units) == "model.layers.1"
    assert unit_of("model.layers.10.mlp.w", units) == "model.layers.10"
    assert unit_of("lm_head.weight", units) == "lm_head"
    assert unit_of("model.norm.weight", units) == ROOT_UNIT


def test_a_sharded_layout_describes_what_it_splits():
    layout = ParallelLayout(strategy="fsdp2", mesh={"dp_shard": 4, "ep": 2},
                            shards=(Shard("parameters", "dp_shard"), Shard("experts", "ep", ("model.layers.1.mlp",))))
    assert layout.world_size == 8 and layout.shards_weights
    assert "experts of model.layers.1.mlp over ep" in layout.describe()
    assert not ParallelLayout(strategy="dp", mesh={"dp": 2}, shards=(Shard("rows", "dp"),)).shards_weights


def test_a_multi_rank_mesh_needs_the_ranks():
    with pytest.raises(PrimerlError, match="needs 2 ranks but the trainer has 1"), device_mesh({"dp_shard": 2}):
        pass
    assert not dist.is_initialized()


class NotAStrategy:
    pass


class BadPlugin:
    __name__ = "bad-parallel"

    @hookimpl
    def register_parallelisms(self, register):
        register("half", NotAStrategy)


def test_a_registered_class_without_the_methods_is_refused(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTRY", Registry.discover(extra=[BadPlugin()]))
    with pytest.raises(PluginError, match="lacks the methods of primerl.parallel.Parallelism"):
        load_parallelism("half")


def test_shm_publishing_writes_what_full_weights_yields(tiny_model, tmp_path):
    from safetensors.torch import load_file

    from primerl.rundir import SHM_LINK, RunDir
    from primerl.trainer.publish import prune_weights, publish_weights, release_shm

    run = RunDir(tmp_path)
    strategy = load_parallelism("single")
    with device_mesh(strategy.mesh_shape(1, ParallelConfig())) as mesh:
        model, _, _ = strategy.parallelize(tiny_model, mesh, lambda m: make_optimizer(m, 1e-3, 0.0))
    try:
        for n in (0, 1):
            publish_weights(run, n, model, adapter=None, tokenizer=None, parallelism=strategy, channel="shm")
            assert run.published(n) and run.weights_source(n) == run.weights_step(n) / SHM_LINK
        written = load_file(str(run.weights_source(1)))
        assert written.keys() == model.state_dict().keys()
        assert all(torch.equal(written[k], v) for k, v in model.state_dict().items())
        shm_file = (run.weights_step(0) / SHM_LINK).resolve()
        assert prune_weights(run, 1, keep_steps=0) == [0] and not shm_file.exists()
    finally:
        release_shm(run)
    assert not run.shm().exists()
