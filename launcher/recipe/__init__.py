"""The recipe: one YAML file describing model, parallelism, resources, training, checkpoints, targets.

`schema` holds the msgspec structs (so `dtlaunch schema` can emit JSON Schema for editors); `loading` reads
a file within fixed bounds and turns every mistake into a located Problem (file, line, field, fix).
"""

from __future__ import annotations

from ..targets.local.spec import LocalTarget
from ..targets.sky.spec import SkyStorage, SkyTarget
from ..targets.slurm.spec import SlurmTarget, SshSpec
from .loading import json_schema, load, load_text, parse_override
from .model_spec import ModelSpec
from .schema import (
    CheckpointSpec,
    DataSpec,
    ParallelismSpec,
    Recipe,
    ResourcesSpec,
    TargetsSpec,
    TrainingSpec,
    parse,
)

__all__ = [
    "Recipe",
    "ModelSpec",
    "ParallelismSpec",
    "ResourcesSpec",
    "DataSpec",
    "TrainingSpec",
    "CheckpointSpec",
    "LocalTarget",
    "SshSpec",
    "SlurmTarget",
    "SkyStorage",
    "SkyTarget",
    "TargetsSpec",
    "load",
    "load_text",
    "parse",
    "parse_override",
    "json_schema",
]
