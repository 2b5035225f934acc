"""Entry point of primerl-minimax (group ``primerl``): registers the ``minimax`` model."""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "minimax",
        "primerl_minimax.adapter:MiniMax",
        description="MiniMax-M2 (minimax_m2): GQA with per-layer qk-norm and partial RoPE + sigmoid-routed MoE "
                    "256 experts top-8; presets tiny, full",
    )
