"""Entry point of primerl-kimi (group ``primerl``): registers the ``kimi`` model adapter.

The target is a lazy string, so listing plugins imports neither torch nor transformers.
"""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "kimi",
        "primerl_kimi.adapter:Kimi",
        description="Kimi K2 (deepseek_v3): MLA + YaRN + 384-expert sigmoid MoE; presets tiny, full",
    )
