"""Entry point module: registers the tensorboard monitor lazily (listing plugins imports nothing of it)."""

from primerl import hookimpl


@hookimpl
def register_monitors(register):
    register("tensorboard", "primerl_tensorboard.monitor:TensorBoardMonitor",
             description="TensorBoard event files under OUT/tensorboard: numeric metrics as scalars, "
                         "rollout samples as text")
