"""Run a function on N local ranks of a fresh torch.distributed group: for tests and
benchmarks that compare a sharded computation with one process.

Why not torchrun: a test wants the ranks' return values back in the calling process.
Each rank is a spawned process (``torch.multiprocessing``) joined by a ``FileStore`` in a
temporary directory (no ports to collide), with gloo on CPU. ``fn`` must be importable
(a module-level function) and its arguments and result picklable.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(rank: int, world: int, store_path: str, fn: Callable[..., Any], args: tuple,
               results: Any, threads: int) -> None:
    torch.set_num_threads(threads)
    store = dist.FileStore(store_path, world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        results[rank] = ("ok", fn(*args))
    except BaseException:  # carried back to the caller with its traceback
        results[rank] = ("error", traceback.format_exc())
        raise
    finally:
        dist.destroy_process_group()


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any, threads: int = 1) -> list[Any]:
    """``[fn(*args) on rank 0, ..., on rank world_size - 1]``, each rank in its own process
    inside an initialized gloo group. A rank that raises fails the call with its traceback."""
    with tempfile.TemporaryDirectory(prefix="primerl-ranks-") as tmp, mp.Manager() as manager:
        results = manager.dict()
        store_path = os.path.join(tmp, "store")
        try:
            mp.spawn(_rank_main, args=(world_size, store_path, fn, args, results, threads), nprocs=world_size,
                     join=True)
        except mp.ProcessRaisedException as exc:
            errors = [r[1] for r in results.values() if r[0] == "error"]
            raise RuntimeError("a rank failed:\n" + (errors[0] if errors else str(exc))) from None
        return [results[r][1] for r in range(world_size)]
