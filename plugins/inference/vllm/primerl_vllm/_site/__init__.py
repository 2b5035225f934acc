"""The directory the vllm backend puts first on vLLM's ``PYTHONPATH``: its ``sitecustomize``
hides torch extensions that do not load against the installed torch (see that module)."""
