"""The building blocks primerl's model plugins are made of (a library, not a plugin).

* :mod:`primerl_blocks.layers`: RMSNorm, RoPE (default, linear, Llama 3, YaRN), MLPs, the
  reproducible HF-style init;
* :mod:`primerl_blocks.moe`: sigmoid and softmax routers that replay experts, MoE blocks
  that declare their router, experts and correction bias;
* :mod:`primerl_blocks.attention` (GQA), :mod:`primerl_blocks.mla` (multi-head latent
  attention), :mod:`primerl_blocks.mamba2` (the Mamba-2 mixer): sequence mixers over the
  core's ragged :class:`~primerl.models.batch.Batch`;
* :mod:`primerl_blocks.decoder`: :class:`~primerl_blocks.decoder.DecoderLM`, the ragged
  decoder that implements the core's model contract
  (:class:`primerl.models.contract.CausalLM`), and its pre-norm layer.

Why a distribution of its own: the contract a model satisfies is the core's
(:mod:`primerl.models.contract`), and so are the routed experts the core's transforms act
on (:mod:`primerl.models.experts`); how a model is built is the plugins' business. Every
model plugin that builds on these blocks declares ``primerl-model-blocks`` as a
dependency; the core imports nothing from here. Importing a submodule imports torch; this
package module imports nothing.
"""
