"""Environment worker processes: env code never runs in the orchestrator's process.

Why: an environment runs model-written code, slow verifiers and third-party libraries. A
turn that hangs, leaks memory or kills its process (a segfault, ``os._exit``) must cost
one episode, not the run. Each worker is a process holding its own instance of the env
(built from the env's registered name and config); the orchestrator sends it one call at
a time over a pipe. A call past its timeout gets its worker killed and replaced; a worker
that dies mid-call is replaced too; either way the call raises :class:`EnvCallError` and
the episode is dropped, while every other episode carries on.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any


class EnvCallError(RuntimeError):
    """An env call that failed, timed out or lost its worker."""


def _serve(conn: Any, env_name: str, env_config: Any) -> None:
    from primerl.registry import get_registry

    env = get_registry().load("env", env_name)(env_config)
    while True:
        try:
            method, args = conn.recv()
        except EOFError:
            return
        try:
            conn.send(("ok", getattr(env, method)(*args)))
        except Exception as e:  # reported to the caller, the worker stays up
            conn.send(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))


class _Worker:
    def __init__(self, ctx: Any, env_name: str, env_config: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, env_name, env_config), daemon=True,
                                name=f"primerl-env-{env_name}")
        self.proc.start()
        child.close()

    def call(self, method: str, args: tuple) -> Any:
        self.conn.send((method, args))
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise EnvCallError(f"env worker died during {method} (exit code {self.proc.exitcode})") from None
        if reply[0] == "error":
            raise EnvCallError(f"{method} failed: {reply[1]}\n{reply[2]}")
        return reply[1]

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class EnvWorkers:
    """``processes`` env workers; ``await call(method, *args, timeout=s)`` runs
    ``env.method(*args)`` in a free one."""

    def __init__(self, env_name: str, env_config: Any, processes: int) -> None:
        self.env_name, self.env_config = env_name, env_config
        self.ctx = mp.get_context("spawn")  # no forked copy of the orchestrator's threads and sockets
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self.workers = [_Worker(self.ctx, env_name, env_config) for _ in range(processes)]
        for w in self.workers:
            self.idle.put_nowait(w)
        self.threads = ThreadPoolExecutor(max_workers=processes, thread_name_prefix="env-call")
        self.replaced = 0

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.ctx, self.env_name, self.env_config)
        self.workers[self.workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        worker = await self.idle.get()
        loop = asyncio.get_running_loop()
        try:
            result = await asyncio.wait_for(loop.run_in_executor(self.threads, worker.call, method, args), timeout)
        except asyncio.TimeoutError:
            worker = self._replace(worker)
            raise EnvCallError(f"env {self.env_name}.{method} took longer than {timeout:.0f}s; worker killed") from None
        except asyncio.CancelledError:
            worker = self._replace(worker)  # its call may still be running: never hand it out again
            raise
        except EnvCallError:
            if not worker.proc.is_alive():
                worker = self._replace(worker)
            raise
        finally:
            self.idle.put_nowait(worker)
        return result

    def close(self) -> None:
        for w in self.workers:
            w.kill()
        self.threads.shutdown(wait=False, cancel_futures=True)
