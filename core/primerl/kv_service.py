"""Starting a KV store's run service, the same way under every launcher.

What and why. A store declares what a run needs set up once, before its servers
(:attr:`primerl.kv_stores.KVStoreCapabilities.run_service`: Mooncake's master, the disk
store's shared folder under prefill/decode, a third party's own service). A launcher never
asks which store it is: it calls :func:`start_run_service` with the config and a
:class:`~primerl.kv_stores.ServiceSite` (where the service runs), writes the options the
service returns into the run-time record (every server's store gets them:
:func:`primerl.kv_stores.store_options`), and stops the service after the servers.

The local launcher does that in its own process. A launcher whose processes run elsewhere (a
Slurm job on its nodes) runs it as a process of its own::

    python -m primerl.kv_service OUT/config.toml --options FILE [--host H] [--port P] [--launch ID]

which starts the service, writes its options to ``FILE`` (a JSON object, written whole: a
reader never sees half of it; ``{}`` when the run needs no service: the file's existence
says the service serves), and then stays until it is stopped (SIGTERM, SIGINT: the service
is stopped, exit 143 / 130), also when the service runs nothing to watch (a folder), so that
a supervisor treats it as any run service (:attr:`primerl.supervisor.Duty.SUPPORTS`: its
exit fails the run). A service whose process ends on its own ends it (exit 1, naming it).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from primerl.kv_stores import RunService, ServiceSite

__all__ = ["start_run_service", "main"]


def start_run_service(cfg: Any, site: ServiceSite) -> RunService | None:
    """The run service ``inference.kv_store`` declares, started at ``site`` (its one line of
    description printed); None when the store declares none or this run needs none."""
    from primerl.registry import get_registry, load_target

    target = get_registry().capabilities("kv_store", cfg.inference.kv_store).run_service
    service = load_target(target)(cfg, site) if target else None
    if service is not None:
        said = service.describe()
        if said:
            print(said, flush=True)
    return service


def write_options(path: Path, options: dict[str, Any]) -> None:
    """``options`` as one JSON object in ``path``, renamed into place."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(options) + "\n")
    tmp.replace(path)


def serve(cfg: Any, site: ServiceSite, options_file: Path, poll_s: float = 1.0) -> int:
    """Start the run's service, write its options, and follow it (the module docstring)."""

    def on_signal(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, on_signal)
    service = start_run_service(cfg, site)
    try:
        write_options(options_file, service.options() if service is not None else {})
        while service is None or service.alive() is not False:  # None: nothing runs, wait to be stopped
            time.sleep(poll_s)
        print(f"the KV store's run service ({cfg.inference.kv_store}) stopped serving: "
              f"{service.describe() or 'no description'}", file=sys.stderr, flush=True)
        return 1
    finally:
        if service is not None:
            service.stop()


def main(argv: list[str] | None = None) -> None:
    from primerl.config import ConfigSources, load_config
    from primerl.errors import PrimerlError
    from primerl.rundir import RunDir

    p = argparse.ArgumentParser(prog="python -m primerl.kv_service", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="the run's resolved config (OUT/config.toml)")
    p.add_argument("--options", required=True, help="where the service's options go (a JSON object)")
    p.add_argument("--host", default="127.0.0.1", help="the address the service listens on, which every server reaches")
    p.add_argument("--port", type=int, default=0, help="the first port it may take (0: free ones)")
    p.add_argument("--launch", default="", help="what tells this launch from another (the Slurm job id)")
    a = p.parse_args(argv)
    try:
        cfg = load_config(ConfigSources(files=[a.config]))
        site = ServiceSite(run_dir=RunDir(Path(cfg.output_dir).resolve()), host=a.host, port=a.port, launch=a.launch)
        code = serve(cfg, site, Path(a.options))
    except PrimerlError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        code = 2
    raise SystemExit(code)


if __name__ == "__main__":
    main()
