"""Context parallelism (``primerl_fsdp.context_parallel``) against one process.

Each architecture's ``tiny`` preset is built identically on every rank (seed 0); packed
rows with several segments of different lengths and right padding go through the model
whole in one process, then split over the ranks of a gloo group (zigzag chunks). Per
token, the logits, the target logprobs and the experts used, gathered back, must equal
one process's; the gradients of every parameter, summed over the ranks, must equal one
process's gradients of the same loss (normalised by the whole rows' loss tokens). Both
attention layouts of CP are checked: this rank's queries one sequence per row facing
their sequences' keys, and masked rows (the model's ``unpack_segments`` False).
Nemotron-H's Mamba-2 layers are refused when CP is applied.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from primerl_fsdp.context_parallel import (
    apply_context_parallel_,
    context_parallel_shard,
    cp_token_indices,
    gather_from_cp,
    padded_length,
    split_for_cp,
    split_row_for_cp,
)
from primerl_fsdp.ranks import run_on_ranks

from primerl.errors import PrimerlError
from primerl.models import ModelConfig
from primerl.registry import get_registry
from primerl.sampling import token_logprobs
from primerl.tokenizer import VOCAB_SIZE

pytestmark = pytest.mark.slow  # every test starts torch.distributed ranks

# per row, the lengths of its packed sequences; row 1 is right-padded (41 of 78 tokens).
# GLM-5's DSA (index_topk 32) selects keys in the 40- and 36-token sequences; the
# 40-token sequence spans several zigzag chunks.
ROWS = [[4, 40, 14, 20], [5, 36]]
# prompt trees (trainer.share_prompts): (prompt positions, [branch lengths]) shares its
# prompt, an int is a whole sequence; the 30-token prompt and its branches cross chunks,
# and DSA selects keys in its 12-token branch (42 keys); many short sequences make one
# tree per row the cheaper layout
TREE_ROWS = [[(30, [12, 4]), 8, 12, (6, [9, 3]), 20], [5, (8, [7, 6]), 30, 10], [3, 4, 5, 6, 7, 8, 9, 10]]
LOGITS_RTOL = 1e-5
GRAD_RTOL = 1e-4


def _size(item) -> int:
    return item if isinstance(item, int) else item[0] + sum(item[1])


def packed_rows(rows: list[list], seed: int = 0) -> dict:
    """A PackedBatch.rows()-style dict of random packed rows: segment -1 and loss mask 0 on
    the padding, random targets, loss mask and per-token loss weights ("advantages"). An
    item ``(p, [n1, n2, ...])`` is a prompt tree: p prompt positions (no loss) in one
    segment, then branches of n1, n2... positions from position p on, each its own segment
    seeing the prompt's (``prefix_ids``, present only when a row holds a tree)."""
    g = torch.Generator().manual_seed(seed)
    B, S = len(rows), max(sum(_size(i) for i in r) for r in rows)
    row = {
        "input_ids": torch.zeros(B, S, dtype=torch.long),
        "positions": torch.zeros(B, S, dtype=torch.long),
        "segment_ids": torch.full((B, S), -1, dtype=torch.long),
        "prefix_ids": torch.full((B, S), -1, dtype=torch.long),
        "lengths": torch.tensor([sum(_size(i) for i in r) for r in rows]),
        "targets": torch.zeros(B, S, dtype=torch.long),
        "loss_mask": torch.zeros(B, S, dtype=torch.bool),
        "advantages": torch.zeros(B, S),
    }
    for b, items in enumerate(rows):
        off, seg = 0, 0
        for item in items:
            prompt, branches = (0, [item]) if isinstance(item, int) else item
            spans = ([(prompt, 0, False)] if prompt else []) + [(n, prompt, True) for n in branches]
            root = seg
            for n, start, learn in spans:
                sl = slice(off, off + n)
                row["input_ids"][b, sl] = torch.randint(0, VOCAB_SIZE, (n,), generator=g)
                row["targets"][b, sl] = torch.randint(0, VOCAB_SIZE, (n,), generator=g)
                row["positions"][b, sl] = torch.arange(start, start + n)
                row["segment_ids"][b, sl] = seg
                row["prefix_ids"][b, sl] = root if prompt else seg
                row["loss_mask"][b, sl] = (torch.rand(n, generator=g) < 0.7) & learn
                row["advantages"][b, sl] = torch.randn(n, generator=g)
                off, seg = off + n, seg + 1
    if not any(isinstance(i, tuple) for r in rows for i in r):
        del row["prefix_ids"]
    return row


