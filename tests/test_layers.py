"""The tree's seams, checked on the source: roles import only downward and no built-in plugin
imports another plugin's package.

Roles are the processes of a run: the orchestrator (``primerl.orchestrator``), the trainer
(``primerl.trainer``) and inference (the inference backend plugins). What two of them share
lives below them in the core (``primerl.inference``, ``primerl.models``, ``primerl.serving``,
``primerl.algorithms``, ...), never in one of them. Plugins share through the core too: a
plugin imports ``primerl`` and its own package, nothing of another plugin; the one
exception is a library distribution under ``plugins/`` (one without entry points: the
model building blocks, ``primerl_blocks``), which the plugins that build on it import and
the core never does.
"""

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "core" / "primerl"
PLUGINS = REPO / "plugins"


def imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute import of a file (inside functions too): (line, module)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def plugin_packages() -> dict[str, Path]:
    """Every built-in plugin's (and library's) top-level package: name -> folder."""
    return {p.name: p for p in sorted(PLUGINS.glob("*/*/primerl_*")) if p.is_dir()}


def library_packages() -> dict[str, Path]:
    """The packages under ``plugins/`` whose distribution registers no entry point: libraries
    that plugins build on (the model building blocks), not plugins."""
    return {name: path for name, path in plugin_packages().items() if (path / "__init__.py").is_file()
            and "[project.entry-points" not in (path.parent / "pyproject.toml").read_text()}


def test_roles_import_only_downward():
    inference = [name for name, path in plugin_packages().items() if path.parent.parent.name == "inference"]
    roles = {"orchestrator": ["primerl.orchestrator"], "trainer": ["primerl.trainer"],
             "inference": inference}
    files = {"orchestrator": sorted((CORE / "orchestrator").rglob("*.py")),
             "trainer": sorted((CORE / "trainer").rglob("*.py")),
             "inference": sorted(f for name in inference for f in plugin_packages()[name].rglob("*.py"))}
    assert files["orchestrator"] and files["trainer"] and len(inference) >= 2
    wrong = []
    for role, paths in files.items():
        others = [m for r, mods in roles.items() if r != role for m in mods]
        for path in paths:
            for line, module in imports(path):
                if any(module == o or module.startswith(o + ".") for o in others):
                    wrong.append(f"{path.relative_to(REPO)}:{line} ({role}) imports {module}")
    assert wrong == []


def test_no_built_in_plugin_imports_another_plugins_package():
    packages, libraries = plugin_packages(), library_packages()
    assert len(packages) >= 20 and set(libraries) == {"primerl_blocks"}
    wrong = []
    for name, folder in packages.items():
        for path in sorted(folder.rglob("*.py")):
            for line, module in imports(path):
                top = module.split(".")[0]
                if top in packages and top != name and top not in libraries:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert wrong == []


def test_the_core_imports_no_plugin_or_library_package():
    """The core owns the contracts (the model contract included); what the plugins build
    with (``primerl_blocks``) and the plugins themselves stay outside it."""
    packages = plugin_packages()
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}" for path in sorted(CORE.rglob("*.py"))
             for line, module in imports(path) if module.split(".")[0] in packages]
    assert wrong == []


def test_every_model_plugin_that_imports_the_blocks_declares_them():
    """A model plugin importing ``primerl_blocks`` lists ``primerl-model-blocks`` among its
    dependencies (pip installs it with the plugin), and requirements.txt installs the blocks
    before the model plugins."""
    users = []
    for name, folder in plugin_packages().items():
        if any(m.split(".")[0] == "primerl_blocks" for f in folder.rglob("*.py") for _, m in imports(f)) \
                and name != "primerl_blocks":
            users.append(name)
            assert '"primerl-model-blocks"' in (folder.parent / "pyproject.toml").read_text(), name
    assert len(users) >= 7
    lines = [ln.strip() for ln in (REPO / "requirements.txt").read_text().splitlines()]
    first_model = next(i for i, ln in enumerate(lines) if ln.startswith("-e ./plugins/models/") and "common" not in ln)
    assert lines.index("-e ./plugins/models/common") < first_model


def test_the_check_sees_what_it_checks(tmp_path):
    """The scanner reads imports inside functions and from-imports alike (else the tests above
    could pass on a tree full of violations)."""
    f = tmp_path / "m.py"
    f.write_text("import primerl_a\nfrom primerl.trainer import loss\n\ndef f():\n    from primerl_b.x import y\n")
    assert imports(f) == [(1, "primerl_a"), (2, "primerl.trainer"), (5, "primerl_b.x")]


