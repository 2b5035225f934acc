"""Entry point of primerl-glm5 (group ``primerl``): registers the ``glm5`` model adapter.

The target is a lazy string, so listing plugins imports neither torch nor transformers.
"""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "glm5",
        "primerl_glm5.adapter:Glm5",
        description="GLM-5 (glm_moe_dsa): MLA + DeepSeek sparse attention + MoE; presets tiny, full",
    )
