"""The ``vllm-router`` router: the vllm-router process in front of the inference servers.

`vllm-router <https://github.com/vllm-project/router>`_ (PyPI ``vllm-router``, a Rust
router with a Python launcher) balances OpenAI requests over workers with one of its
policies: ``cache_aware`` (an approximate prefix tree per worker; the default here),
``consistent_hash`` (a session key hashed onto a ring), ``sticky_least_loaded``,
``kv_aware``, ``power_of_two``, ``round_robin``, ``random``; it health-checks workers and
retries failed requests itself. primerl's servers pass through it unchanged, extra
response fields (``token_ids``, ``policy_versions``) included.

``start(servers)`` launches it as a child process (its own process group, SIGTERMed when
the process that started it dies: :func:`primerl.children.own_group_and_die_with_parent`)
on a free port with ``--worker-urls`` and the policy, and returns once it answers
``/health`` (a clear error with its last output if it exits or times out first);
``route`` answers its URL; ``close`` stops the whole group. When the orchestrator's
client ejects or readmits a server (the optional ``servers_up``), the worker is removed
from or added back to the running router (``/remove_worker``, ``/add_worker``); between
those, vllm-router's own health checks, retries and circuit breaker apply.

Sessions: vllm-router reads a request's session from the ``X-Session-ID`` header
(``consistent_hash`` and ``sticky_least_loaded`` keep a session's requests on one
worker; without it they hash the body, a new key every turn). :meth:`VllmRouter.headers`
gives that header for a :class:`~primerl.routers.Route`; the client sending the request
must add it. ``cache_aware`` needs no header: it matches the request text.

Settings: the constructor's keywords, ``[inference.router_options]`` (typed config keys,
compared on resume): ``policy`` (a policy name) and ``args`` (more flags, a list or a
shell-quoted string, appended last so they override ours: ``"--balance-abs-threshold 8
--health-check-interval-secs 5"``); else the defaults. It runs with ``--log-level warning`` (it logs every request at ``info``) unless
the flags say otherwise. ``vllm-router --help`` lists every flag. See docs/routers.md.
"""

from __future__ import annotations

import collections
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from primerl.errors import PluginError
from primerl.routers import Route

POLICIES = ("cache_aware", "consistent_hash", "sticky_least_loaded", "kv_aware", "power_of_two",
            "round_robin", "random")
INSTALL = "pip install vllm-router==0.1.17"
SESSION_HEADER = "X-Session-ID"  # what vllm-router's consistent_hash / sticky_least_loaded key on
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def find_binary() -> str | None:
    """The ``vllm-router`` launcher: next to this interpreter first (a venv's bin, even when
    the venv is not activated; not a shim that would fork), then on PATH."""
    here = Path(sys.executable).parent / "vllm-router"
    if here.is_file() and os.access(here, os.X_OK):
        return str(here)
    return shutil.which("vllm-router")


