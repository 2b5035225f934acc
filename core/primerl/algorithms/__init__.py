"""The RL maths, together: what turns rewards into advantages and samples into a loss.

* :mod:`primerl.algorithms.shaping` - an episode's reward before the estimator sees it
  (DAPO's overlong punishment);
* :mod:`primerl.algorithms.advantages` - advantage estimators (``orchestrator.advantage``):
  groups of rewards in, one advantage per reward out; the orchestrator runs them;
* :mod:`primerl.algorithms.losses` - RL losses (``trainer.loss``) over one forward's
  :class:`LossInputs`; the trainer runs them;
* :mod:`primerl.algorithms.corrections` - off-policy corrections of the engine/trainer
  mismatch (``trainer.correction``), a weight per loss token every loss multiplies by;
* :mod:`primerl.algorithms.options` - the validators their options are checked with.

Each kind is a ``typing.Protocol`` (:class:`Loss`, :class:`Correction`, :class:`Advantage`)
built from a registered name or a ``"module:attr"`` factory with its options
(:func:`build_loss`, :func:`build_correction`, :func:`build_advantage`). A plugin that adds
one imports what it needs from here (``docs/plugins.md``). Importing this package imports no
torch: the orchestrator and the config check use it.
"""

from primerl.algorithms.advantages import Advantage, build_advantage, compute_advantages
from primerl.algorithms.corrections import Correction, build_correction, mismatch_log_ratio
from primerl.algorithms.losses import MAX_LOG_RATIO, Loss, LossInputs, Normalize, build_loss, reduce
from primerl.algorithms.shaping import OverlongShaping

__all__ = [
    "MAX_LOG_RATIO", "Advantage", "Correction", "Loss", "LossInputs", "Normalize", "OverlongShaping", "build_advantage",
    "build_correction", "build_loss", "compute_advantages", "mismatch_log_ratio", "reduce",
]
