"""The ``primerl`` command line.

Fast by design: this module imports only typer, rich and the light core. Commands that
do heavy work import their implementation inside the command function, so
``primerl --help`` and ``primerl plugins list`` never load torch.

User errors (:class:`primerl.errors.PrimerlError`) are printed as one clear message and
exit with code 2, without a traceback.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from primerl.errors import PrimerlError

app = typer.Typer(
    name="primerl",
    help="Asynchronous RL post-training for large MoE models, built from plugins.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
plugins_app = typer.Typer(help="List and inspect installed plugins.", no_args_is_help=True)
models_app = typer.Typer(help="Inspect model plugins and their presets.", no_args_is_help=True)
app.add_typer(plugins_app, name="plugins")
env_app = typer.Typer(help="Inspect and validate environments.", no_args_is_help=True)
app.add_typer(models_app, name="models")
app.add_typer(env_app, name="env")

# piped output (CI logs, `| less`) gets a wide table instead of 80 folded columns
console = Console(width=None if sys.stdout.isatty() else 240)
err_console = Console(stderr=True)

CONFIG_ARGS = {"allow_extra_args": True, "ignore_unknown_options": True}
CONFIG_HELP = (
    "Config files and overrides follow the options: '@ a.toml @ b.toml' merge left to right, "
    "then '--section.key value' overrides, e.g. '--trainer.lr 3e-4 --orchestrator.async_level 2'."
)


# --------------------------------------------------------------------------------------
# plugins
# --------------------------------------------------------------------------------------


@plugins_app.command("list")
def plugins_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list instead of a table."),
) -> None:
    """Every registered component, with the plugin and distribution providing it."""
    from primerl.registry import get_registry

    rows = [c.as_row() for c in get_registry().components]
    rows.sort(key=lambda r: (r["kind"] or "", r["name"], r["plugin"]))
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    table = Table(title="primerl plugins")
    for col in ("kind", "name", "plugin", "distribution", "version", "status"):
        table.add_column(col, no_wrap=True)
    table.add_column("description", overflow="fold")
    for r in rows:
        status = "[green]ok[/]" if r["status"] == "ok" else "[red]error[/]"
        desc = escape(r["description"]) if r["status"] == "ok" else f"[red]{escape(r['error'] or '')}[/]"
        table.add_row(r["kind"] or "?", r["name"], r["plugin"], r["distribution"] or "-",
                      r["version"] or "-", status, desc)
    console.print(table)


@plugins_app.command("info")
def plugins_info(
    name: str = typer.Argument(..., help="A component name (glm5), or a plugin/distribution name."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Details of a component or plugin: target, module, status and error."""
    from primerl.registry import _normalize, get_registry, target_text

    key = _normalize(name)
    hits = [
        c for c in get_registry().components
        if c.name == name or key in {_normalize(c.plugin), _normalize(c.distribution or "")}
    ]
    if not hits:
        raise PrimerlError(f"no plugin or component named {name!r}; see 'primerl plugins list'")
    rows = []
    for c in hits:
        row = c.as_row()
        row["target"] = target_text(c.target)
        rows.append(row)
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    for row in rows:
        table = Table(show_header=False, title=f"{row['kind']} '{row['name']}'")
        for k, v in row.items():
            table.add_row(k, escape(str(v)) if v is not None else "-")
        console.print(table)


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------


