"""Entry point of primerl-qwen3-moe (group ``primerl``): registers the ``qwen3-moe`` model."""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "qwen3-moe",
        "primerl_qwen3_moe.adapter:Qwen3Moe",
        description="Qwen3-MoE (qwen3_moe): GQA with qk-norm + softmax-routed MoE; presets tiny, full",
    )
