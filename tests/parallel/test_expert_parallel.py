"""Expert parallelism (primerl_fsdp.expert_parallel) on spawned gloo ranks, against one
process running every rank's tokens through the unsharded model.

Each rank builds the same tiny model (same seed), shards a copy's experts over the ep
group and runs its own rows; the reference copy runs the rows of the whole ep group at
once, replaying the experts the EP model used (identical routing, so a near-tie that
rounding flips cannot fail the test; the reference router's own choice must agree). EP
outputs at valid tokens, local expert gradients, and the other gradients summed over the
ep group must match to 1e-5 relative error in float32.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
from primerl_fsdp.expert_parallel import (
    ExpertParallelMixin,
    expert_grad_sq_norm,
    expert_parameters,
    gather_experts,
    local_expert_slice,
    shard_experts_,
)
from primerl_fsdp.ranks import run_on_ranks
from torch import nn

from primerl.errors import PrimerlError
from primerl.models import ModelConfig
from primerl.models.contract import LayerPlan, Mixer, MoEPlan, ParallelPlan
from primerl.models.experts import Experts
from primerl.registry import get_registry

pytestmark = pytest.mark.slow  # every test starts torch.distributed ranks

FAMILIES = ["qwen3-moe", "kimi", "glm5", "nemotron", "minimax"]
TOL = 1e-5
ROWS, SEQ = 2, 20  # per rank; <= 32 tokens keeps GLM-5's DSA selecting every key (no top-k to flip)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| (0 when both are 0)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    diff = (got - want).abs().max().item() if want.numel() else 0.0
    return diff / scale if scale else diff


def build(name: str) -> nn.Module:
    adapter = get_registry().load("model", name)()
    return adapter.build(ModelConfig(name=name, preset="tiny", dtype="float32", seed=3))


def rank_inputs(rank: int, vocab: int, scenario: str, group_rank: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s rows: its own tokens and lengths (all padding on ep rank 1 in 'padding')."""
    gen = torch.Generator().manual_seed(100 + rank)
    input_ids = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    lengths = torch.tensor([SEQ, int(torch.randint(1, SEQ, (), generator=gen))])
    if scenario == "padding" and group_rank == 1:
        lengths = torch.zeros(ROWS, dtype=torch.long)
    return {"input_ids": input_ids, "positions": torch.arange(SEQ).expand(ROWS, SEQ), "lengths": lengths}


def skewed_replay(rank: int, n_moe: int, top_k: int) -> torch.Tensor:
    """Replayed ids drawn from experts 0..top_k only: the other experts (and on 2 ranks of
    8 experts, every expert of ep rank 1) get no tokens at all."""
    gen = torch.Generator().manual_seed(200 + rank)
    scores = torch.rand(ROWS, SEQ, n_moe, top_k + 1, generator=gen)
    return scores.argsort(-1)[..., :top_k]  # distinct ids per token


