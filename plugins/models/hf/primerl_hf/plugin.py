"""Entry point of primerl-hf (group ``primerl``): registers the ``hf`` model."""

from primerl import hookimpl


@hookimpl
def register_models(register):
    register(
        "hf",
        "primerl_hf.adapter:TransformersAdapter",
        description="any causal LM transformers loads (--model.checkpoint DIR), through transformers' own modeling code",
    )
