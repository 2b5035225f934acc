"""primerl-minimax: the MiniMax-M2 (HF ``minimax_m2``) model plugin for primerl.

Modules: ``plugin`` (entry point, lazy), ``adapter`` (presets, MoE layout, capabilities,
planner shape, checkpoint names), ``presets`` (HF config dicts of ``tiny`` and ``full``),
``model`` (our torch implementation).
"""