@models_app.command("list")
def models_list(
    as_json: bool = typer.Option(False, "--json", help="Print a JSON object instead of tables."),
) -> None:
    """The installed model plugins (presets, HF model types, what each supports) and the
    checkpoints installed packages carry (--model.checkpoint NAME), with where each is
    found or how to install it."""
    from primerl.registry import get_registry

    reg = get_registry()
    models, checkpoints = [], []
    for c in sorted(reg.of_kind("model"), key=lambda c: c.name):
        row: dict[str, Any] = {"name": c.name, "plugin": c.plugin, "error": c.error}
        if c.error is None:
            try:
                import attrs

                adapter = c.load()
                row.update(presets=list(adapter.presets), model_types=list(adapter.model_types),
                           supports=[k for k, v in attrs.asdict(adapter.supports).items() if v])
            except Exception as exc:  # noqa: BLE001 - a broken plugin is a row, not a crash
                row["error"] = f"{type(exc).__name__}: {exc}"
        models.append(row)
    for c in sorted(reg.of_kind("checkpoint"), key=lambda c: c.name):
        row = {"name": c.name, "plugin": c.plugin, "description": c.description, "error": c.error}
        if c.error is None:
            try:
                from primerl.models.sources import packaged

                record = packaged(c.qualified_name if c.duplicate else c.name, reg)
                found = record.locate()
                row.update(model=record.model, distribution=record.distribution, installed=found is not None,
                           path=str(found) if found else None, install=record.install_hint())
            except PrimerlError as exc:
                row["error"] = str(exc)
        checkpoints.append(row)
    if as_json:
        typer.echo(json.dumps({"models": models, "checkpoints": checkpoints}, indent=2))
        return
    table = Table(title="model plugins (--model NAME)")
    for col in ("name", "presets", "HF model types", "supports"):
        table.add_column(col, overflow="fold")
    for r in models:
        if r["error"]:
            table.add_row(r["name"], f"[red]{escape(r['error'])}[/]", "", "")
        else:
            table.add_row(r["name"], ", ".join(r["presets"]) or "-", ", ".join(r["model_types"]) or "any",
                          ", ".join(r["supports"]) or "-")
    console.print(table)
    table = Table(title="packaged checkpoints (--model.checkpoint NAME)")
    for col in ("name", "model", "carried by", "installed", "description"):
        table.add_column(col, overflow="fold")
    for r in checkpoints:
        if r["error"]:
            table.add_row(r["name"], "", "", f"[red]{escape(r['error'])}[/]", "")
            continue
        where = escape(r["path"]) if r["installed"] else f"no: {escape(r['install'])}"
        table.add_row(r["name"], r["model"], r["distribution"], where, escape(r["description"]))
    console.print(table)


