"""primerl-qwen3-moe: the Qwen3-MoE (HF ``qwen3_moe``) model plugin for primerl.

Modules: ``plugin`` (entry point, lazy), ``adapter`` (presets, MoE layout), ``presets``
(HF config dicts of ``tiny`` and ``full``), ``model`` (our torch implementation).
"""
