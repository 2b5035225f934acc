"""The core distribution's own plugin: the built-in losses and advantage estimators.

Registered through the ``primerl`` entry point of the core's pyproject, so discovery
finds them exactly as it finds a third party's (the core imports no plugin by name) and
``primerl plugins list`` shows them next to everything else. Targets are lazy strings:
listing plugins imports nothing of the trainer.
"""

from primerl import hookimpl


@hookimpl
def register_losses(register):
    register("default", "primerl.trainer.loss:default_loss",
             description="Importance-ratio loss with probability-difference masking (prime-rl)")


@hookimpl
def register_advantages(register):
    register("grpo", "primerl.advantages:grpo", description="Reward minus the group mean (Dr. GRPO)")
    register("grpo_std", "primerl.advantages:grpo_std",
             description="Reward minus the group mean, divided by the group std (GRPO)")
