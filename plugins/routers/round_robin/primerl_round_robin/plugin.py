"""Entry point module: registers the round-robin router lazily."""

from primerl import hookimpl


@hookimpl
def register_routers(register):
    register("round-robin", "primerl_round_robin.router:RoundRobinRouter",
             description="Requests to the inference servers in turn; a session stays on its server")
