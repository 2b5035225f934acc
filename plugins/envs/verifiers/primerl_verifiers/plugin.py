"""Entry point module: registers the bridge lazily (verifiers is imported only when used)."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("verifiers", "primerl_verifiers.env:VerifiersEnv",
             description="any verifiers (classic API, < 0.4) environment by id: --env.id NAME [--env.args.KEY V]")