class VllmRouter:
    """External router process: ``route`` always answers its URL."""

    def __init__(self, *, policy: str | None = None, args: Sequence[str] | str | None = None,
                 binary: str | None = None, host: str = "127.0.0.1", ready_s: float = 60.0,
                 stop_s: float = 10.0) -> None:
        self.policy = policy or "cache_aware"
        if self.policy not in POLICIES:
            raise PluginError(f"vllm-router has no policy '{self.policy}'; policies are {', '.join(POLICIES)}")
        extra = args if args is not None else ""
        self.args = shlex.split(extra) if isinstance(extra, str) else list(extra)
        self.binary, self.host, self.ready_s, self.stop_s = binary, host, ready_s, stop_s
        self.url = ""
        self.workers: list[str] = []  # the servers the running router balances over
        self.proc: subprocess.Popen | None = None
        self._output: collections.deque[str] = collections.deque(maxlen=400)
        self._reader: threading.Thread | None = None

    # ---- the Router protocol -----------------------------------------------------------------
    def start(self, servers: Sequence[str]) -> None:
        if not servers:
            raise ValueError("the vllm-router router needs at least one inference server")
        binary = self.binary or find_binary()
        if binary is None:
            raise PluginError(f"the vllm-router router needs the vllm-router binary, which is not installed: {INSTALL}")
        for attempt in range(3):  # a free port can be taken between our probe and its bind
            port, metrics_port = free_port(self.host), free_port(self.host)
            cmd = [binary, "--worker-urls", *servers, "--policy", self.policy,
                   "--host", self.host, "--port", str(port),
                   "--prometheus-host", self.host, "--prometheus-port", str(metrics_port),
                   "--worker-startup-timeout-secs", str(max(1, int(self.ready_s))),
                   "--worker-startup-check-interval", "1", "--log-level", "warning", *self.args]
            self._launch(cmd)
            self.url = f"http://{self.host}:{port}"
            try:
                self._wait_ready()
                self.workers = list(servers)
                return
            except RuntimeError:
                tail = self.output_tail()
                self.close()
                if "Address already in use" in tail and attempt < 2:
                    continue
                raise

    def route(self, request: Route) -> str:
        if self.proc is None:
            raise RuntimeError("VllmRouter.route called before start()")
        return self.url

    def finished(self, request: Route, url: str, *, ok: bool, seconds: float) -> None:
        """Nothing to track: vllm-router keeps its own load counts, health checks and retries."""

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=self.stop_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=self.stop_s)
            except ProcessLookupError:
                pass
        try:  # anything it started in its group goes with it
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self._reader is not None:
            self._reader.join(timeout=2)
            self._reader = None

    def servers_up(self, servers: Sequence[str]) -> None:
        """The orchestrator's client ejected or readmitted a server (optional in the Router
        protocol): the running router balances over ``servers`` from now on."""
        import httpx

        if self.proc is None:
            return
        for url in [u for u in self.workers if u not in servers]:
            self._worker_call(httpx, "/remove_worker", url)
            self.workers.remove(url)
        for url in [u for u in servers if u not in self.workers]:
            self._worker_call(httpx, "/add_worker", url)
            self.workers.append(url)

    def _worker_call(self, httpx, path: str, url: str) -> None:
        r = httpx.post(self.url + path, params={"url": url}, timeout=10)
        if r.status_code != 200:
            raise RuntimeError(f"vllm-router {path} {url} answered {r.status_code}: {r.text[:200]}")

    # ---- sessions ----------------------------------------------------------------------------
    def headers(self, request: Route) -> Mapping[str, str]:
        """Headers the client adds to ``request`` so vllm-router keeps its session together."""
        return {SESSION_HEADER: request.session} if request.session is not None else {}

    # ---- the process -------------------------------------------------------------------------
    def _launch(self, cmd: list[str]) -> None:
        from primerl.children import own_group_and_die_with_parent

        self._output.clear()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, errors="replace",
                                     env={**os.environ, "NO_COLOR": "1"},
                                     preexec_fn=own_group_and_die_with_parent)
        self._reader = threading.Thread(target=self._read, args=(self.proc,), name="vllm-router-output",
                                        daemon=True)
        self._reader.start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stdout:  # drained always, so a chatty router never blocks on a full pipe
            self._output.append(_ANSI.sub("", line.rstrip()))
        proc.stdout.close()

    def output_tail(self, lines: int = 30) -> str:
        return "\n".join(list(self._output)[-lines:])

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + self.ready_s
        while True:
            rc = self.proc.poll()
            if rc is not None:
                self._reader.join(timeout=2)
                raise RuntimeError(f"vllm-router exited with code {rc} before it was ready; its last output:\n"
                                   f"{self.output_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"vllm-router did not answer {self.url}/health within {self.ready_s:.0f}s; "
                                   f"its last output:\n{self.output_tail()}")
            time.sleep(0.1)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None


__all__ = ["POLICIES", "SESSION_HEADER", "VllmRouter"]
