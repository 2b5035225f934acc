"""The ``wandb`` monitor plugin (see :mod:`primerl_wandb.monitor`)."""
