"""primerl-inference-vllm: vLLM as primerl's inference backend (``--inference.backend vllm``).

Modules: ``plugin`` (entry point, lazy), ``config`` (the ``[inference]`` keys of this
backend and the refusals made before anything starts), ``launch`` (vLLM's server as a
child process group), ``proxy`` (the primerl-contract server in front of it) and
``backend`` (``serve(cfg)``, tying them together), ``worker`` (vLLM's worker extension),
``weight_transfer`` (the trainer's side of the NCCL weight channel) and ``_site`` (the
``sitecustomize`` that hides torch extensions which do not load). See docs/vllm.md.
"""
