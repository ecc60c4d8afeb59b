"""The SLURM target: a job script submitted with sbatch (sbatch.py), or the same job through submitit
(submitit.py, submitit_job.py); render.py picks one. common.py holds what both submissions share."""

# The recipe schema imports this package's section (spec.py): importing the schema first keeps that order
# whichever module of the package is imported first (spec.py itself imports from launcher.recipe).
from ... import recipe as _recipe  # noqa: F401
