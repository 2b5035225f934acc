"""Environment worker processes: env code never runs in the orchestrator's process.

Why: an environment runs model-written code, slow verifiers and third-party libraries. A
turn that hangs, leaks memory or kills its process (a segfault, ``os._exit``) must cost
one episode, not the run. Each worker is a process holding its own instance of the env
(built from the env's registered name and config); the orchestrator sends it one call at
a time over a pipe. A call past its timeout gets its worker killed and replaced; a worker
that dies mid-call is replaced too; either way the call raises :class:`EnvCallError` and
the episode is dropped, while every other episode carries on. A
:class:`~primerl.envs.TaskError` the env raises (a harness failure) reaches the caller as
itself, so the orchestrator can tell a broken task from a broken env call; a
:class:`~primerl.errors.PrimerlError` (the user's setup is wrong, e.g. a tool the env
needs is not installed) arrives as one, message only, and stops the run.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from primerl import watchdog
from primerl.envs import EnvConfig, Task, TaskError
from primerl.errors import PrimerlError


class EnvCallError(RuntimeError):
    """An env call that failed, timed out or lost its worker."""


def _serve(conn: Any, env: str | type, env_config: Any) -> None:
    import signal

    # A worker ends when its pipe closes (the orchestrator closed the pool, or died), never
    # on the signals sent to the orchestrator's process group: it must get to env.close().
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    watchdog.dump_stacks_on_signal()  # a stuck run's report shows where a call hangs
    if isinstance(env, str):  # a registry pick: "NAME" or "PLUGIN:NAME", as in --env
        from primerl.registry import get_registry

        env = get_registry().load("env", env)
    env = env(env_config)
    try:
        while True:
            try:
                method, args = conn.recv()
            except (EOFError, OSError):  # the orchestrator closed the pool, or died
                return
            try:
                reply = ("ok", getattr(env, method)(*args))
            except TaskError as e:  # the env's own verdict: this task cannot be run (no traceback needed)
                reply = ("task_error", e)
            except PrimerlError as e:  # the user's setup is wrong (a missing tool): one line, no traceback
                reply = ("user_error", str(e))
            except Exception as e:  # noqa: BLE001 - reported to the caller, the worker stays up
                reply = ("error", f"{type(e).__name__}: {e}", traceback.format_exc())
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):  # nobody is listening any more
                return
    finally:
        env.close()  # release what the env holds (scratch checkouts)


class _Worker:
    def __init__(self, ctx: Any, env: str | type, env_config: Any) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, env, env_config), daemon=True,
                                name=f"primerl-env-{_env_label(env)}")
        self.proc.start()
        child.close()
        self.broken = False  # its pipe failed: never use it again

    def call(self, method: str, args: tuple) -> Any:
        try:
            self.conn.send((method, args))
            reply = self.conn.recv()
        except (EOFError, OSError):
            self.broken = True
            raise EnvCallError(f"env worker died during {method} (exit code {self.proc.exitcode})") from None
        if reply[0] == "task_error":
            raise reply[1]
        if reply[0] == "user_error":
            raise PrimerlError(reply[1])
        if reply[0] == "error":
            raise EnvCallError(f"{method} failed: {reply[1]}\n{reply[2]}")
        return reply[1]

    def kill(self, grace_s: float = 0.0) -> None:
        """Stop the worker: close its pipe (it then calls ``env.close()`` and exits), and
        after ``grace_s`` kill it if it is still there (a stuck call)."""
        if not self.conn.closed:
            self.conn.close()
        self.proc.join(timeout=grace_s)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)


def _env_label(env: str | type) -> str:
    return env if isinstance(env, str) else env.__name__


class EnvWorkers:
    """``processes`` env workers; ``await call(method, *args, timeout=s)`` runs
    ``env.method(*args)`` in a free one. ``env`` is a registry pick as ``--env`` takes it
    (``NAME`` or ``PLUGIN:NAME``) or an env class (importable by the workers)."""

    def __init__(self, env: str | type, env_config: Any, processes: int) -> None:
        self.env, self.env_config = env, env_config
        self.env_name = env_config.name if isinstance(env_config, EnvConfig) else _env_label(env)
        self.ctx = mp.get_context("spawn")  # no forked copy of the orchestrator's threads and sockets
        self.idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self.workers = [_Worker(self.ctx, env, env_config) for _ in range(processes)]
        for w in self.workers:
            self.idle.put_nowait(w)
        self.threads = ThreadPoolExecutor(max_workers=processes, thread_name_prefix="env-call")
        self.replaced = 0
        self.closing = False  # set before cancelling calls at shutdown: close() stops the workers

    def _replace(self, worker: _Worker) -> _Worker:
        worker.kill()
        fresh = _Worker(self.ctx, self.env, self.env_config)
        self.workers[self.workers.index(worker)] = fresh
        self.replaced += 1
        return fresh

    def pids(self) -> list[int]:
        """The workers' process ids (the watchdog asks them for their stacks)."""
        return [w.proc.pid for w in self.workers if w.proc.pid is not None]

    async def call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        worker = await self.idle.get()
        loop = asyncio.get_running_loop()
        task = f" of task {args[0].id}" if args and isinstance(args[0], Task) else ""
        try:
            with watchdog.waiting("env", f"{self.env_name}.{method}{task} in worker {worker.proc.pid}"):
                result = await asyncio.wait_for(loop.run_in_executor(self.threads, worker.call, method, args), timeout)
        except asyncio.TimeoutError:
            worker = self._replace(worker)
            raise EnvCallError(f"env {self.env_name}.{method} took longer than {timeout:.0f}s; worker killed") from None
        except asyncio.CancelledError:
            if not self.closing:
                worker = self._replace(worker)  # its call may still be running: never hand it out again
            raise
        except EnvCallError:
            if worker.broken or not worker.proc.is_alive():
                worker = self._replace(worker)
            raise
        finally:
            self.idle.put_nowait(worker)
        return result

    def close(self) -> None:
        """Close every worker's pipe (each finishes its call, runs ``env.close()`` and exits);
        kill those still there after a grace period."""
        self.closing = True
        for w in self.workers:
            w.conn.close()
        for w in self.workers:
            w.kill(grace_s=10.0)
        self.threads.shutdown(wait=False, cancel_futures=True)
