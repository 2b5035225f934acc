"""Entry point module: registers the sticky router lazily."""

from primerl import hookimpl


@hookimpl
def register_routers(register):
    register("sticky", "primerl_sticky.router:StickyRouter",
             description="A session stays on the server holding its prefix; new sessions go to the least "
                         "loaded healthy server (load from /metrics and in-flight counts)")
