"""The trainer: packs rollout batches, computes the RL loss, steps the optimizer, publishes weights.

* :mod:`primerl.trainer.packing` - samples into segment-isolated rows (no padding waste);
* :mod:`primerl.trainer.loss` - pluggable losses and advantage estimators (light import);
* :mod:`primerl.trainer.main` - the process: ``main(cfg)``, started as ``primerl trainer``.

Importing this package imports nothing heavy; the orchestrator uses
``primerl.trainer.loss.compute_advantages`` without torch.
"""
