"""Launchers: how ranks start and find each other (torchrun, Slurm, MPI, Ray).

- `env`: `detect_rank_env()` reads RANK / WORLD_SIZE / ... from torchrun, Slurm `srun`, OpenMPI or
  MPICH / Intel MPI variables; `apply_rank_env()` exports them for `init_process_group("env://")`.
- `slurm`: `slurm_job_script()` (SPMD or Ray-on-Slurm sbatch scripts), `submit()`, `wait_for_job()`.
- `cli`: `add_launch_parser()` for `scalerl launch slurm|ray`.
- `ray_launcher`: `launch_ray()` runs the ranks as Ray actors.
- `emulated_cluster`: `EmulatedCluster` (network namespaces as nodes, tc-shaped links; root + iproute2)
  runs ranks as if on several nodes; `python -m scalerl.launch.emulated_cluster`. Rank processes in
  `emulated_ranks`. Not imported here, so `python -m` runs it without a double-import warning.
"""

from scalerl.launch.env import RankEnv, RankEnvError, apply_rank_env, detect_rank_env, expand_hostlist
from scalerl.launch.slurm import SlurmError, slurm_job_script, submit, wait_for_job

__all__ = ["RankEnv", "RankEnvError", "SlurmError", "apply_rank_env", "detect_rank_env", "expand_hostlist",
           "slurm_job_script", "submit", "wait_for_job"]