def weighted_logprob_loss(model, row: dict, normalizer: float):
    """(loss, output, target logprobs): sum of advantage * logprob over loss tokens / normalizer."""
    out = model(row["input_ids"], row["positions"], row["lengths"], segment_ids=row["segment_ids"],
                prefix_ids=row.get("prefix_ids"), replay_experts=row.get("replay_experts"), logits_for="all")
    lp = token_logprobs(out.logits, row["targets"], 1.0)  # [B, S]
    loss = (lp * row["advantages"] * row["loss_mask"]).sum() / normalizer
    return loss, out, lp


def record_layouts(shard) -> list:
    """Every batch ``shard`` makes from now on (which attention layout CP chose)."""
    made, make_batch = [], shard.make_batch

    def recording(*args):
        made.append(make_batch(*args))
        return made[-1]

    shard.make_batch = recording
    return made


def compare_with_one_process(names: list[str], rows: list[list[int]]) -> dict:
    """On every rank: one process's forward/backward on the whole rows, then CP's on this
    rank's part. Rank 0 returns per architecture the two results (numpy), or the message
    with which CP was refused."""
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        model = get_registry().load("model", name)().build(ModelConfig(name=name, preset="tiny", seed=0))
        row = packed_rows(rows)
        S = row["input_ids"].shape[1]
        with torch.no_grad():  # replay the experts of one process (router replay through CP)
            first = model(row["input_ids"], row["positions"], row["lengths"], segment_ids=row["segment_ids"],
                          prefix_ids=row.get("prefix_ids"))
        if first.routed_experts.shape[2]:
            row["replay_experts"] = first.routed_experts
        normalizer = float(row["loss_mask"].sum())

        loss, out, lp = weighted_logprob_loss(model, row, normalizer)
        loss.backward()
        ref_grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)

        try:
            apply_context_parallel_(model, None)
        except PrimerlError as exc:
            results[name] = {"refused": str(exc)}
            continue
        layouts = record_layouts(context_parallel_shard(model))
        local = split_row_for_cp(row, rank, size)
        valid = torch.arange(S)[None, :] < row["lengths"][:, None]  # [B, S]
        results[name] = {
            "valid": valid.numpy(),
            "ref": {"loss": float(loss), "logits": out.logits.detach().numpy(), "logprobs": lp.detach().numpy(),
                    "routed_experts": out.routed_experts.numpy(),
                    "grads": {n: g.numpy() for n, g in ref_grads.items()}},
        }
        for layout in ("sequences", "masked"):
            model.unpack_segments = layout == "sequences"
            model.zero_grad(set_to_none=True)
            cp_loss, cp_out, cp_lp = weighted_logprob_loss(model, local, normalizer)
            cp_loss.backward()
            cp_grads = {}
            for n, p in model.named_parameters():
                g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
                dist.all_reduce(g)  # the sum over the CP ranks (FSDP's reduce-scatter in training)
                cp_grads[n] = g
            dist.all_reduce(cp_loss_sum := cp_loss.detach().clone())
            gathered = {
                "logits": gather_from_cp(cp_out.logits.detach(), None, seq_len=S),
                "logprobs": gather_from_cp(cp_lp.detach(), None, seq_len=S),
                "routed_experts": gather_from_cp(cp_out.routed_experts, None, seq_len=S),
                "valid": gather_from_cp(local["valid"], None, seq_len=S),
            }
            results[name][layout] = {
                "loss": float(cp_loss_sum), **{k: v.numpy() for k, v in gathered.items()},
                "grads": {n: g.numpy() for n, g in cp_grads.items()},
                "per_sequence": layouts[-1].segments is not None,
            }
        try:
            model(local["input_ids"], local["positions"], local["lengths"], segment_ids=local["segment_ids"],
                  logits_for="last")
            results[name]["last_refused"] = ""
        except PrimerlError as exc:
            results[name]["last_refused"] = str(exc)
    return results if rank == 0 else {}


@pytest.fixture(scope="module")
def two_ranks():
    return run_on_ranks(2, compare_with_one_process, ["qwen3-moe", "kimi", "glm5", "nemotron", "qwen3", "llama"], ROWS)[0]


