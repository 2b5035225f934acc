"""The run-time record: what a launcher discovers when it starts a run (``OUT/runtime.json``).

User settings live in ``config.toml`` (typed keys, compared on resume). What only exists once
a launcher has started the run's processes — the ports it picked, the nodes Slurm gave, the
address of the Mooncake master it started — is not a setting: the launcher writes it here,
atomically, before it starts the processes that need it, and each process reads it at start
(:func:`read_runtime`). A process started by hand (``primerl inference``) finds none and
uses the config alone. Nothing of it reaches a process through environment variables.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from primerl.rundir import RunDir, write_atomically

__all__ = ["FORMAT", "VERSION", "RunTime", "read_runtime"]

FORMAT = "primerl.runtime"
VERSION = 1


@attrs.frozen(kw_only=True)
class RunTime:
    """One launch of a run: where its servers are and what its KV store's service set up."""

    inference_urls: tuple[str, ...] = ()  # every inference server (prefill ones first with P/D)
    prefill_urls: tuple[str, ...] = ()  # with prefill/decode: the prefill pool
    decode_urls: tuple[str, ...] = ()  # and the decode pool
    # keyword arguments the KV store's run service set (Mooncake's master address, the disk
    # store's shared folder), given to every server's store on top of inference.kv_store_options
    kv_store_options: dict[str, Any] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "version": VERSION, **attrs.asdict(self)}

    def write(self, run: RunDir) -> None:
        write_atomically(run.runtime, lambda tmp: tmp.write_text(json.dumps(self.to_json(), indent=1)))


def read_runtime(output_dir: str | Path) -> RunTime | None:
    """The run-time record of the run in ``output_dir``; None when no launcher wrote one."""
    path = RunDir(output_dir).runtime
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path} is unreadable ({exc}): start the run with `primerl run` again") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("version", 0) > VERSION:
        raise ValueError(f"{path} is not a primerl run-time record of version {VERSION}")
    return RunTime(inference_urls=tuple(data.get("inference_urls", ())), prefill_urls=tuple(data.get("prefill_urls", ())),
                   decode_urls=tuple(data.get("decode_urls", ())), kv_store_options=dict(data.get("kv_store_options", {})))
