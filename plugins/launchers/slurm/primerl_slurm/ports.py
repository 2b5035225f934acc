"""Free TCP ports on the node a job runs on: ``python -m primerl_slurm.ports HOST FIRST N``.

The batch script of a one-node job runs this on its node before starting the inference
servers: the node may be shared (an ``OverSubscribe`` partition), so a fixed port can be
taken. Prints N distinct ports, one a line: ``FIRST + i`` where free (FIRST 0: any), else a
free one, as the local launcher picks them.
"""

from __future__ import annotations

import socket
import sys


def _free(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except (OSError, OverflowError):
            return False


def _any(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def pick(host: str, first: int, n: int) -> list[int]:
    ports: list[int] = []
    for i in range(n):
        port = first + i if first else 0
        while port == 0 or port in ports or not _free(host, port):
            port = _any(host)
        ports.append(port)
    return ports


if __name__ == "__main__":
    host, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print("\n".join(str(p) for p in pick(host, first, n)))