# What a plugin offers is declared (its kind's Protocol, or the capabilities record it registers
# with), never found by probing: these are the members the core and the plugins rely on.
DECLARED = {"servers_up", "headers", "weight_sender", "current_weights_only", "supports_prefix_reuse", "on_evict",
            "shared", "blocks", "dry_run", "trainer_nodes", "run_defaults", "routed_experts_on", "resolved_api_key",
            "episode_timeout_s", "close", "disaggregated", "router_options", "vllm_port", "role", "handoff_blocks"}
# config keys whose value names a plugin (``inference.backend = "vllm"``)
SELECTING = ("backend", "router", "kv_store", "parallelism", "resolved_parallelism", "launcher", "loss", "advantage")


def _where(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def probes(path: Path) -> list[str]:
    """getattr/hasattr calls naming a declared member."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in DECLARED):
            out.append(f"{_where(path)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return out


def plugin_names() -> set[str]:
    """The names the built-in plugins register."""
    import re

    names = set()
    for path in PLUGINS.glob("*/*/primerl_*/plugin.py"):
        names |= set(re.findall(r'register\(\s*"([^"]+)"', path.read_text()))
    return names | {"default", "grpo", "grpo_std"}  # the core's own plugin


def name_compares(path: Path, names: set[str]) -> list[str]:
    """Comparisons of a plugin-selecting config value with a built-in plugin's name."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        text = " ".join(ast.unparse(o) for o in operands)
        if not any(f".{key}" in text or f"{key}(" in text for key in SELECTING):
            continue
        for o in operands:
            elts = o.elts if isinstance(o, ast.Tuple | ast.List | ast.Set) else [o]
            hit = [e.value for e in elts if isinstance(e, ast.Constant) and e.value in names]
            if hit:
                out.append(f"{_where(path)}:{node.lineno} {ast.unparse(node)}")
    return out


def test_no_declared_capability_is_probed_by_name():
    paths = sorted(CORE.rglob("*.py")) + sorted(f for p in plugin_packages().values() for f in p.rglob("*.py"))
    assert [hit for path in paths for hit in probes(path)] == []


def test_the_core_compares_no_built_in_plugin_name():
    names = plugin_names()
    assert {"vllm", "local", "slurm", "memory", "fsdp"} <= names
    assert [hit for path in sorted(CORE.rglob("*.py")) for hit in name_compares(path, names)] == []


def model_types() -> set[str]:
    """Every HF ``model_type`` a built-in model plugin implements (what the core must not branch on)."""
    from primerl.registry import get_registry

    return {t for c in get_registry().of_kind("model") if c.error is None and (c.distribution or "").startswith("primerl")
            for t in c.load().model_types}


def architecture_strings(path: Path, types: set[str]) -> list[str]:
    """String constants in code (not docstrings) naming an architecture's ``model_type``, and
    tests of a key only one architecture's HF config has (``"kv_lora_rank" in hf``): either
    would make the core plan or check a model by what it is."""
    keys = {"kv_lora_rank", "index_topk", "hybrid_override_pattern", "layers_block_type", "mamba_num_heads"}
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree) if isinstance(n, ast.Module | ast.ClassDef | ast.FunctionDef)
            and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    tested = {id(o) for n in ast.walk(tree) if isinstance(n, ast.Compare) for o in (n.left, *n.comparators)}
    return [f"{_where(path)}:{n.lineno} {n.value!r}" for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and id(n) not in docs and isinstance(n.value, str)
            and (n.value in types or n.value.startswith(tuple(t + "." for t in types))
                 or (n.value in keys and id(n) in tested))]


def test_the_core_names_no_architecture_outside_its_model_library():
    """Planning and config checks ask the model plugin (ModelAdapter.shape, .capabilities);
    only primerl.models (the building blocks the plugins assemble) knows architectures."""
    types = model_types()
    assert {"glm_moe_dsa", "deepseek_v3", "nemotron_h", "qwen3_moe"} <= types
    paths = [p for p in sorted(CORE.rglob("*.py")) if not p.is_relative_to(CORE / "models")]
    assert [hit for path in paths for hit in architecture_strings(path, types)] == []


