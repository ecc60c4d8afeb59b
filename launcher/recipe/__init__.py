"""The recipe: one YAML file describing model, parallelism, resources, training, checkpoints, targets.

`schema` holds the pydantic models (so `dtlaunch schema` can emit JSON Schema for editors); `loading` reads
a file within fixed bounds and turns every mistake into a located Problem (file, line, field, fix).
"""
from __future__ import annotations

import os

# pydantic looks up third-party plugins (the `pydantic` entry-point group) when it builds the first validator,
# which reads the metadata of every installed distribution: 15-20 ms of `dtlaunch plan` in an environment that
# also holds torch and DeepSpeed. No plugin has anything to observe in the recipe's own validation, so the
# lookup is switched off while the schema's classes are built, and the variable restored, so that the user's
# own models, and every process dtlaunch starts, see their plugins as before.
_plugins_env = os.environ.get("PYDANTIC_DISABLE_PLUGINS")
os.environ["PYDANTIC_DISABLE_PLUGINS"] = "__all__"
try:
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
    )
    from .target_specs import LocalTarget, SkyStorage, SkyTarget, SlurmTarget, SshSpec
finally:
    if _plugins_env is None:
        del os.environ["PYDANTIC_DISABLE_PLUGINS"]
    else:
        os.environ["PYDANTIC_DISABLE_PLUGINS"] = _plugins_env

__all__ = ["Recipe", "ModelSpec", "ParallelismSpec", "ResourcesSpec", "DataSpec", "TrainingSpec", "CheckpointSpec",
           "LocalTarget", "SshSpec", "SlurmTarget", "SkyStorage", "SkyTarget", "TargetsSpec", "load", "load_text", "parse_override",
           "json_schema"]
