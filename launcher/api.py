"""The Python API, for notebooks: `launcher.submit(recipe) -> submitit.Job`.

The same steps as `dtlaunch up -t slurm` with `targets.slurm.submit: submitit` (validate and refuse on
errors, render into a directory, submit exactly what was rendered, record the job so `dtlaunch
status/logs/down` see it), ending in submitit's own Job: poll it (`job.state`, `job.done()`), read its
result (`job.result()`: the run's summary, or the failure with its exit code), cancel it (`job.cancel()`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import DtlaunchError

if TYPE_CHECKING:
    import submitit

    from .recipe import Recipe

SUBMITIT = "targets.slurm.submit=submitit"


def submit(
    recipe: Recipe | str | os.PathLike, *, target_dir: str | os.PathLike | None = None, overrides: Sequence[str] = ()
) -> submitit.Job:
    """Validate, render into `target_dir` (default: <targets.local.run_dir>/<job name>-slurm, as `up`),
    submit with submitit to SLURM, record the job; return submitit's Job.

    recipe: a recipe file or a loaded `launcher.recipe.Recipe`; overrides: "KEY=VALUE" items, as `--set`.
    """
    from .prepare import check, prepare
    from .targets.registry import Registry
    from .targets.slurm.submitit_job import record
    from .targets.slurm.submitit_job import submit as submit_request

    # what `dtlaunch up -t slurm` does, with submitit forced: this API returns a submitit Job
    prep = prepare(recipe, [*overrides, SUBMITIT], "slurm")
    check(prep, False, "submitted")
    r, art = prep.recipe, prep.artifacts
    out = Path(target_dir) if target_dir is not None else Path(r.targets.local.run_dir) / f"{art.job_name}-slurm"
    registry = Registry()
    registry.check_writable()  # before submitting: a job nobody can follow is worse than no job
    art.write(out, origin="up")
    job = submit_request(art.request, out)
    try:
        registry.add(record(job, art.job_name, out))
    except DtlaunchError as e:
        print(
            f"warning: the job is running but could not be recorded ({e}); its submitit folder: {job.paths.folder}",
            file=sys.stderr,
        )
    return job
