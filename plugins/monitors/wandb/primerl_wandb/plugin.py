"""Entry point module: registers the wandb monitor lazily (listing plugins imports no wandb)."""

from primerl import hookimpl


@hookimpl
def register_monitors(register):
    register("wandb", "primerl_wandb.monitor:WandbMonitor",
             description="Weights & Biases: every step's metrics, the run's config, rollout sample tables "
                         "(online, or offline for a later `wandb sync`)")
