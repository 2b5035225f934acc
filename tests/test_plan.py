"""``primerl plan``: the analytical parameter count equals the built models', the GLM-5
acceptance case of the issue, the JSON shape, and one-line errors for bad layouts."""

import json
import subprocess
import sys

import pytest
from conftest import run_cli

from primerl.plan import GB, Cluster, Layout, load_shape, memory, plan
from primerl.registry import get_registry

MODELS = ("glm5", "kimi", "nemotron", "qwen3-moe", "qwen3", "minimax", "llama")


def _adapter(name):
    return get_registry().load("model", name)()


def _small_presets():
    """Every installed model preset that can be built on a CPU (all but ``full``)."""
    return [(m, p) for m in MODELS for p in _adapter(m).presets if p != "full"]


def _check_counts(adapter, hf, model):
    """The planner's count of ``hf`` against the model built from it: total, experts,
    buffers, and every decoder layer on its own."""
    shape = adapter.shape(hf)
    assert shape.params == sum(p.numel() for p in model.parameters())
    assert shape.buffers == sum(b.numel() for b in model.buffers())
    assert shape.expert_params_total == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    built_layers = model.model.layers
    assert len(shape.layers) == len(built_layers)
    for planned, built in zip(shape.layers, built_layers, strict=True):
        assert planned.params == sum(p.numel() for p in built.parameters()), f"layer {planned.index}"
    assert shape.embed == model.input_embeddings().weight.numel()


@pytest.mark.parametrize(("name", "preset"), _small_presets())
def test_param_count_equals_the_built_tiny_model(name, preset):
    adapter = _adapter(name)
    hf = adapter.hf_config(preset)
    _check_counts(adapter, hf, adapter.build_from_hf(hf, seed=None))


# Variants the presets do not cover: tied embeddings, MLA without the query LoRA,
# attention and MLP biases, Nemotron's relu2 MLP layers and latent MoE projections.
VARIANTS = {
    "glm5": {"tie_word_embeddings": True, "attention_bias": True},
    "kimi": {"q_lora_rank": None, "tie_word_embeddings": True},
    "qwen3-moe": {"attention_bias": True, "tie_word_embeddings": True, "mlp_only_layers": [0, 2]},
    "qwen3": {"attention_bias": True, "tie_word_embeddings": True, "head_dim": 48},
    "llama": {"attention_bias": True, "mlp_bias": True, "tie_word_embeddings": True},
    "minimax": {"tie_word_embeddings": True, "num_key_value_heads": 4, "rotary_dim": 32},
    "nemotron": {
        "layers_block_type": ["linear_attention", "moe", "full_attention", "mlp", "linear_attention", "moe"],
        "moe_latent_size": 64, "use_bias": True, "mlp_bias": True, "attention_bias": True,
        "use_conv_bias": False, "tie_word_embeddings": True,
    },
}


@pytest.mark.parametrize("name", MODELS)
def test_param_count_equals_the_built_model_for_config_variants(name):
    adapter = _adapter(name)
    hf = {**adapter.hf_config("tiny"), **VARIANTS[name]}
    _check_counts(adapter, hf, adapter.build_from_hf(hf, seed=None))


# Published sizes (model cards): GLM-5 744B / 40B active, Kimi K2 1T / 32B, Qwen3-30B-A3B
# 30.5B / 3.3B, Nemotron 3 Nano 31.6B / 3.2B (3.6B with embeddings), Qwen3-32B 32.8B (dense),
# MiniMax-M2 230B / 10B, Llama 3.1 405B (dense).
PUBLISHED = {
    "glm5": ((740e9, 748e9), (38e9, 44e9)),
    "kimi": ((1.0e12, 1.05e12), (31e9, 34e9)),
    "qwen3-moe": ((30.0e9, 31.0e9), (3.2e9, 3.5e9)),
    "nemotron": ((31.0e9, 32.0e9), (3.4e9, 3.8e9)),
    "qwen3": ((32.5e9, 33.0e9), (32.5e9, 33.0e9)),
    "llama": ((405e9, 406.5e9), (405e9, 406.5e9)),
    "minimax": ((228e9, 231e9), (9.5e9, 11.5e9)),
}