def check_ep(name: str, scenario: str, ep_dims: tuple[int, ...] = ()) -> dict:
    """On every rank: EP forward/backward vs the unsharded reference. ``ep_dims`` (dp, ep):
    a 2D mesh whose ``ep`` groups shard the experts; default: the whole world is the ep group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if ep_dims:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", ep_dims, mesh_dim_names=("dp", "ep"))
        group = mesh.get_group("ep")
        members = mesh["ep"].mesh.tolist()  # global ranks of my ep group, in group order
    else:
        group, members = dist.group.WORLD, list(range(world))
    ep, ep_rank = dist.get_world_size(group), dist.get_rank(group)

    ref = build(name)
    model = copy.deepcopy(ref)
    sharded = shard_experts_(model, group)
    vocab, top_k, n_moe = ref.config.vocab_size, ref.config.num_experts_per_tok, len(ref.moe_layers)

    # EP model on this rank's rows.
    mine = rank_inputs(rank, vocab, scenario, ep_rank)
    replay = skewed_replay(rank, n_moe, top_k) if scenario == "replay" else None
    out = model(**mine, replay_experts=replay)
    probe = torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(300 + rank))
    valid = torch.arange(SEQ)[None, :] < mine["lengths"][:, None]  # [ROWS, SEQ]
    (out.logits * probe * valid[..., None]).sum().backward()

    # Reference: the whole ep group's rows at once, replaying the ids the EP model used.
    all_rows = [rank_inputs(r, vocab, scenario, members.index(r)) for r in members]
    used = [torch.empty_like(out.routed_experts, dtype=torch.long) for _ in members]
    dist.all_gather(used, out.routed_experts.long(), group=group)  # (gloo has no int16 collectives)
    batch = {k: torch.cat([rows[k] for rows in all_rows]) for k in mine}
    ref_out = ref(**batch, replay_experts=torch.cat(used))
    probes = [torch.randn(out.logits.shape, generator=torch.Generator().manual_seed(300 + r)) for r in members]
    ref_valid = torch.arange(SEQ)[None, :] < batch["lengths"][:, None]
    (ref_out.logits * torch.cat(probes) * ref_valid[..., None]).sum().backward()

    mine_rows = slice(ep_rank * ROWS, (ep_rank + 1) * ROWS)
    result = {"sharded": sharded, "ep": ep}
    result["logits"] = rel_err(out.logits[valid], ref_out.logits[mine_rows][valid])
    if scenario == "replay":
        result["replayed"] = bool((out.routed_experts.long() == replay)[valid].all())
    else:  # the reference router, on its own, picks what the EP model used
        own = ref_out.router_experts[mine_rows].sort(-1).values  # top-k sets; their order is unspecified
        agree = (own == out.routed_experts.sort(-1).values).all(-1)[valid]  # [valid tokens, n_moe]
        result["agreement"] = agree.float().mean().item() if agree.numel() else 1.0

    # Gradients: local experts directly; everything else summed over the ep group.
    expert_names = dict(expert_parameters(model))
    ref_params = dict(ref.named_parameters())
    grad_err, no_grad = {}, []
    for pname, p in model.named_parameters():
        want = ref_params[pname].grad
        want = torch.zeros_like(ref_params[pname]) if want is None else want
        got = p.grad
        if got is None:
            no_grad.append(pname)
            got = torch.zeros_like(p)
        if pname in expert_names:
            want = local_expert_slice(want, ep_rank, ep)
        else:
            got = got.clone()
            dist.all_reduce(got, group=group)
        grad_err[pname] = rel_err(got, want)
    result["grad_err"] = grad_err
    result["experts_without_grad"] = [n for n in no_grad if n in expert_names]
    want_sq = sum(ref_params[n].grad.pow(2).sum() for n in expert_names if ref_params[n].grad is not None)
    result["sq_norm"] = rel_err(expert_grad_sq_norm(model, group), torch.as_tensor(want_sq))

    # gather_experts to the group's last rank rebuilds the reference's full experts.
    dst = ep - 1
    gathered = {}
    for module_name in sharded:
        full = gather_experts(model.get_submodule(module_name), group, dst=dst)
        gathered.update({f"{module_name}.{k}": v for k, v in full.items()})
    if ep_rank == dst:
        result["gathered"] = sorted(gathered) == sorted(n for n in ref_params if n in expert_names) and all(
            torch.equal(t, ref_params[n].detach()) for n, t in gathered.items())
    else:
        result["gathered"] = gathered == {}
    return result


def assert_matches(results: list[dict], scenario: str) -> None:
    for rank, r in enumerate(results):
        assert r["sharded"], "no Experts module was sharded"
        assert r["logits"] < TOL, f"rank {rank}: logits rel err {r['logits']:.2e}"
        if scenario == "replay":
            assert r["replayed"], f"rank {rank}: the replayed ids were not the ids used"
        else:
            assert r["agreement"] > 0.99, f"rank {rank}: routing agreement {r['agreement']}"
        worst = max(r["grad_err"], key=r["grad_err"].get)
        assert r["grad_err"][worst] < TOL, f"rank {rank}: grad of {worst} rel err {r['grad_err'][worst]:.2e}"
        assert r["experts_without_grad"] == [], f"rank {rank}: experts without a gradient"
        assert r["sq_norm"] < TOL, f"rank {rank}: expert grad sq norm rel err {r['sq_norm']:.2e}"
        assert r["gathered"], f"rank {rank}: gather_experts did not rebuild the full experts"


def check_family(name: str) -> dict:
    return {scenario: check_ep(name, scenario) for scenario in ("routed", "replay", "padding")}


@pytest.mark.parametrize("name", FAMILIES)
def test_ep_matches_one_process_on_two_ranks(name):
    """Natural routing, skewed replay (experts and a whole rank without tokens), and one
    rank of padding only: outputs and gradients as one process computes them."""
    per_rank = run_on_ranks(2, check_family, name)
    for scenario in ("routed", "replay", "padding"):
        assert_matches([r[scenario] for r in per_rank], scenario)


def check_under_fsdp() -> dict:
    """Experts sharded over ep, then FSDP2 over dp (torchtitan's dp_shard_mod_ep): the
    forward runs inside FSDP's unsharded parameters; the grad norm and gather_experts
    read DTensors."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "ep"))
    ep_group = mesh.get_group("ep")
    model = build("qwen3-moe")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = shard_experts_(model, ep_group)
    for name in names:
        fully_shard(model.get_submodule(name), mesh=mesh["dp"])
    out = model(**rank_inputs(dist.get_rank(), model.config.vocab_size, "routed", 0))
    out.logits.square().mean().backward()
    want = torch.zeros(())
    for _, p in expert_parameters(model):
        want += p.grad.full_tensor().pow(2).sum()  # this ep rank's whole slice
    dist.all_reduce(want, group=ep_group)
    full = {}
    for name in names:
        full.update({f"{name}.{k}": v for k, v in gather_experts(model.get_submodule(name), ep_group).items()})
    return {"dtensors": all(isinstance(p, DTensor) for _, p in expert_parameters(model)),
            "sq_norm": rel_err(expert_grad_sq_norm(model, ep_group), want),
            "gathered": len(full),
            "gathered_equal": all(torch.equal(v, initial[k]) for k, v in full.items())}


def check_four_ranks() -> dict:
    return {"ep4": check_ep("kimi", "routed"), "dp2_ep2": check_ep("qwen3-moe", "padding", ep_dims=(2, 2)),
            "fsdp": check_under_fsdp()}


def test_ep_on_four_ranks_on_ep_subgroups_and_under_fsdp():
    """ep=4 (kimi: 12 experts, 3 per rank); a (dp=2, ep=2) mesh whose ep groups are
    proper subgroups (gather_experts maps its dst to a global rank); and the same mesh
    with FSDP2 over dp on the expert-sharded modules."""
    per_rank = run_on_ranks(4, check_four_ranks)
    assert all(r["ep4"]["ep"] == 4 and r["dp2_ep2"]["ep"] == 2 for r in per_rank)
    assert_matches([r["ep4"] for r in per_rank], "routed")
    assert_matches([r["dp2_ep2"] for r in per_rank], "padding")
    for r in per_rank:
        fsdp = r["fsdp"]
        assert fsdp["dtensors"] and fsdp["sq_norm"] < TOL, fsdp
        assert fsdp["gathered"] in (6, 0) and fsdp["gathered_equal"], fsdp  # 3 layers x 2 tensors on ep rank 0
    assert sorted(r["fsdp"]["gathered"] for r in per_rank) == [0, 0, 6, 6]


def _plan_of_experts(*names: str) -> ParallelPlan:
    """A plan of one MoE layer per experts module (no router of its own: these holders have none)."""
    layers = tuple(LayerPlan(f"layer{i}", Mixer.NONE, MoEPlan(router=n, experts=n)) for i, n in enumerate(names))
    return ParallelPlan(layers=layers, embeddings="", head="")


class _OddExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = Experts(3, 8, 4)
        self.other = Experts(4, 8, 4, act="relu2", gated=False)

    def parallel_plan(self) -> ParallelPlan:
        return _plan_of_experts("other", "experts")


def check_blocks() -> dict:
    """Errors, subclass composition and tensor-level pieces on 2 ranks."""
    rank, out = dist.get_rank(), {}
    odd = _OddExperts()
    try:
        shard_experts_(odd, None)
    except PrimerlError as exc:
        out["odd_error"] = str(exc)
    out["untouched"] = type(odd.other) is Experts and odd.other.down_proj.shape[0] == 4  # checked before sharding

    class Doubled(Experts):  # a subclass with its own compute (as FP8 experts are): EP must call it
        def forward(self, x, ids, weights, valid):
            return 2 * super().forward(x, ids, weights, valid)

    class Holder(nn.Module):
        def __init__(self, experts):
            super().__init__()
            self.experts = experts

        def parallel_plan(self):
            return _plan_of_experts("experts")

    torch.manual_seed(0)
    full = Doubled(4, 8, 6, act="relu2", gated=False)
    with torch.no_grad():
        for p in full.parameters():
            p.normal_()
    holder = Holder(copy.deepcopy(full))
    shard_experts_(holder)
    ep_mod = holder.experts
    out["class"] = type(ep_mod).__name__
    out["mro_ok"] = isinstance(ep_mod, (ExpertParallelMixin, Doubled))
    out["shapes"] = {n: tuple(p.shape) for n, p in ep_mod.named_parameters()}
    out["slice_ok"] = all(torch.equal(p, local_expert_slice(getattr(full, n), rank, 2))
                          for n, p in ep_mod.named_parameters())
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(5, 8, generator=gen)
    ids = torch.stack([torch.randperm(4, generator=gen)[:2] for _ in range(5)])
    weights = torch.rand(5, 2, generator=gen)
    valid = torch.tensor([True, True, False, True, rank == 0])
    with torch.no_grad():
        out["no_grad_err"] = rel_err(ep_mod(x, ids, weights, valid), full(x, ids, weights, valid))
    try:
        local_expert_slice(torch.zeros(5, 2), 0, 2)
    except PrimerlError as exc:
        out["slice_error"] = str(exc)
    return out


def test_shard_errors_subclasses_and_no_grad_forward():
    results = run_on_ranks(2, check_blocks)
    for rank, r in enumerate(results):
        assert "3 experts" in r["odd_error"] and "ep=2" in r["odd_error"] and "experts" in r["odd_error"]
        assert r["untouched"]
        assert r["class"] == "ExpertParallelDoubled" and r["mro_ok"]
        assert r["shapes"] == {"up_proj": (2, 6, 8), "down_proj": (2, 8, 6)}
        assert r["slice_ok"]
        assert r["no_grad_err"] < TOL, f"rank {rank}: {r['no_grad_err']:.2e}"
        assert "does not split" in r["slice_error"]


def test_local_expert_slice_is_a_view_of_contiguous_experts():
    full = torch.arange(12.0).view(6, 2)
    parts = [local_expert_slice(full, r, 3) for r in range(3)]
    assert torch.equal(torch.cat(parts), full)
    assert parts[1].data_ptr() == full[2].data_ptr() and math.prod(parts[1].shape) == 4
