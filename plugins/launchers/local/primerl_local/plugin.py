"""Entry point module: registers the local launcher lazily."""

from primerl import hookimpl
from primerl.launchers import LauncherCapabilities


@hookimpl
def register_launchers(register):
    register("local", "primerl_local.launcher:LocalLauncher",
             description="Inference, orchestrator and trainer as local processes, with a live view",
             capabilities=LauncherCapabilities(supports_pd=True))
