"""Entry point module: registers the FSDP2 strategy lazily (listing plugins imports no torch)."""

from primerl import hookimpl
from primerl.parallel import ParallelismCapabilities


@hookimpl
def register_parallelisms(register):
    register("fsdp", "primerl_fsdp.strategy:FSDP",
             description="FSDP2 over dp_shard, expert parallel over ep, context parallel over cp ([trainer.parallel])",
             capabilities=ParallelismCapabilities(float32_on_cuda=False))
