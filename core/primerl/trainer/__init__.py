"""The trainer: packs rollout batches, computes the RL loss, steps the optimizer, publishes weights.

* :mod:`primerl.trainer.packing` - samples into segment-isolated rows (no padding waste);
* :mod:`primerl.trainer.optim` - AdamW and the learning-rate schedule;
* :mod:`primerl.trainer.step` - one RL optimizer step over packed rows: the loss and the
  off-policy correction (:mod:`primerl.algorithms`) per forward, routing metrics, MoE router
  balancing;
* :mod:`primerl.trainer.sft` - the optional supervised warm-up before RL;
* :mod:`primerl.trainer.publish` - weights for inference, checkpoints, resuming;
* :mod:`primerl.trainer.metrics` - ``metrics.jsonl``;
* :mod:`primerl.trainer.main` - the process: ``main(cfg)``, started as ``primerl trainer``.

Importing this package imports nothing heavy.
"""


def log(msg: str) -> None:
    """The trainer's log line (its stdout goes to ``logs/trainer.log``); with several ranks
    only global rank 0 logs (the others would repeat it)."""
    from primerl.parallel import is_publisher

    if is_publisher():
        print(f"[trainer] {msg}", flush=True)