@models_app.command("show")
def models_show(
    name: str = typer.Argument(..., help="Model plugin name, e.g. glm5"),
    preset: str = typer.Option("tiny", "--preset", help="Preset name (tiny, full, ...)"),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Print the HF-style config of a model preset."""
    from primerl.registry import get_registry

    adapter = get_registry().load("model", name)()
    if preset not in adapter.presets:
        raise PrimerlError(f"model '{name}' has no preset '{preset}'; presets: {', '.join(adapter.presets)}")
    cfg = adapter.hf_config(preset)
    if as_json:
        typer.echo(json.dumps(cfg, indent=2, sort_keys=True))
    else:
        console.print_json(json.dumps(cfg, sort_keys=True))


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


@app.command("plan")
def plan_command(
    model: str = typer.Option(..., "--model", help="Model plugin, e.g. glm5"),
    preset: str = typer.Option("full", "--preset", help="Preset name (full, tiny, ...)."),
    nodes: int = typer.Option(1, "--nodes", help="Nodes of the trainer."),
    gpus_per_node: int = typer.Option(8, "--gpus-per-node", help="GPUs per node."),
    seq_len: int = typer.Option(..., "--seq-len", help="Tokens per packed row (trainer.seq_len)."),
    dp_replicate: int | None = typer.Option(None, "--dp-replicate", help="HSDP replicas (default 1)."),
    dp_shard: int | None = typer.Option(None, "--dp-shard", help="FSDP2 shards (default: the GPUs left)."),
    ep: int | None = typer.Option(None, "--ep", help="Expert parallel, carved out of dp_shard x cp (default 1)."),
    cp: int | None = typer.Option(None, "--cp", help="Context parallel: each row split over cp GPUs (default 1)."),
    micro_batch_rows: int = typer.Option(1, "--micro-batch-rows", help="Packed rows per forward."),
    fp8: bool = typer.Option(False, "--fp8", help="Block-FP8 matmuls (trainer.fp8)."),
    gpu_memory_gb: float = typer.Option(141.0, "--gpu-memory-gb", help="Memory of one GPU (H200: 141 GB)."),
    margin: float = typer.Option(0.10, "--margin", help="Fraction of GPU memory left for allocator/NCCL."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as one JSON line."),
) -> None:
    """Per-GPU memory of training a preset on a cluster (parameters, gradients, AdamW state,
    activations, all-gather buffers), whether it fits, and the layout to use. Without
    --dp-replicate/--dp-shard/--ep/--cp it plans the suggested layout."""
    from primerl.plan import plan

    report = plan(model, preset, nodes=nodes, gpus_per_node=gpus_per_node, seq_len=seq_len,
                  dp_replicate=dp_replicate, dp_shard=dp_shard, cp=cp, ep=ep, micro_batch_rows=micro_batch_rows,
                  fp8=fp8, gpu_memory_gb=gpu_memory_gb, margin=margin)
    if as_json:
        typer.echo(json.dumps(report))
        return
    p, lay = report["params"], report["layout"]
    b = 1e9
    console.print(f"[bold]{model}[/] ({preset}, {report['model_type']}) on {nodes} x {gpus_per_node} GPUs, "
                  f"{seq_len} tokens per row, {micro_batch_rows} row(s) per micro-batch"
                  f"{', fp8' if fp8 else ''}", highlight=False)
    mtp = (f"; {p['mtp_layers_skipped']} MTP layer(s), {p['mtp_params_skipped'] / b:.1f}B, not trained"
           if p["mtp_layers_skipped"] else "")
    console.print(f"parameters: {p['total'] / b:.1f}B ({p['routed_experts'] / b:.1f}B in routed experts, "
                  f"{p['active_per_token'] / b:.1f}B active per token){mtp}", highlight=False)
    console.print(f"layout ({report['layout_source']}): " + " ".join(f"{k}={v}" for k, v in lay.items()),
                  highlight=False)
    table = Table(title="per GPU")
    table.add_column("", no_wrap=True)
    table.add_column("GB", justify="right")
    table.add_column("bytes", justify="right")
    for key, gb in report["per_gpu_gb"].items():
        table.add_row(key.replace("_", " "), f"{gb:.2f}", f"{report['per_gpu_bytes'][key]:,}")
    console.print(table)
    verdict = "[green]fits[/]" if report["fits"] else "[red]does not fit[/]"
    console.print(f"{verdict}: {report['per_gpu_gb']['total']:.1f} GB of {report['usable_gb']:.1f} usable "
                  f"({gpu_memory_gb:g} GB less a {margin:.0%} margin for the allocator and NCCL buffers)")
    console.print(f"largest layer (layer {report['largest_layer']}): {report['layer_allgather_gb_fp32']:.2f} GB "
                  f"in fp32 unsharded; FSDP2 gathers {report['layer_allgather_gb_bf16']:.2f} GB of it in bf16 "
                  f"with ep={lay['ep']}", highlight=False)
    console.print(f"suggested: {report['suggested']['why']}", highlight=False)
    console.print("assumptions:\n" + "\n".join(f"  - {a}" for a in report["assumptions"]), highlight=False)


# --------------------------------------------------------------------------------------
# env
# --------------------------------------------------------------------------------------


@env_app.command("check", context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def env_check(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Environment plugin, e.g. swe"),
    tasks: str | None = typer.Option(None, "--tasks", help="Task file (sets env.tasks)."),
    oracle: bool = typer.Option(False, "--oracle", help="Score the reference solutions instead of none."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of {instance_id, reward, error}."),
    jobs: int = typer.Option(4, "--jobs", min=1, help="Tasks checked at once."),
) -> None:
    """Validate an environment's dataset: the reward of every task with the reference
    solution (--oracle) or without any. Exit code 1 when a task could not be run, or when
    --oracle leaves a task below 1."""
    from primerl.envs import CheckableEnv, TaskError

    env = _env_for(ctx, name, tasks)
    if not isinstance(env, CheckableEnv):
        raise PrimerlError(f"environment '{name}' has no dataset check (it defines no check() method)")
    try:
        results = env.check(oracle=oracle, workers=jobs)
    except TaskError as exc:
        raise PrimerlError(f"environment '{name}' cannot run its tasks: {exc.cause}") from None
    errors = [r for r in results if r.get("reward") is None]
    if as_json:
        typer.echo(json.dumps(results, indent=2))
    else:
        _task_table(f"{name}: {'with' if oracle else 'without'} reference solutions", "reward", results,
                    lambda r: "-" if r.get("reward") is None else f"{r['reward']:.2f}")
        scored = [r["reward"] for r in results if r.get("reward") is not None]
        mean = sum(scored) / max(len(scored), 1)
        typer.echo(f"{len(results)} tasks, mean reward {mean:.3f}" +
                   (f", {len(errors)} could not be run (see error)" if errors else ""))
    if errors or (oracle and any(r["reward"] < 1 for r in results)):
        raise typer.Exit(1)


@env_app.command("prepare", context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def env_prepare(
    ctx: typer.Context,
    name: str = typer.Argument(..., help="Environment plugin, e.g. swe"),
    tasks: str | None = typer.Option(None, "--tasks", help="Task file (sets env.tasks)."),
    as_json: bool = typer.Option(False, "--json", help="Print a JSON list of {instance_id, error, setup_s}."),
    jobs: int = typer.Option(4, "--jobs", min=1, help="Tasks set up at once."),
    offline: bool = typer.Option(False, "--offline", help="Set up with no network (as a run does)."),
) -> None:
    """Set up every task of an environment ahead of training (for swe: each task's
    environment, running install recipes with the network on), so that a run reuses
    it. Exit code 1 when a task could not be set up."""
    from primerl.envs import PreparableEnv, TaskError

    env = _env_for(ctx, name, tasks)
    if not isinstance(env, PreparableEnv):
        raise PrimerlError(f"environment '{name}' needs no preparation (it defines no prepare() method)")
    try:
        results = env.prepare(network=not offline, jobs=jobs)
    except TaskError as exc:
        raise PrimerlError(f"environment '{name}' cannot set up its tasks: {exc.cause}") from None
    errors = [r for r in results if r.get("error")]
    if as_json:
        typer.echo(json.dumps(results, indent=2))
    else:
        _task_table(f"{name}: task setup", "setup s", results, lambda r: f"{r.get('setup_s', 0.0):.1f}")
        typer.echo(f"{len(results)} tasks, {len(results) - len(errors)} ready" +
                   (f", {len(errors)} could not be set up (see error)" if errors else ""))
    if errors:
        raise typer.Exit(1)


def _task_table(title: str, header: str, rows: list[dict[str, Any]], value: Any) -> None:
    """One row per task: its id, ``value(row)`` under ``header``, and its error."""
    table = Table(title=title)
    table.add_column("instance_id")
    table.add_column(header, justify="right")
    table.add_column("error", overflow="fold")
    for r in rows:
        table.add_row(r["instance_id"], value(r), r.get("error") or "")
    console.print(table)


def _env_for(ctx: typer.Context, name: str, tasks: str | None):
    from primerl.registry import get_registry

    cfg = _resolve(ctx, {"env.name": name, **({"env.tasks": tasks} if tasks else {})})
    return get_registry().load("env", name)(cfg.env)


# --------------------------------------------------------------------------------------
# run and the process commands a launcher starts
# --------------------------------------------------------------------------------------


def _resolve(ctx: typer.Context, explicit: dict[str, Any], origins: dict[str, str] | None = None):
    from primerl.config import split_args
    from primerl.preflight import load_checked

    return load_checked(split_args(list(ctx.args)), explicit, origins=origins)


def _defaults_note(origins: dict[str, str]) -> str:
    """TOML comments naming the values the env's run defaults chose (what --dry-run shows
    above the config), grouped by which defaults they came from."""
    from collections import defaultdict

    chosen: dict[str, list[str]] = defaultdict(list)
    for key, origin in origins.items():
        if origin.startswith("the run defaults of env"):
            chosen[origin].append(key)
    return "".join(f"# {origin}: {', '.join(sorted(keys))}\n" for origin, keys in chosen.items())


@app.command(context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def run(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model plugin (e.g. glm5)."),
    env: str | None = typer.Option(None, "--env", help="Environment plugin (e.g. reverse-text)."),
    output_dir: str | None = typer.Option(None, "--output-dir", help="Where everything the run makes goes."),
    max_steps: int | None = typer.Option(None, "--max-steps", help="Number of RL steps."),
    launcher_name: str | None = typer.Option(None, "--launcher", help="Launcher plugin (local, slurm)."),
    dry_run: bool = typer.Option(False, "--dry-run", help=(
        "Print the resolved config and exit; a launcher declaring its own dry run (slurm) writes its "
        "job scripts instead and submits nothing.")),
    overwrite: bool = typer.Option(False, "--overwrite", help=(
        "Start afresh in an output dir that holds a run (else an unfinished run with the same "
        "config resumes and another config is refused); its files move to OUT/previous-<time>/.")),
) -> None:
    """Run RL end to end: inference, orchestrator and trainer as separate processes. Run
    again into the same --output-dir, the same command resumes from the newest checkpoint."""
    from primerl.config import dump_toml, to_dict
    from primerl.registry import get_registry
    from primerl.rundir import RunDir

    origins: dict[str, str] = {}
    cfg = _resolve(ctx, {"model.name": model, "env.name": env, "output_dir": output_dir, "max_steps": max_steps,
                         "launcher.name": launcher_name}, origins)
    if cfg.model.checkpoint is not None:
        from primerl.models.checkpoint import has_chat_template

        if not has_chat_template(cfg.model.checkpoint_dir()):
            raise PrimerlError(f"model.checkpoint {cfg.model.checkpoint}: its tokenizer has no chat template, which "
                               f"every env renders its prompts with: add one (chat_template in tokenizer_config.json, "
                               f"or chat_template.jinja) or use a checkpoint of an instruct/chat model")
    elif cfg.sft.steps == 0 and not dry_run and (overwrite or RunDir(cfg.output_dir).latest_checkpoint() is None):
        # a random-weight preset with no warm-up samples bytes no reward function can grade
        typer.echo(f"note: model {cfg.model.name} starts from random weights (preset '{cfg.model.preset}') and "
                   f"sft.steps is 0, so it earns reward only once it stumbles on the answer format; "
                   f"--sft.steps 70 warms it up on the env's reference answers first (docs/configuration.md, [sft])")
    if dry_run and not get_registry().capabilities("launcher", cfg.launcher.name).dry_run:
        typer.echo(_defaults_note(origins) + dump_toml(to_dict(cfg)), nl=False)
        return
    if dry_run:
        cfg.launcher.dry_run = True  # the launcher declared the key (LauncherCapabilities.dry_run)
    elif overwrite:
        from primerl.resume import prepare_run

        for note in prepare_run(cfg, overwrite=True).notes:
            typer.echo(note)
    launcher = get_registry().load("launcher", cfg.launcher.name)
    from primerl.resume import RunFinished

    try:
        code = launcher().launch(cfg) or 0
    except RunFinished as done:
        from primerl.runview import summarize

        summarize(done.run)
        typer.echo(f"\n{done}")
        code = 0
    raise typer.Exit(code)


@app.command("eval", context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def eval_command(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model plugin (e.g. llama); with --model.checkpoint X "
                                     "alone, the one made for the checkpoint."),
    env: str | None = typer.Option(None, "--env", help="Environment plugin (e.g. reverse-text)."),
    run_dir: str | None = typer.Option(None, "--run", help="A run's --output-dir: its config, and the weights of "
                                       "its checkpoint at --step."),
    step: int | None = typer.Option(None, "--step", help="With --run: the checkpoint's step (default: the newest)."),
    split: str = typer.Option("eval", "--split", help="The env's task split."),
    tasks: int = typer.Option(200, "--tasks", min=1, help="Score the split's first this many tasks."),
    samples: int = typer.Option(1, "--samples", min=1, help="Episodes per task (pass@k up to this)."),
    temperature: float = typer.Option(0.0, "--temperature", min=0.0, help="Sampling temperature (0: greedy)."),
    max_tokens: int | None = typer.Option(None, "--max-tokens", min=1, help="Most tokens per model turn "
                                          "(orchestrator.max_tokens; default: the env's run default)."),
    pass_threshold: float = typer.Option(1.0, "--pass-threshold", help="An episode passes at this reward or above."),
    as_json: bool = typer.Option(False, "--json", help="One JSON line per task, then one summary line."),
    output: str | None = typer.Option(None, "--output", help="Also write the JSON lines to this file."),
) -> None:
    """Score a model on an environment's eval split: a preset, a checkpoint folder, a GGUF file,
    a packaged checkpoint (--model.checkpoint NAME) or a run's checkpoint (--run OUT --step N).
    Each task runs --samples times at --temperature through the env's own rollouts; prints
    the mean reward (its standard error over tasks) and pass@k."""
    from primerl.eval_command import EvalRequest, completion_text, evaluate, run_checkpoint, write_lines

    explicit: dict[str, Any] = {"model.name": model, "env.name": env, "orchestrator.max_tokens": max_tokens}
    if run_dir is not None:
        config, folder = run_checkpoint(run_dir, step)
        ctx.args[:0] = ["@", str(config)]
        explicit["model.checkpoint"] = str(folder)
    cfg = _resolve(ctx, explicit)
    if cfg.model.checkpoint is not None:
        from primerl.models.checkpoint import has_chat_template

        if not has_chat_template(cfg.model.checkpoint_dir()):
            raise PrimerlError(f"model.checkpoint {cfg.model.checkpoint}: its tokenizer has no chat template, which "
                               f"every env renders its prompts with")
    request = EvalRequest(split=split, tasks=tasks, samples=samples, temperature=temperature,
                          pass_threshold=pass_threshold)
    from primerl.registry import get_registry

    tokenizer = get_registry().load("model", cfg.model.name)().tokenizer(cfg.model) if as_json else None

    def on_task(score: Any) -> None:
        if as_json:
            typer.echo(json.dumps({**score.record(pass_threshold), "completion": completion_text(score, tokenizer)}))

    say = (lambda m: typer.echo(m, err=True)) if as_json else typer.echo
    scores, summary = evaluate(cfg, request, on_task=on_task, say=say)
    what = cfg.model.checkpoint or f"preset {cfg.model.preset}"
    summary = {**summary, "model": cfg.model.name, "checkpoint": what, "env": cfg.env.name, "split": split,
               "temperature": temperature, "max_tokens": cfg.orchestrator.max_tokens}
    if output:
        write_lines(output, scores, summary, pass_threshold)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        for s in [s for s in scores if s.error][:3]:
            typer.echo(f"task {s.task_id} could not be run: {s.error}")
        if summary["mean_reward"] is None:
            raise PrimerlError(f"no task of {cfg.env.name!r} could be run ({summary['errors']} failed)")
        passes = ", ".join(f"{k} {v:.3f}" for k, v in summary.items() if k.startswith("pass@"))
        typer.echo(f"{cfg.model.name} ({what}) on {cfg.env.name} {split}: mean reward {summary['mean_reward']:.3f} "
                   f"(± {summary['reward_stderr']:.3f}) over {summary['n']} tasks x {summary['samples']}, {passes}"
                   + (f"; {summary['errors']} tasks could not be run" if summary["errors"] else ""))
    if summary["mean_reward"] is None:
        raise typer.Exit(1)


@app.command(context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def inference(
    ctx: typer.Context,
    model: str | None = typer.Option(None, "--model", help="Model plugin (e.g. glm5)."),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="Local HF checkpoint directory."),
    host: str | None = typer.Option(None, "--host"),
    port: int | None = typer.Option(None, "--port"),
) -> None:
    """Serve a model over the OpenAI-compatible API."""
    from primerl.registry import get_registry

    cfg = _resolve(ctx, {"model.name": model, "model.checkpoint": checkpoint,
                         "inference.host": host, "inference.port": port})
    backend = get_registry().load("inference_backend", cfg.inference.backend)
    from primerl import watchdog
    from primerl.rundir import RunDir

    watchdog.start(f"inference:{cfg.inference.port}", RunDir(cfg.output_dir), cfg)  # in a launched run only
    watchdog.doing("loading the model", busy=True)
    backend().serve(cfg)


@app.command(context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def trainer(ctx: typer.Context) -> None:
    """Run the trainer process of a run (started by a launcher)."""
    from primerl.trainer.main import main as trainer_main

    trainer_main(_resolve(ctx, {}))


@app.command(context_settings=CONFIG_ARGS, epilog=CONFIG_HELP)
def orchestrator(ctx: typer.Context) -> None:
    """Run the orchestrator process of a run (started by a launcher)."""
    from primerl.orchestrator.main import main as orchestrator_main

    orchestrator_main(_resolve(ctx, {}))


def _help_from_docstrings(*apps: typer.Typer) -> None:
    """Command help from the docstrings with their paragraphs unwrapped: the terminal wraps
    them to its width (hard line breaks would break the help mid-sentence)."""
    import inspect
    import re

    for sub in apps:
        for command in sub.registered_commands:
            if command.help is None and command.callback is not None:
                doc = inspect.getdoc(command.callback) or ""
                command.help = "\n\n".join(re.sub(r"\s*\n\s*", " ", p.strip()) for p in doc.split("\n\n"))


_help_from_docstrings(app, plugins_app, models_app, env_app)


def main(argv: list[str] | None = None) -> None:
    try:
        rc = app(args=argv, standalone_mode=False)  # returns the code of a typer.Exit
        if isinstance(rc, int) and rc:
            sys.exit(rc)
    except PrimerlError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except typer.Exit as exc:
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted")
        sys.exit(130)
    except Exception as exc:  # click usage errors carry their own exit code
        if isinstance(exc, _click_exceptions()):
            exc.show()
            sys.exit(exc.exit_code)
        raise


def _click_exceptions() -> tuple[type, ...]:
    """click's usage-error class, and the copy of click that typer >= 0.26 vendors (its own class)."""
    import click

    kinds: list[type] = [click.ClickException]
    try:
        from typer._click.exceptions import ClickException
    except ImportError:
        pass
    else:
        kinds.append(ClickException)
    return tuple(kinds)


if __name__ == "__main__":  # pragma: no cover
    main()
