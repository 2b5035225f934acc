"""primerl-qwen3: the dense Qwen3 (HF ``qwen3``) model plugin for primerl.

Modules: ``plugin`` (entry point, lazy), ``adapter`` (presets, capabilities, planner shape),
``presets`` (HF config dicts of ``tiny``, ``0.6b``, ``8b`` and ``full``), ``model`` (our
torch implementation).
"""
