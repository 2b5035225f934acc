"""Start a Mooncake master as a child process, and wait until it serves.

What and why. A Mooncake Store pool is the memory its clients (here: every inference
server of a run) lend it, plus one master that keeps the directory of objects and hands
out space. The master is one small process (``mooncake_master``, shipped in the wheel);
clients exchange their transfer metadata directly (``P2PHANDSHAKE``), or through the
master's HTTP metadata server (also started), so no etcd is needed. :class:`MooncakeMaster` starts it with free ports on ``host``, in its
own process group and set to die with its parent
(:func:`primerl.children.own_group_and_die_with_parent`), waits until its health endpoint
says it serves, and gives the addresses clients need (:meth:`MooncakeMaster.options`: the
keywords of :class:`primerl_kv_mooncake.store.MooncakeStore`). Every launcher starts one per
run (:func:`run_service`, the store's declared run service); tests and benchmarks start
their own.

    python -m primerl_kv_mooncake.master [--host H]   # prints master=... and metadata=..., serves until ^C
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from primerl.children import own_group_and_die_with_parent
from primerl.kv_stores import ServiceSite
from primerl_kv_mooncake.install import MooncakeUnavailable, master_binary, missing_library_fix


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listens(pid: int, host: str, port: int) -> bool:
    """Whether process ``pid`` holds a socket listening on TCP ``port`` (Linux /proc; where
    /proc cannot tell, whether anything accepts connections on ``host:port``)."""
    if not os.path.isdir(f"/proc/{pid}/fd"):
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            return False
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd") if os.path.isdir(f"/proc/{pid}/fd") else ():
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in list(f)[1:]]
        except OSError:
            continue
        if any(c[3] == "0A" and int(c[1].rsplit(":", 1)[1], 16) == port and c[9] in inodes for c in rows):
            return True
    return False


class MooncakeMaster:
    """One ``mooncake_master`` child process (see the module docstring).

    ``host``: the address it listens on and clients use (127.0.0.1 for one machine; a
    reachable address of this node when servers on other nodes share the pool). Ports 0
    are picked free. ``log``: where its output goes (default: a temporary file, whose tail
    an error shows). ``args``: more ``mooncake_master`` flags (e.g. ``--eviction_high_watermark_ratio=0.8``).
    """

    def __init__(self, host: str = "127.0.0.1", *, rpc_port: int = 0, metadata_port: int = 0, metrics_port: int = 0,
                 log: str | os.PathLike | None = None, args: tuple[str, ...] = ()) -> None:
        self.host = host
        self.rpc_port = rpc_port or free_port(host)
        self.metadata_port = metadata_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.log = Path(log) if log is not None else Path(tempfile.mkstemp(prefix="mooncake-master-", suffix=".log")[1])
        self.args = tuple(args)
        self.proc: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (a client's ``master_server_addr``)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """The HTTP metadata server the transfer engines register with."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def command(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_address={self.host}", f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}", f"--http_metadata_server_port={self.metadata_port}",
            f"--metrics_host={self.host}", f"--metrics_port={self.metrics_port}",
            *self.args,
        ]

    def start(self, timeout: float = 30.0) -> MooncakeMaster:
        """Start the master and return once it serves; MooncakeUnavailable if it cannot."""
        cmd = self.command()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         preexec_fn=own_group_and_die_with_parent)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                fix = missing_library_fix(tail)
                raise MooncakeUnavailable(f"mooncake_master exited with code {self.proc.returncode}"
                                          + (f": {fix}" if fix else f"; its log ({self.log}) ends: {tail[-500:]}"))
            if self.ready():
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise MooncakeUnavailable(f"mooncake_master did not serve within {timeout:.0f} s (log: {self.log})")
            time.sleep(0.05)

    def ready(self) -> bool:
        """Whether the master says it serves (its health endpoint) and this process, not
        another one, listens on the RPC and metadata ports (a master whose port is taken
        answers its health check for a moment before it exits)."""
        try:
            with urllib.request.urlopen(f"http://{self.host}:{self.metrics_port}/health", timeout=1) as r:
                if not json.loads(r.read()).get("service_ready"):
                    return False
        except (OSError, ValueError):
            return False
        pid = self.proc.pid if self.proc is not None else None
        return pid is not None and all(_listens(pid, self.host, port) for port in (self.rpc_port, self.metadata_port))

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def describe(self) -> str:
        return f"Mooncake master at {self.address} (log: {self.log})"

    def alive(self) -> bool:
        """Whether the master process still runs."""
        return self.proc is not None and self.proc.poll() is None

    def options(self) -> dict[str, str]:
        """What every store of the run needs to reach this master (``MooncakeStore``'s keywords,
        its ``[inference.kv_store_options]``): its address and its HTTP metadata server (every
        client given these uses it). :func:`main` prints them as ``key=value`` lines in this
        order, ``metadata`` last: a launcher that reads the output may take it for "serving"."""
        return {"master": self.address, "metadata": self.metadata_url}

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the master and its process group (SIGTERM, then SIGKILL)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> MooncakeMaster:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_service(cfg: Any, site: ServiceSite) -> MooncakeMaster | None:
    """The store's run service (:class:`primerl.kv_stores.KVStoreCapabilities`): a master for
    the run on ``site.host`` (its ports from ``site.port`` on: RPC, metadata, metrics; free ones
    when 0), logging to ``logs/mooncake.log``, unless ``inference.kv_store_options`` names one
    (``master``)."""
    if cfg.inference.kv_store_options.get("master"):
        return None
    ports = {} if not site.port else {"rpc_port": site.port, "metadata_port": site.port + 1,
                                      "metrics_port": site.port + 2}
    return MooncakeMaster(site.host, log=site.run_dir.logs / "mooncake.log", **ports).start()


def start_master(host: str = "127.0.0.1", **kwargs) -> MooncakeMaster:
    """A serving :class:`MooncakeMaster` (see there for the arguments)."""
    return MooncakeMaster(host, **kwargs).start()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m primerl_kv_mooncake.master", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--rpc-port", type=int, default=0)
    p.add_argument("--metadata-port", type=int, default=0)
    p.add_argument("--metrics-port", type=int, default=0)
    a = p.parse_args(argv)
    master = start_master(a.host, rpc_port=a.rpc_port, metadata_port=a.metadata_port, metrics_port=a.metrics_port)
    for k, v in master.options().items():
        print(f"{k}={v}", flush=True)
    try:
        master.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        master.stop()


if __name__ == "__main__":
    main()
