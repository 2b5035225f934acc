"""primerl-llama: the Llama (HF ``llama``) model plugin for primerl.

Modules: ``plugin`` (entry point, lazy: the ``llama`` model and the packaged checkpoints it
runs), ``adapter`` (presets, capabilities, planner shape), ``presets`` (HF config dicts),
``model`` (our torch implementation).
"""
