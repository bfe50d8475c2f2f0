"""Launchers: how ranks start and find each other (Slurm, Ray; torchrun and MPI need no code of ours, and
`scalerl.core.rank_env` reads all of their variables).

- `slurm`: `slurm_job_script()` (SPMD or Ray-on-Slurm sbatch scripts), `submit()`, `wait_for_job()`.
- `cli`: `add_launch_parser()` for `scalerl launch slurm|ray`.
- `ray_launcher`: `launch_ray()` runs the ranks as Ray actors (placement in `ray_placement`, the rank actors
  in `ray_ranks`).
- `emulated_cluster`: `EmulatedCluster` (network namespaces as nodes, tc-shaped links; root + iproute2)
  runs ranks as if on several nodes; `python -m scalerl.launch.emulated_cluster`. Rank processes in
  `emulated_ranks`. Not imported here, so `python -m` runs it without a double-import warning.
"""

from scalerl.launch.slurm import SlurmError, slurm_job_script, submit, wait_for_job

__all__ = ["SlurmError", "slurm_job_script", "submit", "wait_for_job"]
