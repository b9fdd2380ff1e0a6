from slurm_cluster import local_slurm  # noqa: F401  (session fixture: the local Slurm)
