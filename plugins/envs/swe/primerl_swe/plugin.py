"""Entry point module: registers the environment lazily."""

from primerl import hookimpl


@hookimpl
def register_envs(register):
    register("swe", "primerl_swe.env:Swe",
             description="SWE-bench-format tasks: tools in a sandboxed scratch checkout, reward = tests pass")
