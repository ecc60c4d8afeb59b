"""The recipe: one YAML file describing model, parallelism, resources, training, checkpoints, targets.

`schema` holds the msgspec structs (so `dtlaunch schema` can emit JSON Schema for editors); `loading` reads
a file within fixed bounds and turns every mistake into a located Problem (file, line, field, fix).
"""

from __future__ import annotations

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
from .target_specs import LocalTarget, SkyStorage, SkyTarget, SlurmTarget, SshSpec

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
