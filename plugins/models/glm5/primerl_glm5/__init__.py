"""primerl-glm5: the GLM-5 (HF ``glm_moe_dsa``) model plugin for primerl.

Modules, each with one role:

* ``plugin``: the entry point; registers the ``glm5`` model lazily (imports nothing heavy).
* ``adapter``: the ``Glm5`` model adapter (presets, build, tokenizer, HF checkpoint IO).
* ``presets``: the HF config dicts of the ``tiny`` and ``full`` presets.
* ``model``: our torch implementation with the packed/ragged/cached forward.
"""
