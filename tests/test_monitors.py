"""Monitors: where every trainer step's metrics go (metrics.jsonl always; W&B, TensorBoard when
switched on). Config switching, one-line config errors, a failing monitor that is reported
once while the others and the run go on, and (slow) a real run whose offline W&B file and
TensorBoard event files hold every metric of every line of metrics.jsonl."""

import importlib.util
import json
import math
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
from conftest import REPO

from primerl import builtin_plugin
from primerl.config import ConfigSources, RunConfig, dump_toml, load_config, to_dict
from primerl.errors import ConfigError
from primerl.monitors import MonitorConfig, MonitorSet, RunInfo, sample_rows
from primerl.registry import Registry
from primerl.samples import Sample

TEST_PLUGIN = Path(__file__).parent / "monitor_plugin"


def load_test_plugin():
    """The failing and recording monitors of tests/monitor_plugin, loaded by path (nothing is
    added to sys.path, so no other test discovers them)."""
    spec = importlib.util.spec_from_file_location("primerl_test_monitors", TEST_PLUGIN / "primerl_test_monitors.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def monitors_of(*overrides: tuple[str, str]) -> dict:
    return load_config(ConfigSources(overrides=list(overrides))).monitors


# ---- config ---------------------------------------------------------------------------


def test_any_key_of_a_monitors_table_switches_it_on_and_file_is_always_first():
    assert {n: m.enabled for n, m in monitors_of().items()} == {"file": True}
    on = monitors_of(("monitors.wandb.project", "p"), ("monitors.wandb.mode", "offline"),
                     ("monitors.tensorboard.enabled", "true"))
    assert list(on) == ["file", "wandb", "tensorboard"]
    assert all(m.enabled for m in on.values())
    assert (on["wandb"].project, on["wandb"].mode, on["wandb"].samples_every) == ("p", "offline", 10)
    assert monitors_of(("monitors.tensorboard.samples_every", "3"))["tensorboard"].enabled
    # enabled = false wins over the other keys (a base file configures, a run switches off)
    off = monitors_of(("monitors.wandb.project", "p"), ("monitors.wandb.enabled", "false"))
    assert not off["wandb"].enabled and off["wandb"].project == "p"
    assert monitors_of(("monitors.file.enabled", "true"))["file"].enabled


def test_the_resolved_config_reads_back_the_same_monitors(tmp_path):
    cfg = load_config(ConfigSources(overrides=[("monitors.wandb.tags", '["a", "b"]'),
                                               ("monitors.wandb.enabled", "false")]))
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(to_dict(cfg)))
    again = load_config(ConfigSources(files=[str(path)]))
    assert again.monitors == cfg.monitors
    assert not again.monitors["wandb"].enabled and again.monitors["wandb"].tags == ["a", "b"]


@pytest.mark.parametrize("overrides, says", [
    ([("monitors.wandbb.project", "p")], "monitors.wandbb (from the command line (--monitors.wandbb.project)): "
                                         "no monitor named 'wandbb'. Available: file, "),
    ([("monitors.wandb.projekt", "p")], "unknown key 'monitors.wandb.projekt' (from the command line "
                                        "(--monitors.wandb.projekt)). Did you mean 'project'?"),
    ([("monitors.wandb.mode", "onlin")], "'monitors.wandb.mode' must be one of 'online', 'offline', 'disabled', "
                                         "got 'onlin'"),
    ([("monitors.wandb.samples_every", "-1")], "invalid value for 'monitors.wandb.samples_every'"),
    ([("monitors.tensorboard.log_dir", "3")], "'monitors.tensorboard.log_dir' must be a string"),
    ([("monitors.file.enabled", "false")], "monitors.file.enabled = false (from the command line "
                                           "(--monitors.file.enabled)): monitor 'file' is always on"),
    ([("monitors.wandb", "true")], "monitors.wandb (from the command line (--monitors.wandb)) must be a table of "
                                   "the monitor's options: --monitors.wandb.enabled true switches it on"),
    ([("monitors", "1")], "'monitors' (from the command line (--monitors)) must be a table of tables"),
])
def test_a_bad_monitor_key_is_one_line_naming_it(overrides, says):
    with pytest.raises(ConfigError) as info:
        load_config(ConfigSources(overrides=overrides))
    message = str(info.value)
    assert says in message and "\n" not in message


