"""Entry point module: registers the vllm-router router lazily."""

from primerl import hookimpl


@hookimpl
def register_routers(register):
    register("vllm-router", "primerl_vllm_router.router:VllmRouter",
             description="The vllm-router process in front of the servers (policy cache_aware by default; "
                         "PRIMERL_VLLM_ROUTER_POLICY, PRIMERL_VLLM_ROUTER_ARGS)")
