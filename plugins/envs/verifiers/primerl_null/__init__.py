"""``primerl-null``: verifiers' null harness with its chat program run inside the env worker.

verifiers' ``null`` harness plays a task with a chat program (the model answers, calling the
task's MCP tools if it has any) that the subprocess runtime starts once per rollout: a Python
process importing openai, about 1.5 CPU-seconds before its first request, for a rollout that
is one 12-token answer on a laptop run. The program executes nothing itself (its tools are
servers it reaches by URL), so running it in the worker changes nothing but the process:
verifiers' harness contract allows a harness to run its loop in-process as long as every
model call goes through the interception endpoint, which this one does.

So :class:`WorkerNullHarness` is the null harness whose ``launch`` runs the very program the
subprocess runtime would start (verifiers' ``CHAT_PROGRAM_SOURCE``, its ``main`` and argv
built by verifiers' own ``launch_chat_program``), loaded once per worker as a module and
awaited on the worker's event loop; its exit status and traceback become the
``ProgramResult`` the harness checks as before. The runtime is still provisioned per rollout
(its workdir holds the initial-messages file the program reads). Where the program needs a
process of its own — another runtime than subprocess, or variables for its process (the
harness config's ``env``, the task's runtime variables) — it is launched as verifiers does.

verifiers loads a harness by id from a top-level package exporting it in ``__all__``
(``--env.harness primerl-null``); the bridge chooses it for ``null`` in the subprocess runtime
unless ``--env.in_process false``.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import sys
import traceback
import types
import weakref
from pathlib import Path
from typing import Any

from verifiers.v1.harnesses.null.harness import NullHarness
from verifiers.v1.harnesses.utils.launch import CHAT_PROGRAM_SOURCE, launch_chat_program
from verifiers.v1.runtimes import ProgramResult, Runtime
from verifiers.v1.runtimes.subprocess import SubprocessRuntime

__all__ = ["WorkerNullHarness"]

PROGRAM = "primerl-null-chat-program"  # argv[0] of the in-worker program (what prepare_uv_script returns)
_ARGV: contextvars.ContextVar[list[str]] = contextvars.ContextVar("primerl_null_argv")
_program: types.ModuleType | None = None
_clients: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # event loop -> its HTTP client


def program() -> types.ModuleType:
    """verifiers' chat program as a module of this process, loaded once: its own text (the
    bundled utils modules, inert on import as ``__main__`` is not its name), with
    ``parse_args`` reading the argv of the rollout awaiting it and one HTTP client per event
    loop (the program leaves its client open, which a process exit closes and a worker would
    leak once per rollout)."""
    global _program
    if _program is None:
        module = types.ModuleType("primerl_null_chat_program")
        sys.modules[module.__name__] = module  # for anything in it that looks its module up
        exec(compile(CHAT_PROGRAM_SOURCE, "<verifiers chat program>", "exec"), module.__dict__)
        parse = module.parse_args

        def parse_args() -> Any:
            saved, sys.argv, usage = sys.argv, [PROGRAM, *_ARGV.get()], io.StringIO()
            try:  # synchronous: no other rollout runs while argv and stderr are swapped
                with contextlib.redirect_stderr(usage):
                    return parse()
            except SystemExit as exc:  # argparse's usage error, as the process's stderr would hold it
                raise SystemExit(exc.code) from ValueError(usage.getvalue().strip())
            finally:
                sys.argv = saved

        module.parse_args = parse_args
        module.DefaultAsyncHttpxClient = _http_client
        # what it prints before exiting on a model transport error is the ProgramResult's
        # stderr here (the exit's cause), not the worker's
        module.traceback = types.SimpleNamespace(print_exc=lambda *_a, **_kw: None)
        _program = module
    return _program


def _http_client(**kwargs: Any) -> Any:
    """The running loop's HTTP client for the program's OpenAI client (made on first use)."""
    import asyncio

    from openai import DefaultAsyncHttpxClient

    loop = asyncio.get_running_loop()
    if loop not in _clients:
        _clients[loop] = DefaultAsyncHttpxClient(**kwargs)
    return _clients[loop]


async def aclose() -> None:
    """Close the running loop's HTTP client (the bridge calls it when its worker stops)."""
    import asyncio

    client = _clients.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def run_program(argv: list[str], workdir: Path) -> ProgramResult:
    """Await the chat program's ``main`` with ``argv`` (a file argument relative to the
    runtime's workdir, its cwd as a process, made absolute): exit status 0, the status it
    exits with, or 1 and the traceback of what it raised."""
    flag = "--initial-messages-file="
    argv = [f"{flag}{workdir / a[len(flag):]}" if a.startswith(flag) else a for a in argv]
    token = _ARGV.set(argv)
    try:
        await program().main()
    except SystemExit as exc:  # argparse's errors; the model transport's status (97)
        code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
        cause = exc.__cause__ or exc.__context__
        detail = "".join(traceback.format_exception(cause)) if cause else str(exc.code or "")
        return ProgramResult(exit_code=code, stdout="", stderr=detail)
    except Exception:  # noqa: BLE001 - the program's failure is its exit status, as a process's would be
        return ProgramResult(exit_code=1, stdout="", stderr=traceback.format_exc())
    finally:
        _ARGV.reset(token)
    return ProgramResult(exit_code=0, stdout="", stderr="")


class _InWorker:
    """What ``launch_chat_program`` asks of its runtime, with the program run in this process."""

    def __init__(self, runtime: SubprocessRuntime) -> None:
        self.runtime = runtime

    async def write(self, path: str, data: bytes) -> None:
        await self.runtime.write(path, data)

    async def prepare_uv_script(self, source: str, env: dict[str, str] | None = None, *, activate: bool = True) -> list[str]:
        if source != CHAT_PROGRAM_SOURCE:
            raise RuntimeError("primerl-null runs verifiers' chat program only")
        return [PROGRAM]

    async def run_program(self, argv: list[str], env: dict[str, str]) -> ProgramResult:
        return await run_program(argv[1:], Path(self.runtime.workdir))


class WorkerNullHarness(NullHarness):
    """The null harness, its chat program awaited in the worker where it needs no process."""

    def _in_worker(self, runtime: Runtime) -> bool:
        return isinstance(runtime, SubprocessRuntime) and not runtime.process_env(self.config.resolved_env)

    async def setup(self, runtime: Runtime) -> None:
        if not self._in_worker(runtime):  # launched as verifiers does: its uv environment first
            await super().setup(runtime)

    async def launch(self, ctx: Any, trace: Any, runtime: Runtime, endpoint: str, secret: str,
                     mcp_urls: dict[str, str], data: Any, tool_interception_url: str | None = None) -> ProgramResult:
        if not self._in_worker(runtime):
            return await super().launch(ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url)
        system_prompt, prompt = self.resolve_prompt(data)
        extra = [f"--tool-interception-url={tool_interception_url}"] if tool_interception_url else []
        return await launch_chat_program(CHAT_PROGRAM_SOURCE, self.config, ctx, trace, _InWorker(runtime), endpoint,
                                         secret, mcp_urls, system_prompt, prompt, extra_args=extra)
