"""LoRA (``[trainer.lora]``): what trains, what inference gets, what a checkpoint holds.

The adapter a checkpoint holds is checked with PEFT itself: loaded by ``peft`` onto the
checkpoint's frozen weights in transformers, it gives the logits of primerl's merged model.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from primerl import lora
from primerl.errors import PrimerlError
from primerl.models import ModelConfig
from primerl.registry import get_registry
from primerl.trainer.optim import make_optimizer


def tiny(name="qwen3"):
    adapter = get_registry().load("model", name)()
    cfg = ModelConfig(name=name, preset="tiny", seed=0)
    return adapter, adapter.build(cfg), adapter.tokenizer(cfg)


def randomise_adapters(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith((".lora_B.weight", "_B")) and lora.is_adapter(n):
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)


def logits(model, ids):
    with torch.no_grad():
        return model(ids, torch.arange(ids.shape[1])[None], torch.tensor([ids.shape[1]])).logits


@pytest.mark.parametrize("name", ["qwen3", "glm5"])
def test_only_the_adapters_train_and_the_model_starts_unchanged(name):
    _, model, _ = tiny(name)
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    before = logits(model, ids)
    wrapped = lora.apply_lora(model, rank=4, alpha=8)
    assert wrapped and not any(n.endswith(".gate") for n in wrapped)
    assert ("lm_head" in wrapped) == (not model.config.tie_word_embeddings)  # the head too, unless tied
    torch.testing.assert_close(logits(model, ids), before, atol=1e-5, rtol=0)  # B = 0 (MLA: unfolded, other rounding)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(lora.is_adapter(n) for n in trainable)
    opt = make_optimizer(model, 1e-3, 0.0)
    in_optimizer = {id(p) for g in opt.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for n, p in model.named_parameters() if n in trainable}
    out = model(ids, torch.arange(24)[None], torch.tensor([24])).logits.logsumexp(-1).sum()
    out.backward()
    got = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got <= trainable and len(got) >= len(trainable) // 2  # (GLM-5's DSA indexer gets no gradient)


def test_a_head_tied_to_the_embeddings_is_left_out_and_refused_when_named():
    adapter = get_registry().load("model", "qwen3")()
    hf = {**adapter.hf_config("tiny"), "tie_word_embeddings": True}
    model = adapter.build_from_hf(hf, seed=0)
    assert "lm_head" not in lora.apply_lora(model, rank=4, alpha=8)
    model = adapter.build_from_hf(hf, seed=0)
    with pytest.raises(PrimerlError, match="tied to the input embeddings: leave it out"):
        lora.apply_lora(model, rank=4, alpha=8, target_modules=["q_proj", "lm_head"])


@pytest.mark.parametrize("name,targets", [("qwen3", ["q_proj", "v_proj", "down_proj"]), ("qwen3-moe", [])])
def test_merged_weights_compute_what_the_adapted_model_does(name, targets):
    """Linears and (qwen3-moe) routed experts: the merged weights give the adapted logits."""
    adapter, model, _ = tiny(name)
    wrapped = lora.apply_lora(model, rank=4, alpha=8, target_modules=targets)
    assert (name == "qwen3-moe") == any(n.endswith(".experts") for n in wrapped)
    randomise_adapters(model)
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(1))
    ((_, state),) = list(lora.merged(iter([("all", dict(model.state_dict()))]), scale=8 / 4))
    assert not any(lora.is_adapter(n) for n in state)
    _, plain, _ = tiny(name)
    plain.load_state_dict(state)
    torch.testing.assert_close(logits(plain, ids), logits(model, ids), atol=1e-5, rtol=0)


def test_target_modules_that_select_nothing_are_refused():
    _, model, _ = tiny()
    with pytest.raises(PrimerlError, match="selects no linear layer"):
        lora.apply_lora(model, rank=4, alpha=8, target_modules=["qkv"])


@pytest.mark.parametrize("name,targets", [("qwen3", []), ("qwen3-moe", ["q_proj", "o_proj", "experts"])])
def test_the_checkpointed_adapter_loads_with_peft_and_gives_the_merged_model_logits(name, targets, tmp_path):
    """The frozen weights as an HF checkpoint plus adapter/ (PEFT's format; qwen3-moe's routed
    experts as PEFT's target_parameters): transformers + peft give primerl's logits (1e-5,
    float32); a resume loads the adapter back."""
    peft = pytest.importorskip("peft")
    adapter, model, tok = tiny(name)
    lora.apply_lora(model, rank=4, alpha=8, target_modules=targets)
    randomise_adapters(model)
    split = lora.Split(iter([("all", dict(model.state_dict()))]))
    adapter.save_checkpoint(model, tmp_path, tok, state=split.base())
    lora.write_peft_adapter(tmp_path / lora.ADAPTER_DIR, split.adapters, rank=4, alpha=8, base_model=str(tmp_path))
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(2))
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / lora.ADAPTER_DIR).eval()
    with torch.no_grad():
        theirs = with_adapter(input_ids=ids).logits
    torch.testing.assert_close(theirs, logits(model, ids), atol=1e-5, rtol=0)

    _, resumed, _ = tiny(name)
    adapter.load_checkpoint(resumed, tmp_path)
    lora.apply_lora(resumed, rank=4, alpha=8, target_modules=targets)
    lora.load_adapter(resumed, tmp_path / lora.ADAPTER_DIR)
    torch.testing.assert_close(logits(resumed, ids), logits(model, ids), atol=0, rtol=0)
    _, other, _ = tiny(name)
    lora.apply_lora(other, rank=2, alpha=8, target_modules=targets)
    with pytest.raises(PrimerlError, match="does not fit this run's LoRA layers"):
        lora.load_adapter(other, tmp_path / lora.ADAPTER_DIR)


def test_the_experts_alone_can_be_adapted():
    _, model, _ = tiny("qwen3-moe")
    wrapped = lora.apply_lora(model, rank=2, alpha=4, target_modules=["experts"])
    assert wrapped and all(n.endswith(".experts") for n in wrapped)
    assert {n.rsplit(".", 1)[-1] for n, p in model.named_parameters() if p.requires_grad} == {
        "lora_gate_up_proj_A", "lora_gate_up_proj_B", "lora_down_proj_A", "lora_down_proj_B"}
