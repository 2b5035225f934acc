"""Finding Mooncake: its Python store module and its ``mooncake_master`` binary, with an
error that names the fix when either is missing.

The ``mooncake-transfer-engine-non-cuda`` wheel (the plain ``mooncake-transfer-engine`` is
the CUDA build) ships both. They link a few system libraries the wheel does not bundle;
``libibverbs.so.1`` is the one a plain Debian/Ubuntu image lacks, needed even for TCP.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
from pathlib import Path

from primerl.errors import PrimerlError

PIP_FIX = "pip install mooncake-transfer-engine-non-cuda"
# shared libraries Mooncake links but does not bundle -> the Debian/Ubuntu package with it
SYSTEM_PACKAGES = {"libibverbs.so.1": "libibverbs1", "libnuma.so.1": "libnuma1", "libcurl.so.4": "libcurl4"}


class MooncakeUnavailable(PrimerlError):
    """Mooncake cannot be used here (not installed, a system library missing, no master)."""


def missing_library_fix(message: str) -> str | None:
    """The install command for the shared library a loader error names, if it names one."""
    m = re.search(r"(lib[\w.+-]+\.so[\w.]*): cannot open shared object file", message)
    if m is None:
        return None
    lib = m.group(1)
    return f"apt-get install {SYSTEM_PACKAGES.get(lib, lib.split('.so')[0])}  (Mooncake needs {lib})"


def import_store():
    """``mooncake.store.MooncakeDistributedStore``, or MooncakeUnavailable naming the fix."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # Mooncake logs every connection at INFO
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        fix = missing_library_fix(str(exc))
        if fix is not None:
            raise MooncakeUnavailable(f"Mooncake cannot load: {fix}") from None
        raise MooncakeUnavailable(f"Mooncake is not installed ({exc}): {PIP_FIX}") from None
    return MooncakeDistributedStore


def master_binary() -> str:
    """Path of ``mooncake_master``: the one in the installed wheel, else one on PATH."""
    spec = importlib.util.find_spec("mooncake")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        candidate = Path(base) / "mooncake_master"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    found = shutil.which("mooncake_master")
    if found is None:
        raise MooncakeUnavailable(f"mooncake_master not found (neither in the mooncake package nor on PATH): {PIP_FIX}")
    return found
