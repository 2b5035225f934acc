"""Resuming a run: the checkpoint it continues from, the configs that may continue it, and
what an interrupted attempt left beyond that checkpoint.

A run stopped at any moment (Ctrl-C, a crashed process, a lost node, a Slurm requeue)
continues when the same command runs again into its output directory: no step lost, none
trained twice, the same task order. Three pieces make that work:

* :func:`usable_checkpoint`: the newest ``checkpoints/step_s`` whose files are whole
  (:func:`check_checkpoint`: every size in its manifest, the safetensors headers, the
  optimizer's DCP metadata and the extent of every item in it, the CRCs of the trainer
  state). The trainer and the orchestrator each pick it at start, on their own, so they
  must agree: the check is deterministic and reads headers, not tensors. A checkpoint that
  passes it but still fails to load stops the trainer, which sets it aside
  (:func:`set_aside_checkpoint`), so the next attempt falls back to the one before.
* :func:`prepare` (launchers call :func:`prepare_run`; a batch script that starts the
  processes itself runs ``python -m primerl.resume OUT`` first): before any process starts,
  refuse a finished run and a config that differs from the recorded one in a key that
  matters (every key but :data:`MAY_CHANGE` and the ``[inference]`` keys its backend's
  ``Config`` lists in ``may_change_on_resume``), and set aside what the interrupted attempt
  left beyond step s (its rollouts, metric lines, logs, unusable checkpoints; its weights
  beyond s are deleted, the trainer publishes them again) into ``OUT/previous-<time>/``,
  so neither process reads a stale file. With no usable checkpoint the run starts over and
  every earlier file goes there. Nothing recorded is deleted.
* the data position, kept by the orchestrator (``primerl.orchestrator.positions``) next to
  each batch and copied by the trainer into each checkpoint; see docs/architecture.md,
  "Checkpoint and resume".
"""

from __future__ import annotations

import fnmatch
import json
import os
import pickle
import shutil
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import attrs

from primerl.errors import PrimerlError
from primerl.inference import InferenceConfig
from primerl.rundir import (
    MANIFEST,
    OPTIMIZER_DIR,
    ORCHESTRATOR_STATE,
    PREVIOUS_PREFIX,
    SHM_LINK,
    TMP_PREFIX,
    TRAINER_STATE,
    RunDir,
    parse_step,
    step_name,
    write_atomically,
)

__all__ = ["Resume", "RunFinished", "prepare", "prepare_run", "usable_checkpoint"]

# config keys that may differ when a run is continued: where it runs, how it is served
# or laid out and where its metrics go, not what it trains (checkpoints reshard onto any trainer layout); raising
# max_steps continues training (a cosine or linear decay then stretches to the new end). The
# [inference] keys are the selected backend's Config's (InferenceConfig.may_change_on_resume)
MAY_CHANGE = (
    "max_steps", "output_dir",
    "trainer.checkpoint_every", "trainer.keep_checkpoints", "trainer.nproc", "trainer.parallelism",
    "trainer.parallel.*",
    "orchestrator.eval_every", "orchestrator.eval_tasks", "orchestrator.eval_temperature", "orchestrator.eval_samples",
    "model.cache_dir",
    "launcher.*", "monitors.*",
)
# what a run writes, set aside when it starts over (the launcher rewrites config.toml)
RUN_FILES = ("config.toml", "metrics.jsonl", "reward.png", "rollouts", "weights", "checkpoints", "logs")

Log = Callable[[str], None]


# ---- checkpoints -----------------------------------------------------------------------


def check_checkpoint(ckpt: Path) -> str | None:
    """What makes ``checkpoints/step_n`` unusable, in a few words; None when it is whole."""
    try:
        return _check(Path(ckpt))
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"


