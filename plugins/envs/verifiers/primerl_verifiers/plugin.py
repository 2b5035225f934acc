"""Entry point module: registers the bridge lazily (verifiers is imported only when used)."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("verifiers", "primerl_verifiers.env:VerifiersEnv",
             description="any verifiers environment by id (0.4's v1 stack, or 0.3's classic API): --env.id NAME "
                         "[--env.args.KEY V]")
