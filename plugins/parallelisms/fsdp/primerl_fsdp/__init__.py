"""The ``fsdp`` parallelism strategy: FSDP2 over ``dp_shard``, expert parallel over ``ep``,
context parallel over ``cp``, on torch.distributed ranks (gloo on CPU, NCCL on GPUs)."""