def _check(ckpt: Path) -> str | None:
    state = ckpt / TRAINER_STATE
    if not state.is_file():
        return f"{TRAINER_STATE} is missing (it was never completed)"
    manifest = ckpt / MANIFEST
    if manifest.is_file():  # checkpoints of older primerl have none
        try:
            sizes = json.loads(manifest.read_text())["files"]
            items = [(str(k), int(v)) for k, v in sizes.items()]
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{MANIFEST} is garbled"
        for rel, size in items:
            f = ckpt / rel
            if not f.is_file():
                return f"{rel} is missing"
            if f.stat().st_size != size:
                return f"{rel} has {f.stat().st_size} bytes, {size} were written"
    weights = sorted(ckpt.glob("*.safetensors"))
    if not weights:
        return "it holds no model weights (*.safetensors)"
    for f in weights:
        problem = _check_safetensors(f)
        if problem:
            return f"{f.name} {problem}"
    index = ckpt / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return f"{index.name} is garbled"
        missing = sorted(s for s in shards if not (ckpt / s).is_file())
        if missing:
            return f"{missing[0]} is missing"
    problem = _check_dcp(ckpt / OPTIMIZER_DIR)
    if problem:
        return problem
    try:
        with zipfile.ZipFile(state) as z:
            bad = z.testzip()
    except (zipfile.BadZipFile, EOFError, ValueError):
        return f"{TRAINER_STATE} is garbled"
    if bad is not None:
        return f"{TRAINER_STATE} is garbled ({bad} fails its CRC)"
    orch = ckpt / ORCHESTRATOR_STATE
    if orch.is_file():
        try:
            json.loads(orch.read_text())
        except ValueError:
            return f"{ORCHESTRATOR_STATE} is garbled"
    return None


def _check_safetensors(f: Path) -> str | None:
    size = f.stat().st_size
    with open(f, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            return f"is truncated ({size} bytes)"
        n = int.from_bytes(head, "little")
        if n > size - 8:
            return f"is truncated or garbled (its header claims {n} bytes, the file has {size})"
        try:
            header = json.loads(fh.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError):
            return "has a garbled header"
    if 8 + n + end > size:
        return f"is truncated ({size} bytes, its header needs {8 + n + end})"
    return None


def _check_dcp(opt: Path) -> str | None:
    """The optimizer's ``torch.distributed.checkpoint``: its metadata unpickles and every item
    it lists lies inside its file."""
    if not opt.is_dir():
        return f"{OPTIMIZER_DIR}/ (the optimizer state) is missing"
    meta = opt / ".metadata"
    if not meta.is_file():
        return f"{OPTIMIZER_DIR}/.metadata is missing"
    try:
        with open(meta, "rb") as fh:
            md = pickle.load(fh)  # our own trainer's file, read as torch's reader does
        ends: dict[str, int] = {}
        for info in md.storage_data.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), int(info.offset) + int(info.length))
    except Exception:  # noqa: BLE001 - garbage unpickles into any exception
        return f"{OPTIMIZER_DIR}/.metadata is garbled"
    for rel, end in sorted(ends.items()):
        f = opt / rel
        if not f.is_file():
            return f"{OPTIMIZER_DIR}/{rel} is missing"
        if f.stat().st_size < end:
            return f"{OPTIMIZER_DIR}/{rel} is truncated ({f.stat().st_size} bytes, its items need {end})"
    return None


def survey(run: RunDir) -> tuple[int | None, list[tuple[int, str]]]:
    """(the newest usable checkpoint's step or None, the newer complete ones that are not,
    each with its problem, newest first)."""
    unusable = []
    for n in reversed(run.checkpoint_steps()):
        problem = check_checkpoint(run.checkpoint(n))
        if problem is None:
            return n, unusable
        unusable.append((n, problem))
    return None, unusable


def usable_checkpoint(run: RunDir, log: Log | None = None) -> tuple[int, Path] | None:
    """The newest checkpoint whose files are whole; each newer one passed over is logged."""
    good, unusable = survey(run)
    for n, problem in unusable:
        if log is not None:
            log(f"checkpoints/{step_name(n)} is unusable ({problem}): falling back to the one before")
    return (good, run.checkpoint(good)) if good is not None else None


def manifest(ckpt: Path) -> dict[str, Any]:
    """``manifest.json``'s content for a checkpoint directory written so far: every file's size."""
    files = {str(p.relative_to(ckpt)): p.stat().st_size for p in sorted(ckpt.rglob("*")) if p.is_file()}
    return {"files": {k: v for k, v in files.items() if k != MANIFEST}}


def set_aside_checkpoint(run: RunDir, n: int) -> Path:
    """Move ``checkpoints/step_n`` into ``previous-<time>/checkpoints/`` (it failed to load)."""
    dest = _previous(run) / "checkpoints" / step_name(n)
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(run.checkpoint(n), dest)
    return dest


