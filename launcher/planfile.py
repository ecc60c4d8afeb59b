"""The resolved plan file that `render` writes and the job reads: the recipe plus its plan, as JSON.

Shipping the resolved plan (not the YAML) means the job trains exactly what `plan` showed, even if the
planner's defaults change between the submitting machine and the cluster. The plan is the Plan struct as msgspec
encodes and decodes it (its layout under "layout", in the Layout's own field names): what is read back is
exactly what was planned.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec

from .errors import Problem, RecipeError
from .plan import Plan
from .recipe import Recipe, parse
from .version import __version__

FORMAT = 2  # 2: the plan as the struct itself (1 was the `plan --json` report)
MAX_BYTES = 16 << 20


def build(recipe: Recipe, plan: Plan) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "dtlaunch_version": __version__,
        "recipe_hash": recipe.digest(),
        "recipe": recipe.to_dict(),
        "plan": msgspec.to_builtins(plan),
    }


def dumps(recipe: Recipe, plan: Plan) -> str:
    return json.dumps(build(recipe, plan), indent=2, sort_keys=True) + "\n"


def _fail(path: Path, message: str, field: str = "(file)") -> RecipeError:
    return RecipeError([Problem(str(path), field, message, "write it with `dtlaunch render RECIPE -o DIR`")])


def read(path: str | Path) -> tuple[Recipe, Plan, dict[str, Any]]:
    """(recipe, plan, whole document). Errors name the file and what to do."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise _fail(p, "plan file not found") from None
    except OSError as e:
        raise _fail(p, f"cannot read the plan file: {e.strerror}") from None
    if len(raw) > MAX_BYTES:
        raise _fail(p, f"over {MAX_BYTES:,} bytes: not a plan file")
    try:
        doc = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _fail(p, f"not a plan file: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise RecipeError(
            [
                Problem(
                    str(p),
                    "format",
                    f"unsupported plan file format {found!r}",
                    f"re-render it with this dtlaunch ({__version__})",
                )
            ]
        )
    try:
        recipe = parse(doc["recipe"])
        plan = msgspec.convert(doc["plan"], Plan)
    except (msgspec.ValidationError, KeyError, TypeError, ValueError) as e:
        raise _fail(p, f"the plan file is damaged or from another dtlaunch version: {str(e).splitlines()[0]}") from None
    return recipe, plan, doc
