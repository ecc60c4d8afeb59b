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


def _load(recipe: Recipe | str | os.PathLike, overrides: Sequence[str]) -> Recipe:
    """A recipe file, or a loaded Recipe (re-validated with the overrides applied)."""
    from .recipe import Recipe, load, load_text

    forced = [*overrides, SUBMITIT]  # this API returns a submitit Job, whatever the recipe's default
    if isinstance(recipe, Recipe):
        import yaml

        return load_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False), f"<recipe {recipe.name}>", forced)
    return load(recipe, forced)


def _findings(recipe: Recipe, plan, source: str) -> None:
    """Print every finding for the SLURM target; refuse on errors, as `up` does (a job must be runnable)."""
    from .validate import has_errors, validate

    findings = validate(recipe, plan, "slurm")
    lines = []
    for f in findings:
        where = (f.file or source) + (f":{f.line}" if f.line else "")
        lines.append(f"{where}: {f.severity} [{f.rule}] {f.field}: {f.message}" + (f"\n    fix: {f.fix}" if f.fix else ""))
    if has_errors(findings):
        raise DtlaunchError(f"{source}: validation found errors for the slurm target; nothing was submitted:\n"
                            + "\n".join(lines), fix="fix the errors above")
    for line in lines:
        print(line, file=sys.stderr)


def submit(recipe: Recipe | str | os.PathLike, *, target_dir: str | os.PathLike | None = None,
           overrides: Sequence[str] = ()) -> submitit.Job:
    """Validate, render into `target_dir` (default: <targets.local.run_dir>/<job name>-slurm, as `up`),
    submit with submitit to SLURM, record the job; return submitit's Job.

    recipe: a recipe file or a loaded `launcher.recipe.Recipe`; overrides: "KEY=VALUE" items, as `--set`.
    """
    from .plan import make_plan
    from .render import render
    from .targets.registry import Registry
    from .targets.submitit_job import record
    from .targets.submitit_job import submit as submit_request

    r = _load(recipe, overrides)
    plan = make_plan(r)
    art = render(r, plan, "slurm")
    _findings(r, plan, str(recipe) if not hasattr(recipe, "to_dict") else f"<recipe {r.name}>")
    out = Path(target_dir) if target_dir is not None else Path(r.targets.local.run_dir) / f"{art.job_name}-slurm"
    registry = Registry()
    registry.check_writable()  # before submitting: a job nobody can follow is worse than no job
    art.write(out, origin="up")
    job = submit_request(art.request, out)
    try:
        registry.add(record(job, art.job_name, out))
    except DtlaunchError as e:
        print(f"warning: the job is running but could not be recorded ({e}); its submitit folder: {job.paths.folder}",
              file=sys.stderr)
    return job
