"""Entry point module: registers the vllm-router router lazily."""

from primerl import hookimpl


@hookimpl
def register_routers(register):
    register("vllm-router", "primerl_vllm_router.router:VllmRouter",
             description="The vllm-router process in front of the servers (router_options: policy, default "
                         "cache_aware; args, more flags)")
