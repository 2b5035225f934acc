"""The ``vllm-router`` router plugin (see :mod:`primerl_vllm_router.router`)."""