@pytest.mark.parametrize(("preset", "billions"), [("0.6b", 0.6), ("8b", 8.2)])
def test_qwen3_presets_count_their_published_sizes(preset, billions):
    assert abs(load_shape("qwen3", preset).params / 1e9 - billions) < 0.05


@pytest.mark.parametrize(("preset", "billions"), [("135m", 0.135), ("1b", 1.24), ("8b", 8.03)])
def test_llama_presets_count_their_published_sizes(preset, billions):
    assert abs(load_shape("llama", preset).params / 1e9 - billions) < 0.01 * max(billions, 1)


@pytest.mark.parametrize("name", MODELS)
def test_full_presets_count_the_published_sizes(name):
    shape = load_shape(name, "full")
    (lo, hi), (alo, ahi) = PUBLISHED[name]
    assert lo <= shape.params <= hi
    assert alo <= shape.active_params <= ahi


def test_glm5_mtp_layer_is_counted_apart():
    shape = load_shape("glm5", "full")
    assert shape.mtp_layers == 1
    moe_layer = next(layer for layer in shape.layers if layer.mlp == "moe")
    assert shape.mtp_params > moe_layer.params  # a decoder layer plus eh_proj and norms


REPORT_KEYS = {
    "model", "preset", "model_type", "nodes", "gpus_per_node", "world_size", "seq_len", "micro_batch_rows", "fp8",
    "params", "layout", "layout_source", "per_gpu_bytes", "per_gpu_gb", "layer_allgather_gb_fp32",
    "layer_allgather_gb_bf16", "largest_layer", "gpu_memory_gb", "margin", "usable_gb", "fits", "comm_seconds_per_row",
    "suggested", "assumptions",
}
COMPONENTS = ["parameters", "gradients", "optimizer", "activations", "allgather_buffers", "total"]


def test_glm5_full_on_28_nodes_acceptance():
    r = run_cli("plan", "--model", "glm5", "--preset", "full", "--nodes", "28", "--gpus-per-node", "8",
                "--seq-len", "131072", "--json")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip().splitlines()) == 1
    report = json.loads(r.stdout)
    assert set(report) == REPORT_KEYS
    assert 30 <= report["layer_allgather_gb_fp32"] <= 50  # "about 40 GB" in the seed article
    suggested = report["suggested"]
    assert suggested["fits"] is True and suggested["total_gb"] <= report["usable_gb"]
    assert set(suggested) == {"layout", "per_gpu_gb", "total_gb", "fits", "comm_seconds_per_row", "why"}
    lay = suggested["layout"]
    assert lay["dp_replicate"] * lay["dp_shard"] * lay["cp"] == 224
    assert 256 % lay["ep"] == 0 and (lay["dp_shard"] * lay["cp"]) % lay["ep"] == 0
    # no layout flag: the report plans the suggested layout
    assert report["layout_source"] == "suggested" and report["layout"] == lay and report["fits"] is True
    assert list(report["per_gpu_bytes"]) == COMPONENTS and list(report["per_gpu_gb"]) == COMPONENTS
    b = report["per_gpu_bytes"]
    assert abs(sum(b[k] for k in COMPONENTS[:-1]) - b["total"]) <= len(COMPONENTS)
    # FSDP2 gathers the layer in bf16, only this rank's experts
    assert report["layer_allgather_gb_bf16"] < report["layer_allgather_gb_fp32"] / 2
    assert report["params"]["mtp_layers_skipped"] == 1
    assert any("checkpointing" in a for a in report["assumptions"])


@pytest.mark.parametrize(("name", "seq_len"), [("glm5", 131072), ("kimi", 131072), ("qwen3-moe", 131072),
                                               ("nemotron", 32768)])
def test_every_full_preset_gets_a_layout_that_fits_on_28_nodes(name, seq_len):
    report = plan(name, "full", nodes=28, gpus_per_node=8, seq_len=seq_len)
    assert report["suggested"]["fits"] is True
    assert report["fits"] is True


