"""Entry point of primerl-nemotron (group ``primerl``): registers the ``nemotron`` model."""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "nemotron",
        "primerl_nemotron.adapter:Nemotron",
        description="Nemotron 3 (nemotron_h): hybrid Mamba-2 / attention / relu2 MoE; presets tiny, full",
    )
