"""primerl-kimi: the Kimi K2 model plugin for primerl (HF ``deepseek_v3`` architecture).

Modules, each with one role:

* ``plugin``: the entry point; registers the ``kimi`` model lazily (imports nothing heavy).
* ``adapter``: the ``Kimi`` model adapter (presets, MoE layout; build and checkpoints from
  :class:`primerl.models.HFModelAdapter`).
* ``presets``: the HF config dicts of the ``tiny`` and ``full`` presets.
* ``model``: our torch implementation with the packed/ragged/cached forward.
"""
