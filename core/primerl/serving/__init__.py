"""What ``primerl inference`` answers, whatever the backend.

* :mod:`primerl.serving.protocol` - the serving API written down once: every endpoint's
  path, its request (pydantic) and its response (``TypedDict``), for the servers and for
  their clients (the orchestrator, the env bridges, the trainer);
* :mod:`primerl.serving.front` - the one serving front: every endpoint, the request checks,
  the guard (API key, body size, queue) and the shaping of every response, over the
  :class:`~primerl.serving.front.Generator` a backend implements.

Backends (the embedded engine's server, the vLLM backend's proxy) import these; they never
import each other. Importing this package imports nothing heavy; its modules need the
``train`` extra (fastapi, pydantic).
"""

__all__: list[str] = []  # the modules above are the API: import them
