"""Free TCP ports on the node a job runs on: ``python -m primerl_slurm.ports HOST FIRST N``.

The batch script of a one-node job runs this on its node before starting the inference
servers: the node may be shared (an ``OverSubscribe`` partition), so a fixed port can be
taken. Prints N distinct ports, one a line: ``FIRST + i`` where free (FIRST 0: any), else a
free one, as the local launcher picks them.
"""

from __future__ import annotations

import sys

from primerl.launchers import pick_ports

if __name__ == "__main__":
    host, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print("\n".join(str(p) for p in pick_ports(host, first, n)))
