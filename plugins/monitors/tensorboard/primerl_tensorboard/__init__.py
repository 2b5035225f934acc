"""The ``tensorboard`` monitor plugin (see :mod:`primerl_tensorboard.monitor`)."""
