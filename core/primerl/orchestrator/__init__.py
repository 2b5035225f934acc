"""The orchestrator: keeps rollouts flowing, scores them and ships batches to the trainer.

The process (:mod:`.main`) runs the loops; each stage a finished group passes through on
its way into a batch file is a module of its own:

* :mod:`.groups` - :class:`~.groups.Group`, one task's samples as its rollout kind fills them;
* :mod:`.sources` - the environments the run trains on, their task draws and their share of
  every batch;
* :mod:`.filters` - which finished groups train: too stale ones are dropped, uniform ones
  skipped (DAPO's dynamic sampling), hopeless in-flight ones cancelled;
* :mod:`.advantages` - each source's groups through its estimator, rewards shaped first;
* :mod:`.metrics` - the batch's figures for ``metrics.jsonl``;
* :mod:`.batching` - filling a batch source by source and writing it with its data position;
* :mod:`.positions` - the data position (how far each source's draws went), for resuming;
* :mod:`.failures` - failed groups counted, and the verdict that an env cannot run its tasks;
* :mod:`.client` - the inference servers behind the router plugin.
"""

import time


def log(msg: str) -> None:
    """The orchestrator's log line (its stdout goes to ``logs/orchestrator.log``)."""
    print(f"[orchestrator {time.strftime('%H:%M:%S')}] {msg}", flush=True)
