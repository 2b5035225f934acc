"""Entry point module: registers the slurm launcher lazily."""

from primerl import hookimpl
from primerl.launchers import LauncherCapabilities


@hookimpl
def register_launchers(register):
    register("slurm", "primerl_slurm.launcher:SlurmLauncher",
             description="A run as one Slurm job: inference, trainer and orchestrator nodes, followed live",
             capabilities=LauncherCapabilities(supports_pd=True, dry_run=True))