# ---- metrics ---------------------------------------------------------------------------


def trim_metrics(run: RunDir, last_step: int, previous: Path | None = None) -> Path | None:
    """Keep the metric lines of steps up to ``last_step`` (steps after it are trained again);
    when there are others, the whole file is first copied into ``previous`` (a fresh
    ``previous-<time>/`` when None). Returns where the copy went, or None."""
    path = run.metrics
    if not path.is_file():
        return None
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if int(json.loads(line).get("step", 0)) <= last_step:
                kept.append(line + "\n")
        except (ValueError, AttributeError, TypeError):
            continue
    if len(kept) == len(lines):
        return None
    previous = previous or _previous(run)
    previous.mkdir(parents=True, exist_ok=True)
    shutil.copy2(path, previous / path.name)
    write_atomically(path, lambda tmp: tmp.write_text("".join(kept)))
    return previous / path.name


# ---- configs ---------------------------------------------------------------------------


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_flat(v, key + "."))
        elif v is not None:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


def may_change(key: str, inference: type[InferenceConfig] = InferenceConfig) -> bool:
    """Whether ``key`` may differ when a run continues: one of :data:`MAY_CHANGE`, or of the
    ``[inference]`` keys the backend's Config (``inference``) lists as such."""
    patterns = (*MAY_CHANGE, *(f"inference.{k}" for k in inference.may_change_on_resume))
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in patterns)


def config_changes(recorded: Path, cfg: Any) -> list[tuple[str, Any, Any]]:
    """(key, recorded value, new value) for every key but :data:`MAY_CHANGE` that differs
    between the run's ``config.toml`` and ``cfg`` (None: absent)."""
    from primerl.config import ConfigSources, dump_toml, load_config, to_dict, tomllib

    new = _flat(to_dict(cfg))
    try:  # through the loader, so keys added since the run was recorded take their defaults
        old = _flat(to_dict(load_config(ConfigSources(files=[str(recorded)]))))
    except Exception:  # noqa: BLE001 - it no longer loads (a plugin gone, a key renamed): compare the text
        old = _flat(tomllib.loads(recorded.read_text()))
        new = _flat(tomllib.loads(dump_toml(to_dict(cfg))))
    return [(k, old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k) and not may_change(k, type(cfg.inference))]


def _show(v: Any) -> str:
    return "(unset)" if v is None else json.dumps(v) if isinstance(v, str) else repr(v)


# ---- before a run starts ---------------------------------------------------------------


@attrs.frozen
class Resume:
    """What :func:`prepare` decided."""

    step: int | None  # the checkpoint's step the run continues from; None: from the start
    set_aside: Path | None  # the previous-<time>/ folder that received earlier files, if any
    notes: tuple[str, ...]  # what was decided and done, one line each, for the user


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _previous(run: RunDir) -> Path:
    """A fresh ``previous-<time>`` path (not created)."""
    base = run.previous(_stamp())
    path, i = base, 1
    while path.exists():
        path, i = base.with_name(f"{base.name}-{i}"), i + 1
    return path


def _move(src: Path, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dest)


def _nonempty(p: Path) -> bool:
    return p.is_file() or (p.is_dir() and any(p.iterdir()))


def _delete_weights(d: Path) -> None:
    link = d / SHM_LINK
    if link.is_symlink():
        Path(os.readlink(link)).unlink(missing_ok=True)  # the tmpfs file behind it
    shutil.rmtree(d, ignore_errors=True)


class RunFinished(PrimerlError):
    """The run directory holds this run, finished: nothing to do (not an error of the user's:
    ``primerl run`` says where its results are and exits 0)."""

    def __init__(self, run: RunDir, steps: int, max_steps: int) -> None:
        super().__init__(f"{run.root} already holds this run, finished ({steps} steps of {max_steps}); nothing was "
                         f"run or overwritten. To train again: --max-steps N (more than {steps}) continues from its "
                         f"last checkpoint, --overwrite starts afresh (its files are kept), or choose another "
                         f"--output-dir.")
        self.run, self.steps, self.max_steps = run, steps, max_steps


def _rel(run: RunDir, p: Path) -> str:
    return str(p.relative_to(run.root))


