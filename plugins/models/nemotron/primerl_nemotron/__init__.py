"""primerl-nemotron: the Nemotron 3 (HF ``nemotron_h``) model plugin for primerl.

Modules: ``plugin`` (entry point, lazy), ``adapter`` (presets, MoE layout, checkpoint
names), ``presets`` (HF config dicts of ``tiny`` and ``full``), ``model`` (our torch
implementation: Mamba-2, attention, MLP and MoE blocks).
"""