def check_matches_one_process(result: dict) -> None:
    """Both CP attention layouts (one sequence per row, masked rows) against one process."""
    ref, valid = result["ref"], torch.from_numpy(result["valid"])
    assert "logits_for must be 'all'" in result["last_refused"]
    for layout in ("sequences", "masked"):
        cp = result[layout]
        assert cp["per_sequence"] == (layout == "sequences")
        assert torch.equal(torch.from_numpy(cp["valid"]), valid)  # the gathered valid mask is the rows' own
        for key in ("logits", "logprobs"):
            torch.testing.assert_close(torch.from_numpy(cp[key])[valid], torch.from_numpy(ref[key])[valid],
                                       rtol=LOGITS_RTOL, atol=LOGITS_RTOL,
                                       msg=lambda m, key=key, layout=layout: f"{layout} {key}: {m}")
        assert torch.equal(torch.from_numpy(cp["routed_experts"])[valid],
                           torch.from_numpy(ref["routed_experts"])[valid])
        assert cp["loss"] == pytest.approx(ref["loss"], rel=LOGITS_RTOL, abs=1e-7)
        assert ref["grads"].keys() == cp["grads"].keys()
        worst = []
        for name, g_ref in ref["grads"].items():
            g_ref, g_cp = torch.from_numpy(g_ref).double(), torch.from_numpy(cp["grads"][name]).double()
            scale, error = float(g_ref.norm()), float((g_cp - g_ref).norm())
            if error > GRAD_RTOL * max(scale, 1e-12):
                worst.append(f"{name}: |cp - one process| = {error:.3g}, |one process| = {scale:.3g}")
        assert not worst, f"{layout}: gradients differ:\n" + "\n".join(worst)


@pytest.mark.parametrize("arch", ["qwen3-moe", "kimi", "glm5", "qwen3"], ids=["gqa", "mla", "mla-dsa", "dense"])
def test_two_ranks_match_one_process(two_ranks, arch):
    check_matches_one_process(two_ranks[arch])


@pytest.fixture(scope="module")
def two_ranks_trees():
    return run_on_ranks(2, compare_with_one_process, ["qwen3-moe", "kimi", "glm5"], TREE_ROWS)[0]


@pytest.mark.parametrize("arch", ["qwen3-moe", "kimi", "glm5"], ids=["gqa", "mla", "mla-dsa"])
def test_prompt_trees_on_two_ranks_match_one_process(two_ranks_trees, arch):
    check_matches_one_process(two_ranks_trees[arch])


def test_mamba2_is_refused_when_applied(two_ranks):
    message = two_ranks["nemotron"]["refused"]
    assert "layer 0 " in message and "'mamba2'" in message and "rank to rank" in message, message


def compare_with_all_reduce_backward(names: list[str], rows: list[list[int]]) -> dict:
    """``compare_with_one_process`` with the all-reduce fallback for backends without
    reduce-scatter (gloo in older torch)."""
    import torch.distributed as dist
    from primerl_fsdp import context_parallel

    context_parallel._reduce_scatter_missing.add(str(dist.get_backend()))
    return compare_with_one_process(names, rows)


def test_four_ranks_match_one_process():
    """Four ranks (chunks of 10 tokens: sequences span up to five), GLM-5's MLA + DSA, and
    the key gradients summed by all-reduce + slice instead of reduce-scatter."""
    result = run_on_ranks(4, compare_with_all_reduce_backward, ["glm5"], ROWS)[0]
    check_matches_one_process(result["glm5"])


@pytest.mark.parametrize("cp_size", [1, 2, 3, 4])
def test_split_covers_every_token_once_in_balanced_chunks(cp_size):
    S = 37
    rows = torch.arange(2 * S).view(2, S)
    S_pad = padded_length(S, cp_size)
    parts = [split_for_cp(rows, r, cp_size, pad_value=-1) for r in range(cp_size)]
    index = [cp_token_indices(S_pad, r, cp_size) for r in range(cp_size)]
    whole = torch.full((2, S_pad), -1)
    for part, idx in zip(parts, index, strict=True):
        assert part.shape == (2, S_pad // cp_size)
        whole[:, idx] = part
    assert torch.equal(whole[:, :S], rows) and bool((whole[:, S:] == -1).all())
    assert sorted(torch.cat(index).tolist()) == list(range(S_pad))
    # zigzag: every rank holds the same total causal work (sum of query positions)
    assert len({int(idx.sum()) for idx in index}) == 1


def test_split_row_keeps_lengths_and_marks_this_ranks_tokens():
    row = packed_rows(ROWS)
    local = split_row_for_cp(row, 1, 2)
    assert torch.equal(local["lengths"], row["lengths"])
    assert local["input_ids"].shape == (2, 40) and local["token_index"].tolist()[:2] == [20, 21]
    assert torch.equal(local["valid"], local["token_index"][None, :] < row["lengths"][:, None])
    assert bool((local["segment_ids"][~local["valid"]] == -1).all())
    assert not bool(local["loss_mask"][~local["valid"]].any())
    with pytest.raises(ValueError, match="not per token"):
        split_row_for_cp({**row, "advantages": torch.zeros(2)}, 0, 2)