def test_the_seam_checks_see_what_they_check(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('if cfg.inference.backend == "vllm" or t.resolved_parallelism() in ("fsdp",):\n'
                 '    x = getattr(router, "servers_up", None)\n')
    assert len(name_compares(f, {"vllm", "fsdp"})) == 2 and len(probes(f)) == 1
    g = tmp_path / "g.py"
    g.write_text('"""nemotron_h"""\nmamba = hf.get("model_type") == "nemotron_h"\nmla = "kv_lora_rank" in hf\nr = hf["kv_lora_rank"]\n')
    assert [h.split(" ", 1)[1] for h in architecture_strings(g, {"nemotron_h"})] == ["'nemotron_h'", "'kv_lora_rank'"]


# the environment variables a user sets (the API key is a secret; the plugin lists and the
# thread count act before any config is read); every other setting is a typed config key
ALLOWED_ENV = {"PRIMERL_API_KEY", "PRIMERL_PLUGINS", "PRIMERL_DISABLE_PLUGINS", "PRIMERL_THREADS"}


def test_no_primerl_variable_but_the_allowed_ones_is_read_or_set():
    import re

    named = {}
    for path in [*sorted(CORE.rglob("*.py")), *sorted(f for p in plugin_packages().values() for f in p.rglob("*"))]:
        if path.is_file() and path.suffix in (".py", ".sh", ".toml", ""):
            for name in re.findall(r"PRIMERL_[A-Z0-9_]*[A-Z0-9]", path.read_text(errors="replace")):
                named.setdefault(name, str(path.relative_to(REPO)))
    assert {n: where for n, where in named.items() if n not in ALLOWED_ENV} == {}
    assert "PRIMERL_API_KEY" in named and "PRIMERL_THREADS" in named  # the scan reads what it should


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, whitespace-normalized text) of a file's code lines: no blank or comment
    lines, no imports, no bare brackets."""
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        text = " ".join(line.split())
        if text and not text.startswith(("#", "import ", "from ")) and text not in (")", "]", "}", "):", '"""'):
            out.append((n, text))
    return out


def repeated_runs(a: list[Path], b: list[Path], size: int = 6) -> list[str]:
    """Runs of ``size`` identical code lines found both in a file of ``a`` and one of ``b``."""
    seen: dict[tuple[str, ...], str] = {}
    for path in a:
        lines = _code_lines(path)
        for i in range(len(lines) - size + 1):
            seen.setdefault(tuple(t for _, t in lines[i:i + size]), f"{_where(path)}:{lines[i][0]}")
    hits = []
    for path in b:
        lines = _code_lines(path)
        for i in range(len(lines) - size + 1):
            key = tuple(t for _, t in lines[i:i + size])
            if key in seen:
                hits.append(f"{seen[key]} ~ {_where(path)}:{lines[i][0]}")
    return hits


def test_the_two_inference_backends_repeat_no_block_of_six_lines():
    """The serving front is written once (primerl.serving.front): each backend is only its
    generator."""
    embedded = sorted((PLUGINS / "inference" / "embedded").rglob("*.py"))
    vllm = sorted((PLUGINS / "inference" / "vllm").rglob("*.py"))
    assert embedded and vllm
    assert repeated_runs(embedded, vllm) == []


def test_the_repeat_check_finds_a_repeat(tmp_path):
    body = "".join(f"x{i} = compute({i}, 'a')\n" for i in range(7))
    (tmp_path / "a.py").write_text("def f():\n" + body)
    (tmp_path / "b.py").write_text("import os\n\n" + body)
    assert len(repeated_runs([tmp_path / "a.py"], [tmp_path / "b.py"])) == 2


# ---------------------------------------------------------------------------------------
# The model contract (primerl.models.contract): declared, never probed
# ---------------------------------------------------------------------------------------

# what a model declares beside its Protocol members: its plan's parts (routers, experts, the
# correction bias, the head), which used to be found by attribute or class
MODEL_PARTS = {"e_score_correction_bias", "is_moe", "lm_head", "get_output_embeddings", "experts", "gate",
               "mixer_kind", "moe_plan", "layer_plan", "bias_name", "ep_sharded", "inv_freq"}


# members whose names other kinds use too (a plugin's ``Config`` class, a config's ``device``)
GENERIC = {"Config", "config", "dtype", "device", "forward"}


def model_contract_names() -> set[str]:
    """Every member of the model contract's Protocols (but the generic names), and the parts
    a model's plan declares."""
    from primerl.models.contract import CausalLM, HFCausalLM, protocol_members

    return (set(protocol_members(CausalLM)) | set(protocol_members(HFCausalLM)) | MODEL_PARTS) - GENERIC