@attrs.define
class _Plan:
    """What :func:`prepare` is about to do to the run directory (paths under it)."""

    moves: list[Path] = attrs.Factory(list)  # moved into previous-<time>/
    copies: list[Path] = attrs.Factory(list)  # copied into previous-<time>/
    deletes: list[Path] = attrs.Factory(list)  # partial writes, and weights the trainer publishes again
    notes: list[str] = attrs.Factory(list)  # what it does, one line each, for the user


def _overwrite(run: RunDir, keep: set[str], dry_run: bool) -> Resume:
    """``--overwrite``: everything in the run directory (but ``keep``) moved aside."""
    present = [p for p in sorted(run.root.iterdir()) if not p.name.startswith(PREVIOUS_PREFIX) and p.name not in keep]
    if not present:
        return Resume(None, None, ())
    previous = _previous(run)
    if not dry_run:
        for p in present:
            _move(p, previous / p.name)
    return Resume(None, previous, (f"--overwrite: starting afresh; the earlier files of {run.root} are in "
                                   f"{previous}",))


def _plan_start_over(run: RunDir, keep: set[str], config: Any, previous: Path) -> _Plan | None:
    """No usable checkpoint: every earlier file set aside (None: there is none). The recorded
    config.toml is what is about to run when no new config is given: copied, not moved."""
    root = run.root
    logs = [f for f in sorted(run.logs.iterdir()) if _rel(run, f) not in keep] if run.logs.is_dir() else []
    if not logs and not any(_nonempty(root / name) for name in RUN_FILES if name not in ("config.toml", "logs")):
        return None
    whole_logs = run.logs.is_dir() and len(logs) == len(list(run.logs.iterdir()))
    plan = _Plan(moves=[root / name for name in RUN_FILES if name != "logs" and (root / name).exists()
                        and not (name == "config.toml" and config is None)] + ([run.logs] if whole_logs else logs))
    if config is None and run.config.is_file():
        plan.copies.append(run.config)
    plan.notes.append(f"{root} holds an earlier attempt with no usable checkpoint: starting over; its files "
                      f"are kept in {previous}")
    return plan


def _refuse_to_continue(run: RunDir, good: int, max_steps: int, config: Any) -> None:
    """Raise when the run at checkpoint ``good`` may not continue: another config, or finished."""
    if config is not None and run.config.is_file():
        changes = config_changes(run.config, config)
        if changes:
            shown = ", ".join(f"{k} {_show(a)} -> {_show(b)}" for k, a, b in changes)
            recorded_steps = _recorded_max_steps(run)
            if recorded_steps is not None and good >= recorded_steps:
                held = f"a finished run ({good} steps of {recorded_steps})"
                again = "run its own config with a larger --max-steps to train it further"
            else:
                held = f"an unfinished run (checkpoint at step {good})"
                again = "run its own config again to resume it"
            raise PrimerlError(
                f"{run.root} holds {held} with another config: {shown}; {again} (recorded in {run.config}), "
                f"add --overwrite to start afresh (its files are then kept in {run.root}/{PREVIOUS_PREFIX}<time>/), "
                f"or choose another --output-dir")
    if good >= max_steps:
        raise RunFinished(run, good, max_steps)


def _recorded_max_steps(run: RunDir) -> int | None:
    """The step budget the run directory's ``config.toml`` recorded (None: no file, or no budget in it)."""
    from primerl.config import tomllib

    if not run.config.is_file():
        return None
    steps = tomllib.loads(run.config.read_text()).get("max_steps")
    return None if steps is None else int(steps)


