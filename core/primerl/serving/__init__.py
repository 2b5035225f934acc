"""The serving front every inference backend shares: what ``primerl inference`` answers.

* :mod:`primerl.serving.protocol` - the request bodies of the OpenAI-compatible API and
  vLLM's extensions, validated with pydantic;
* :mod:`primerl.serving.frontend` - what a server does with its tokenizer before an engine
  runs (prompts to token ids, chat templates, OpenAI-shaped errors) and the guard in front
  of every endpoint (API key, body size).

Backends (the embedded engine's server, the vLLM backend's proxy) import these; they never
import each other. Importing this package imports nothing heavy; its modules need the
``train`` extra (fastapi, pydantic).
"""