def test_a_monitor_whose_target_does_not_import_is_a_config_error():
    reg = Registry.discover([load_test_plugin()])
    with pytest.raises(ConfigError, match=r"monitors.unloadable \(from the command line.*could not load its target "
                                          r"'primerl_test_monitors_no_such_module:Monitor'") as info:
        load_config(ConfigSources(overrides=[("monitors.unloadable.enabled", "true")]), registry=reg)
    assert "\n" not in str(info.value)
    cfg = load_config(ConfigSources(overrides=[("monitors.flaky.fail_at", "3")]), registry=reg)
    assert cfg.monitors["flaky"].fail_at == 3 and cfg.monitors["flaky"].enabled
    # the command line turns '-' into '_' in keys: a dashed monitor name is found either way
    from primerl.config import split_args

    cfg = load_config(split_args(["--monitors.needs-missing-lib.enabled", "true"]), registry=reg)
    assert list(cfg.monitors) == ["file", "needs-missing-lib"]


def test_plugins_list_shows_the_monitors_without_importing_their_libraries():
    code = ("import json, sys\n"
            "from typer.testing import CliRunner\n"
            "from primerl.cli import app\n"
            "r = CliRunner().invoke(app, ['plugins', 'list', '--json'])\n"
            "rows = [(x['kind'], x['name'], x['status']) for x in json.loads(r.output) if x['kind'] == 'monitor']\n"
            "from primerl.config import ConfigSources, load_config\n"
            "load_config(ConfigSources(overrides=[('monitors.wandb.mode', 'offline'), ('monitors.tensorboard.enabled', 'true')]))\n"
            "print(json.dumps({'rows': rows, 'imported': [m for m in ('wandb', 'tensorboard', 'torch') if m in sys.modules]}))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    rows = {tuple(row) for row in out["rows"]}
    assert {("monitor", "file", "ok"), ("monitor", "wandb", "ok"), ("monitor", "tensorboard", "ok")} <= rows
    assert out["imported"] == []  # neither listing nor the config check imports a monitor's library (nor torch)


# ---- the trainer's monitor set ---------------------------------------------------------


def run_info(out: Path, lines: list[str], start: int = 0) -> RunInfo:
    return RunInfo(output_dir=out, name=out.name, config={}, start_step=start, max_steps=3, log=lines.append)


def test_a_failing_monitor_is_reported_once_and_the_others_and_the_run_go_on(tmp_path):
    plugin = load_test_plugin()
    reg = Registry.discover([builtin_plugin, plugin], installed=False)
    cfg = RunConfig(output_dir=str(tmp_path), monitors={
        name: (plugin.FlakyConfig if name == "flaky" else MonitorConfig)(enabled=True, samples_every=1)
        for name in ("needs-missing-lib", "flaky", "unloadable", "recorder")})
    lines: list[str] = []
    monitors = MonitorSet.for_run(cfg, log=lines.append, registry=reg)
    assert monitors.names == ["file", "needs-missing-lib", "flaky", "recorder"]  # file first; unloadable said so
    monitors.start(run_info(tmp_path, lines))
    samples = [Sample(tokens=[1, 2, 3], loss_mask=[0, 1, 1], reward=1.0, task_id="t", source="s")]
    for step in (1, 2, 3):
        monitors.log(step, {"step": step, "reward/mean": 0.5 * step, "flag": True})
        if monitors.wants_samples(step):
            monitors.log_samples(step, sample_rows(step, samples))
    monitors.finish()

    warnings = [line for line in lines if line.startswith("warning: monitor ")]
    assert len(warnings) == 3, lines
    unloadable, missing, flaky = warnings  # in the order they failed: building, starting, step 2
    assert unloadable.startswith("warning: monitor unloadable: PluginError: ") and "the run goes on without it" in unloadable
    assert missing.startswith("warning: monitor needs-missing-lib: ModuleNotFoundError: No module named "
                              "'a_monitoring_library_that_is_not_installed'; the run goes on without it")
    assert flaky == "warning: monitor flaky: RuntimeError: flaky monitor fails at step 2; the run goes on without it"
    assert all(line.count("\n") == 0 for line in lines)
    assert monitors.names == []  # all finished
    # the file monitor wrote every step and drew the plot; the recorder got every call
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [{"step": s, "reward/mean": 0.5 * s, "flag": True} for s in (1, 2, 3)]
    assert (tmp_path / "reward.png").stat().st_size > 0
    calls = plugin.Recorder.last.calls
    assert [c[0] for c in calls] == ["start", "log", "log_samples", "log", "log_samples", "log", "log_samples",
                                     "finish"]
    assert [c[2] for c in calls if c[0] == "log"] == rows
    assert calls[2][2][0].source == "s" and calls[2][2][0].completion_tokens == 2


def test_samples_go_only_to_the_monitors_whose_interval_picks_the_step(tmp_path):
    plugin = load_test_plugin()
    reg = Registry.discover([builtin_plugin, plugin], installed=False)
    cfg = RunConfig(output_dir=str(tmp_path), monitors={"recorder": MonitorConfig(enabled=True, samples_every=2)})
    monitors = MonitorSet.for_run(cfg, log=print, registry=reg)
    monitors.start(run_info(tmp_path, []))
    picked = [step for step in range(1, 8) if monitors.wants_samples(step)]
    assert picked == [1, 3, 5, 7]
    off = MonitorSet.for_run(RunConfig(output_dir=str(tmp_path)), log=print, registry=reg)
    assert off.names == ["file"] and not any(off.wants_samples(s) for s in range(1, 20))


def test_an_always_on_monitors_failure_stops_the_trainer(tmp_path):
    reg = Registry.discover([builtin_plugin], installed=False)
    blocked = tmp_path / "not-a-dir"
    blocked.write_text("")  # metrics.jsonl cannot be written under a file
    monitors = MonitorSet.for_run(RunConfig(output_dir=str(blocked)), log=print, registry=reg)
    monitors.start(run_info(blocked, []))
    with pytest.raises(OSError):
        monitors.log(1, {"step": 1})


def test_sample_rows_decode_prompt_and_completion_spread_over_the_batch():
    from primerl.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    samples = []
    for i in range(32):
        prompt, completion = tok.encode(f"task {i}: "), tok.encode(f"answer {i}")
        samples.append(Sample(tokens=prompt + completion, loss_mask=[0] * len(prompt) + [1] * len(completion),
                              reward=i / 32, advantage=-1.0, task_id=f"t{i}", source="a" if i < 16 else "b"))
    rows = sample_rows(5, samples, tok)
    assert len(rows) == 8 and [r.task_id for r in rows] == [f"t{i}" for i in range(0, 32, 4)]
    assert {r.source for r in rows} == {"a", "b"}
    first = rows[1]
    assert (first.step, first.prompt, first.completion, first.reward, first.advantage) == (
        5, "task 4: ", "answer 4", 4 / 32, -1.0)
    assert (first.prompt_tokens, first.completion_tokens) == (8, 8)
    assert sample_rows(1, samples[:3])[0].prompt == ""  # no tokenizer: token counts only


def test_docs_list_every_key_of_every_built_in_monitor():
    import attrs

    from primerl.registry import get_registry

    text = (REPO / "docs" / "monitors.md").read_text()
    for name in ("file", "wandb", "tensorboard"):
        cls = get_registry().load("monitor", name).Config
        section = text.split(f"## `[monitors.{name}]`", 1)[1].split("\n## ", 1)[0]
        missing = [f.name for f in attrs.fields(cls) if f"| `{f.name}` |" not in section]
        assert missing == [], f"docs/monitors.md, [monitors.{name}], lacks {missing}"


# ---- a real run ------------------------------------------------------------------------

SMALL = ["--sft.steps", "0", "--orchestrator.batch_size", "8", "--orchestrator.group_size", "4",
         "--orchestrator.max_tokens", "8", "--trainer.seq_len", "256"]


def wandb_records(path: Path):
    """The protobuf records of a ``.wandb`` file (wandb's own ``wandb.proto`` messages), read
    from its LevelDB-style log: a 7-byte header (":W&B", magic 0xBEE1, version), then 32 KiB
    blocks of chunks, each crc32 + length + type (full, first, middle, last) + data."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, _version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic) == (b":W&B", 0xBEE1), (ident, magic)
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = 32768 - pos % 32768
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (crc, length, kind) == (0, 0, 0):
            pos += room
            continue
        chunk = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == crc, f"bad chunk at byte {pos}"
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


def same(a, b) -> bool:
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int | float) or not isinstance(b, int | float):
        return a == b
    return a == pytest.approx(b, rel=1e-6, abs=1e-9) or (math.isnan(a) and math.isnan(b))


@pytest.mark.slow
def test_a_run_logs_every_metric_to_offline_wandb_and_tensorboard_and_survives_failing_monitors(tmp_path):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(TEST_PLUGIN), os.environ.get("PYTHONPATH")])),
           "WANDB_SILENT": "true"}
    r = subprocess.run([sys.executable, "-m", "primerl.cli", "run", "--model", "glm5", "--env", "reverse-text",
                        "--max-steps", "3", "--output-dir", str(out), *SMALL,
                        "--monitors.wandb.project", "p", "--monitors.wandb.mode", "offline",
                        "--monitors.tensorboard.enabled", "true",
                        "--monitors.flaky.fail_at", "2", "--monitors.needs-missing-lib.enabled", "true"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in lines] == [1, 2, 3]
    assert (out / "reward.png").stat().st_size > 0

    # the failing monitors: one line each in the trainer's log, and the run went on
    log = (out / "logs" / "trainer.log").read_text()
    warnings = [x for x in log.splitlines() if "warning: monitor" in x]
    assert len(warnings) == 2, warnings
    assert any("warning: monitor flaky: RuntimeError: flaky monitor fails at step 2; the run goes on without it" in w
               for w in warnings)
    assert any("warning: monitor needs-missing-lib: ModuleNotFoundError" in w for w in warnings)
    assert "done: 3 steps" in log

    # W&B offline: one run file, the config once, every key and value of every metrics line
    files = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    history: dict[int, dict] = {}
    configs = []
    for record in wandb_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history.setdefault(int(items["_step"]), {}).update(items)
        elif kind == "run":
            configs.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                            for i in record.run.config.update})
    assert configs and configs[0]["output_dir"] == str(out) and configs[0]["monitors"]["wandb"]["mode"] == "offline"
    for line in lines:
        got = history[line["step"]]
        wrong = {k: (v, got.get(k)) for k, v in line.items() if not same(v, got.get(k))}
        assert wrong == {}, f"step {line['step']}: metrics.jsonl vs the .wandb file"
    assert history[1]["samples/_type"] == "table-file" and history[1]["samples/nrows"] == 8  # step 1's samples
    assert "samples/_type" not in history[2]  # samples_every 10: then step 11
    table = json.loads(next(files[0].parent.glob("files/media/table/samples_1_*.table.json")).read_text())
    assert table["columns"][:5] == ["step", "source", "task_id", "prompt", "completion"]
    assert {row[1] for row in table["data"]} == {"reverse-text"} and "Reverse" in table["data"][0][3]

    # TensorBoard: every numeric key of every line as a scalar at its step, samples as text
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])
    for line in lines:
        for key, value in line.items():
            if isinstance(value, bool | int | float):
                assert key in scalars, key
                at = {e.step: e.value for e in events.Scalars(key)}
                assert at[line["step"]] == pytest.approx(float(value), rel=1e-6, abs=1e-6), (key, line["step"])
    text = events.Tensors("samples/text_summary")
    assert [t.step for t in text] == [1] and b"reverse-text" in text[0].tensor_proto.string_val[0]