def _plan_resume(run: RunDir, good: int, unusable: list[tuple[int, str]], keep: set[str], previous: Path) -> _Plan:
    """Continue from checkpoint ``good``: what the interrupted attempt left beyond it (rollouts,
    logs, unusable checkpoints) set aside, partial writes and weights beyond it deleted."""
    plan = _Plan(moves=[run.checkpoint(n) for n, _ in unusable])
    if run.rollouts.is_dir():
        for f in sorted(run.rollouts.iterdir()):
            n = parse_step(f.name.split(".")[0])
            if f.name.endswith(".tmp"):
                plan.deletes.append(f)
            elif n is not None and n > good:
                plan.moves.append(f)
    if run.logs.is_dir():
        plan.moves += [p for p in sorted(run.logs.iterdir()) if _rel(run, p) not in keep]
    for parent in (run.weights, run.checkpoints):
        for d in sorted(parent.iterdir()) if parent.is_dir() else ():
            n = parse_step(d.name)
            if d.name.startswith(TMP_PREFIX) or (parent == run.weights and n is not None and n > good):
                plan.deletes.append(d)
    beyond = sorted({n for f in plan.moves if f.parent == run.rollouts and (n := parse_step(f.name.split(".")[0]))})
    if beyond:
        plan.notes.append(f"steps {beyond[0]}-{beyond[-1]} run again: the interrupted attempt's rollouts, metric "
                          f"lines and logs are kept in {previous}")
    republished = sorted(n for d in plan.deletes if d.parent == run.weights and (n := parse_step(d.name)) is not None)
    if republished:
        plan.notes.append(f"weights/{step_name(republished[0])}..{step_name(republished[-1])} deleted: the trainer "
                          f"publishes those versions again")
    return plan


def _carry_out(run: RunDir, plan: _Plan, good: int | None, previous: Path) -> None:
    for p in plan.moves:
        _move(p, previous / _rel(run, p))
    for p in plan.copies:
        (previous / _rel(run, p)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(p, previous / _rel(run, p))
    if good is not None:
        trim_metrics(run, good, previous)
    for p in plan.deletes:
        if p.parent == run.weights:
            _delete_weights(p)
        elif p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def prepare(run: RunDir, max_steps: int, *, config: Any = None, overwrite: bool = False,
            keep: Iterable[str] = (), dry_run: bool = False) -> Resume:
    """Get ``run`` ready for its processes to start (see the module docstring).

    ``config``: the new run's config, compared with the recorded ``config.toml`` (None: the
    recorded one is what runs, as in a requeued batch job). ``overwrite``: start afresh,
    every earlier file set aside. ``keep``: paths relative to the run directory never moved
    (a batch script's own log). ``dry_run``: decide and refuse, but move nothing.
    Raises :class:`PrimerlError` (one line) for a finished run or a config that differs.
    """
    keep = {str(Path(k)) for k in keep}
    if not run.root.is_dir():
        return Resume(None, None, ())
    if overwrite:
        return _overwrite(run, keep, dry_run)
    good, unusable = survey(run)
    notes = [f"checkpoints/{step_name(n)} is unusable ({problem}): falling back to the one before"
             for n, problem in unusable]
    previous = _previous(run)
    if good is None:
        plan = _plan_start_over(run, keep, config, previous)
        if plan is None:
            return Resume(None, None, tuple(notes))
        notes += plan.notes
    else:
        _refuse_to_continue(run, good, max_steps, config)
        plan = _plan_resume(run, good, unusable, keep, previous)
        notes = [f"resuming {run.root} from checkpoints/{step_name(good)} (step {good} of {max_steps})", *notes,
                 *plan.notes]
    if dry_run:
        return Resume(good, None, tuple(notes))
    _carry_out(run, plan, good, previous)
    return Resume(good, previous if previous.exists() else None, tuple(notes))


def prepare_run(cfg: Any, *, overwrite: bool = False, keep: Iterable[str] = (), dry_run: bool = False) -> Resume:
    """:func:`prepare` for a resolved run config: what a launcher calls before it writes
    ``config.toml`` and starts anything. Prints nothing; the caller shows ``notes``."""
    return prepare(RunDir(Path(cfg.output_dir).resolve()), cfg.max_steps, config=cfg, overwrite=overwrite,
                   keep=keep, dry_run=dry_run)


def main(argv: list[str] | None = None) -> int:
    """``python -m primerl.resume OUT [--keep PATH ...] [--dry-run]``: prepare a run directory
    whose processes are about to start with its own ``config.toml`` (a batch script, a
    requeued job). Exit 0 when they may start, 2 (one line) when they must not."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m primerl.resume", description=main.__doc__)
    parser.add_argument("output_dir")
    parser.add_argument("--keep", action="append", default=[], help="a path under OUT never moved (repeatable)")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    run = RunDir(Path(args.output_dir).resolve())
    try:
        steps = _recorded_max_steps(run)
        result = prepare(run, 100 if steps is None else steps, keep=args.keep, dry_run=args.dry_run)
    except PrimerlError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for note in result.notes:
        print(note)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