def test_nemotron_plans_without_context_parallel():
    """Mamba-2 layers cannot be split over cp: a 128k row's full-vocabulary logits alone
    (131072 x 131072 x 8 bytes) then leave no layout that fits, and the report says so."""
    report = plan("nemotron", "full", nodes=28, gpus_per_node=8, seq_len=131072)
    assert report["layout"]["cp"] == 1
    assert report["suggested"]["fits"] is False and report["fits"] is False
    assert report["suggested"]["why"].startswith("nothing fits")


@pytest.mark.parametrize(("name", "preset"), [(m, p) for m in MODELS for p in _adapter(m).presets])
def test_every_preset_plans(name, preset):
    report = plan(name, preset, nodes=1, gpus_per_node=8, seq_len=4096)
    assert set(report) == REPORT_KEYS
    assert report["per_gpu_bytes"]["total"] > 0
    assert report["params"]["total"] == load_shape(name, preset).params


def test_layout_flags_are_planned_as_given():
    report = plan("glm5", "full", nodes=28, gpus_per_node=8, seq_len=131072, dp_shard=56, cp=4, ep=8)
    assert report["layout_source"] == "flags"
    assert report["layout"] == {"dp_replicate": 1, "dp_shard": 56, "cp": 4, "ep": 8}
    # --dp-shard left out fills the GPUs the others leave
    report = plan("glm5", "full", nodes=28, gpus_per_node=8, seq_len=131072, cp=8, ep=16)
    assert report["layout"] == {"dp_replicate": 1, "dp_shard": 28, "cp": 8, "ep": 16}


def test_memory_follows_the_layout():
    shape = load_shape("glm5", "full", 131072)
    base = memory(shape, Layout(1, 28, 8, 8), 131072)
    # every parameter is sharded over dp_shard x cp whatever ep is; ep shrinks the gather
    wide_ep = memory(shape, Layout(1, 28, 8, 32), 131072)
    assert wide_ep["optimizer"] == pytest.approx(base["optimizer"]) == pytest.approx(8 * shape.params / 224)
    assert wide_ep["allgather_buffers"] < base["allgather_buffers"]
    # replicas hold the same shard: twice the state per GPU
    assert memory(shape, Layout(2, 14, 8, 8), 131072)["optimizer"] == pytest.approx(2 * base["optimizer"])
    # splitting rows over more GPUs shrinks activations; more rows per micro-batch grow them
    assert memory(shape, Layout(1, 14, 16, 8), 131072)["activations"] < base["activations"]
    assert memory(shape, Layout(1, 28, 8, 8), 131072, rows=2)["activations"] > 1.9 * base["activations"]
    assert memory(shape, Layout(1, 28, 8, 8), 131072, fp8=True)["activations"] <= base["activations"]
    assert Cluster(28, 8).usable_bytes == pytest.approx(0.9 * 141 * GB)


@pytest.mark.parametrize(("args", "flag"), [
    (["--model", "nosuch"], "--model"),
    (["--model", "glm5", "--preset", "huge"], "--preset"),
    (["--model", "glm5", "--dp-shard", "100"], "--dp-shard"),
    (["--model", "glm5", "--ep", "3"], "--ep 3"),
    (["--model", "glm5", "--cp", "3"], "--cp 3"),
    (["--model", "glm5", "--nodes", "0"], "--nodes"),
    (["--model", "nemotron", "--cp", "2"], "--cp 2"),
])
def test_bad_input_is_one_line_exit_2(args, flag):
    base = {"--nodes": "28", "--seq-len": "131072"}
    for key, value in zip(args[::2], args[1::2], strict=True):
        base[key] = value
    r = run_cli("plan", *[x for kv in base.items() for x in kv], "--json")
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], r.stderr


def test_plan_imports_no_torch():
    code = (
        "import sys\n"
        "from primerl.cli import app\n"
        "app(args=['plan', '--model', 'glm5', '--nodes', '28', '--seq-len', '131072', '--json'], "
        "standalone_mode=False)\n"
        "heavy = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_table_output_states_the_verdict_and_assumptions():
    r = run_cli("plan", "--model", "kimi", "--nodes", "28", "--seq-len", "131072")
    assert r.returncode == 0, r.stderr
    for text in ("per GPU", "fits", "suggested:", "assumptions:", "optimizer", "allgather buffers"):
        assert text in r.stdout
