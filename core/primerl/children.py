"""Child processes that never outlive the process that started them.

A run starts servers and workers as child processes (the launcher's inference,
orchestrator and trainer; the vLLM backend's server). None may be left behind when its
parent exits, however it exits: :func:`own_group_and_die_with_parent`, passed as
``preexec_fn``, puts the child in its own process group (so its own children can be
signalled with it: ``os.killpg``) and asks the kernel to SIGTERM it when the parent dies
(``PR_SET_PDEATHSIG``, Linux).
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["own_group_and_die_with_parent"]

PR_SET_PDEATHSIG = 1


def own_group_and_die_with_parent() -> None:
    """Run in the child between fork and exec (``subprocess.Popen(preexec_fn=...)``)."""
    os.setsid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:  # not glibc Linux: the process group still lets the parent stop it
        pass
