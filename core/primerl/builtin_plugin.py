"""The core distribution's own plugin: the built-in losses, off-policy corrections and
advantage estimators (each one's formula, options and reference: docs/algorithms.md), and
the always-on ``file`` monitor (metrics.jsonl; docs/monitors.md).

Registered through the ``primerl`` entry point of the core's pyproject, so discovery
finds them exactly as it finds a third party's (the core imports no plugin by name) and
``primerl plugins list`` shows them next to everything else. Targets are lazy strings:
listing plugins imports nothing of the trainer.
"""

from primerl import hookimpl

LOSSES = {
    "default": ("DefaultLoss", "DPPO masking on the probability change + log-ratio KL (prime-rl's default)"),
    "grpo_clip": ("GRPOClipLoss", "PPO's clipped surrogate, per-sequence mean (GRPO)"),
    "dapo": ("DAPOLoss", "Clip-higher surrogate, token-level normalisation (DAPO)"),
    "dr_grpo": ("DrGRPOLoss", "Clipped surrogate over a constant normaliser (Dr. GRPO)"),
    "gspo": ("GSPOLoss", "Sequence-level ratio, clipped (GSPO)"),
    "cispo": ("CISPOLoss", "REINFORCE weighted by the clipped, detached ratio (CISPO, MiniMax-M1)"),
    "sapo": ("SAPOLoss", "Soft sigmoid gate in place of the clip (SAPO)"),
    "ipo": ("IPOLoss", "Symmetric probability trust region + log-ratio KL (prime-rl's IPO)"),
}
CORRECTIONS = {
    "tis": ("TIS", "Truncated importance sampling, token or sequence level"),
    "mis": ("MIS", "Masked importance sampling: token, sequence or geometric-mean rejection"),
    "icepop": ("IcePop", "Double-sided masking of the mismatch ratio (IcePop, Ring-1T)"),
}
ADVANTAGES = {
    "grpo": ("GRPO", "Reward minus the group mean (Dr. GRPO)"),
    "grpo_std": ("GRPOStd", "Reward minus the group mean, over the group std (GRPO)"),
    "rloo": ("RLOO", "Reward minus the mean of the group's other rewards (RLOO)"),
    "reinforce_pp": ("ReinforcePP", "Group baseline, normalised over the batch (REINFORCE++)"),
}


@hookimpl
def register_losses(register):
    for name, (cls, what) in LOSSES.items():
        register(name, f"primerl.algorithms.losses:{cls}", description=what)


@hookimpl
def register_corrections(register):
    for name, (cls, what) in CORRECTIONS.items():
        register(name, f"primerl.algorithms.corrections:{cls}", description=what)


@hookimpl
def register_advantages(register):
    for name, (cls, what) in ADVANTAGES.items():
        register(name, f"primerl.algorithms.advantages:{cls}", description=what)


@hookimpl
def register_monitors(register):
    from primerl.monitors import MonitorCapabilities

    always_on = MonitorCapabilities(always_on=True, why="the live view, the reward plot and resume read its metrics.jsonl")
    register("file", "primerl.trainer.metrics:FileMonitor", capabilities=always_on,
             description="metrics.jsonl, one line per step, and reward.png at the end (always on)")
