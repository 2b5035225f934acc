"""Entry point of primerl-qwen3 (group ``primerl``): registers the ``qwen3`` model."""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "qwen3",
        "primerl_qwen3.adapter:Qwen3",
        description="Qwen3 (qwen3, dense): GQA with qk-norm + SwiGLU; presets tiny, 0.6b, 8b, full (32B)",
    )
