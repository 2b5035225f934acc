"""Entry point module: registers the ``vllm`` inference backend lazily (no vLLM, no torch)."""

from primerl import hookimpl
from primerl.inference import InferenceBackendCapabilities


@hookimpl
def register_inference_backends(register):
    register(
        "vllm",
        "primerl_vllm.backend:VllmBackend",
        description="vLLM's OpenAI server behind primerl's contract: per-token policy versions, live weight reloads",
        capabilities=InferenceBackendCapabilities(weight_sender="primerl_vllm.backend:VllmBackend.weight_sender"),
    )
