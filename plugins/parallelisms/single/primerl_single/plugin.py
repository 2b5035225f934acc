"""Entry point module: registers the single-process strategy lazily."""

from primerl import hookimpl
from primerl.parallel import ParallelismCapabilities


@hookimpl
def register_parallelisms(register):
    register("single", "primerl_single.strategy:Single",
             description="One trainer process: the whole model on one device, nothing sharded",
             capabilities=ParallelismCapabilities(max_ranks=1))
