"""The Slurm launcher for primerl: a run as one Slurm job (docs/slurm.md)."""
