"""The orchestrator: keeps rollouts flowing, scores them and ships batches to the trainer."""