def model_probes(path: Path, names: set[str]) -> list[str]:
    """getattr/hasattr calls naming a member of the model contract."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in names):
            out.append(f"{_where(path)}:{node.lineno} {node.func.id}(..., {node.args[1].value!r})")
    return out


def test_no_caller_probes_the_model_for_what_the_contract_declares():
    """The trainer, the engine, the parallelisms, LoRA and FP8 call the model's declared
    members (``CausalLM``) and read its plan; none asks ``hasattr(model, "parallel_plan")``
    or finds routers by ``hasattr(m, "e_score_correction_bias")``."""
    names = model_contract_names()
    assert {"parallel_plan", "unpack_segments", "moe_layers", "new_cache", "cache_layout", "vocab_size"} <= names
    paths = sorted(CORE.rglob("*.py")) + sorted(f for p in plugin_packages().values() for f in p.rglob("*.py"))
    assert [hit for path in paths for hit in model_probes(path, names)] == []


def test_the_model_probe_check_sees_what_it_checks(tmp_path):
    f = tmp_path / "m.py"
    f.write_text('plan = model.parallel_plan() if hasattr(model, "parallel_plan") else {}\n'
                 'cp = getattr(module, "unpack_segments", True)\n'
                 'routers = [m for m in model.modules() if hasattr(m, "e_score_correction_bias")]\n')
    assert len(model_probes(f, model_contract_names())) == 3


def test_every_built_in_model_satisfies_the_causal_lm_protocol(tmp_path):
    """Every model plugin's tiny preset (and ``hf`` on a tiny transformers checkpoint) is a
    ``CausalLM`` whose plan is consistent with itself: its units, routers and experts are
    modules of the model, its biases buffers, its MoE layers the model's."""
    import torch
    import transformers

    from primerl.models import ModelConfig
    from primerl.models.contract import CausalLM, HFCausalLM, ParallelPlan, check_causal_lm
    from primerl.registry import get_registry

    reg = get_registry()
    checked = []
    for component in reg.of_kind("model"):
        if component.error is not None or not (component.distribution or "").startswith("primerl"):
            continue
        adapter = component.load()()
        if component.name == "hf":
            hf_dir = tmp_path / "llama"
            cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                           num_attention_heads=2, num_key_value_heads=1)
            torch.manual_seed(0)
            transformers.LlamaForCausalLM(cfg).save_pretrained(hf_dir)
            model = adapter.build(ModelConfig(name="hf", checkpoint=str(hf_dir)))
        else:
            model = adapter.build(ModelConfig(name=component.name, preset="tiny"))
            assert isinstance(model, HFCausalLM), component.name
        assert isinstance(model, torch.nn.Module) and isinstance(model, CausalLM), component.name
        assert isinstance(model.parallel_plan(), ParallelPlan), component.name
        assert check_causal_lm(model) == [], component.name
        checked.append(component.name)
    assert {"glm5", "kimi", "nemotron", "qwen3-moe", "minimax", "qwen3", "llama", "hf"} <= set(checked)


def test_the_structural_check_names_what_a_model_lacks():
    import torch

    from primerl.models.contract import CausalLM, check_causal_lm

    bare = torch.nn.Linear(2, 2)
    assert not isinstance(bare, CausalLM)
    assert "parallel_plan" in check_causal_lm(bare)[0] and "moe_layers" in check_causal_lm(bare)[0]


# modules that are contracts (what plugins code against) or the core's model transforms
CONTRACT_MODULES = ["models/__init__.py", "models/contract.py", "models/experts.py", "models/batch.py",
                    "models/tensors.py", "models/checkpoint.py", "models/fp8.py", "models/fp8_matmul.py", "lora.py"]


def declares_all(path: Path) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in n.targets)
               for n in tree.body)


def test_every_model_contract_module_and_block_declares_all():
    paths = [CORE / m for m in CONTRACT_MODULES]
    paths += [p for p in sorted((PLUGINS / "models" / "common" / "primerl_blocks").glob("*.py"))
              if p.name != "__init__.py"]
    assert len(paths) >= 15
    assert [str(p.relative_to(REPO)) for p in paths if not declares_all(p)] == []


def test_the_model_contract_is_written_down():
    """docs/models.md ("The model contract") names every member of ``CausalLM`` and
    ``HFCausalLM`` and every field of the plan."""
    import re

    import attrs

    from primerl.models.contract import CausalLM, HFCausalLM, LayerPlan, MoEPlan, ParallelPlan, protocol_members

    text = (REPO / "docs" / "models.md").read_text()
    section = text.split("## The model contract", 1)[1].split("\n## ", 1)[0]
    names = set(protocol_members(CausalLM)) | set(protocol_members(HFCausalLM))
    names |= {f.name for cls in (ParallelPlan, LayerPlan, MoEPlan) for f in attrs.fields(cls)}
    names |= {"fsdp_units", "routers", "experts", "router_biases", "moe_layers"}
    assert sorted(n for n in names if not re.search(rf"\b{n}\b", section)) == []
