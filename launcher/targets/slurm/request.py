"""What a SLURM submission passes on: the request render hands the backend (sbatch's or submitit's), and the
handle the registry keeps."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import msgspec

if TYPE_CHECKING:
    from .spec import SlurmTarget

# How a SLURM job gets its secrets' values, whichever way it is submitted (sbatch, or submitit's sbatch).
SLURM_SECRETS = "sbatch passes the submitting shell's environment to the job (--export=ALL)"


class SubmititSpec(msgspec.Struct, frozen=True):
    """Everything `targets.slurm.submit: submitit` hands to submitit, decided at render time (plain data, so
    rendering never imports submitit, and `up` submits exactly what `render` wrote to submitit.json).

    Paths are relative to the rendered directory; the submitting side makes them absolute, because submitit
    runs sbatch from the caller's working directory, not from the rendered one.
    """

    folder: str  # submitit's own directory: pickles, the generated batch script, the job's log
    setup_script: str  # the batch preamble; submitit's `setup` sources it before `exec python`
    python: str  # the batch script's command for submitit's interpreter (a shell word list, not a path)
    max_num_timeout: int  # submitit's cap on requeues after a signal it counts as a time-out
    parameters: Mapping[str, Any]  # SlurmExecutor.update_parameters(**parameters), besides `setup`
    step: Mapping[str, Any]  # the job-side callable's settings (launcher.targets.slurm.submitit_job.StepJob)

    def to_json(self) -> str:
        return (
            json.dumps(
                {
                    "folder": self.folder,
                    "setup_script": self.setup_script,
                    "python": self.python,
                    "max_num_timeout": self.max_num_timeout,
                    "parameters": dict(self.parameters),
                    "step": dict(self.step),
                },
                indent=2,
            )
            + "\n"
        )

    @classmethod
    def from_json(cls, text: str) -> SubmititSpec:
        d = json.loads(text)
        return cls(d["folder"], d["setup_script"], d["python"], int(d["max_num_timeout"]), d["parameters"], d["step"])


class SlurmRequest(msgspec.Struct, frozen=True):
    job_script: str  # sbatch: the job script; submitit: its request file (submitit.json)
    settings: SlurmTarget  # how to reach the cluster (ssh), how to submit (sbatch or submitit)
    array: bool = False
    secrets: tuple[str, ...] = ()
    submit: Literal["sbatch", "submitit"] = "sbatch"
    submitit: SubmititSpec | None = None  # set iff submit == "submitit"

    @property
    def entrypoint(self) -> str:
        return self.job_script

    @property
    def argv(self) -> tuple[str, ...]:
        if self.submit == "submitit":  # the same submission `up` makes, from the rendered directory
            return ("python3", "-m", "launcher.targets.slurm.submitit_job", ".")
        return ("sbatch", "--parsable", self.job_script)


@dataclass(frozen=True)
class SlurmHandle:
    submit_dir: str
    job_name: str
    array: bool = False
    ssh: dict | None = None
    submit: str = "sbatch"  # or "submitit": the job's log is then in submitit's folder
    submitit_folder: str | None = None
    dependency: str | None = None  # --dependency it was submitted with (`up --after`): status says what it waits for
