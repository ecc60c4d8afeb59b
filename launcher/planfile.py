"""The resolved plan file that `render` writes and the job reads: the recipe plus its plan, as JSON.

Shipping the resolved plan (not the YAML) means the job trains exactly what `plan` showed, even if the
planner's defaults change between the submitting machine and the cluster.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import __version__
from .errors import RecipeError
from .recipe import Recipe

FORMAT = 1


def build(recipe: Recipe, plan_dict: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "dtlaunch_version": __version__,
        "recipe_hash": recipe.digest(),
        "recipe": recipe.to_dict(),
        "plan": plan_dict,
    }


def dumps(recipe: Recipe, plan_dict: dict[str, Any]) -> str:
    return json.dumps(build(recipe, plan_dict), indent=2, sort_keys=True) + "\n"


def read(path: str | Path) -> tuple[Recipe, dict[str, Any], dict[str, Any]]:
    """(recipe, plan dict, whole document). Errors name the file and what to do."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except FileNotFoundError:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)", "message": "plan file not found",
                            "fix": "write it with `dtlaunch render RECIPE -o DIR`"}]) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)", "message": f"not a plan file: {e}",
                            "fix": "write it with `dtlaunch render RECIPE -o DIR`"}]) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise RecipeError([{"file": str(p), "line": None, "field": "format",
                            "message": f"unsupported plan file format {doc.get('format') if isinstance(doc, dict) else None!r}",
                            "fix": f"re-render it with this dtlaunch ({__version__})"}])
    recipe = Recipe.model_validate(doc["recipe"])
    return recipe, doc["plan"], doc
