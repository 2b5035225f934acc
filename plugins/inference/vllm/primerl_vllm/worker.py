"""A vLLM worker extension: reload weights in place, correctly on CPU too.

vLLM mixes this class into its workers (``--worker-extension-cls``); the proxy calls
:meth:`PrimerlWorkerExtension.primerl_reload_weights` through ``/collective_rpc``.

Why not vLLM's own ``reload_weights``: in vLLM 0.32 a reload re-runs every layer's weight
processing except the CPU MoE kernel's, which repacks expert weights into its grouped-gemm
layout (``CPUUnquantizedExperts.process_weights_after_loading`` is only called the first
time). After a reload the expert tensors hold the checkpoint's plain layout and the kernel
reads them as packed: the same checkpoint reloaded gives different outputs (measured:
greedy completions change, vLLM's own weight checksums of every ``w13_weight`` and
``w2_weight`` differ, and packing them again restores both). So this method reloads with
vLLM's ``reload_weights`` and then packs the expert weights of each CPU MoE layer whose
packing vLLM skipped; it watches the packing calls, so once vLLM packs on reload itself
nothing is packed twice.

Nothing is imported at module level: the worker imports this module before the model.
"""

from __future__ import annotations

from typing import Any


def _cpu_moe_layers(model: Any) -> list[tuple[Any, Any]]:
    """(layer, experts kernel) of every MoE layer run by vLLM's unquantized CPU kernel."""
    out = []
    for module in model.modules():
        if "w13_weight" not in getattr(module, "_parameters", {}):
            continue
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if type(experts).__name__ == "CPUUnquantizedExperts" and not getattr(experts, "_use_zentorch", False):
            out.append((module, experts))
    return out


class PrimerlWorkerExtension:
    """Methods added to vLLM's worker class (``self`` is the worker)."""

    def primerl_reload_weights(self, weights_path: str) -> dict[str, int]:
        """Reload the HF checkpoint at ``weights_path`` in place; returns how many CPU MoE
        layers had their expert weights packed here."""
        import torch
        from vllm import _custom_ops as ops

        layers = _cpu_moe_layers(self.model_runner.get_model())
        packed_by_vllm: set[int] = set()
        for _layer, experts in layers:  # watch vLLM's own packing calls during the reload
            original = experts.process_weights_after_loading

            def spy(layer: Any, _original: Any = original) -> Any:
                packed_by_vllm.add(id(layer))
                return _original(layer)

            experts.process_weights_after_loading = spy
        try:
            self.reload_weights(weights_path=weights_path)
        finally:
            for _layer, experts in layers:
                experts.__dict__.pop("process_weights_after_loading", None)
        packed = 0
        with torch.no_grad():
            for layer, experts in layers:
                if id(layer) in packed_by_vllm:
                    continue
                cfg = experts.moe_config
                if experts._padded_intermediate_size(cfg) != cfg.intermediate_size_per_partition:
                    raise RuntimeError(
                        f"reloading weights into CPU MoE layer {getattr(layer, 'layer_name', '?')} whose intermediate "
                        "size vLLM pads is not supported; restart the server to load new weights")
                for name in ("w13_weight", "w2_weight"):
                    param = getattr(layer, name)
                    param.data.copy_(ops.cpu_prepack_moe_weight(param.data.clone(), experts.isa))
                packed += 1
        return {"packed_moe_layers": packed}
