"""The recipe schema's building blocks: bounded numbers, one-line strings, names and the strict base model.

A hostile or mistyped value must fail here, not as an overflow in the planner or a loop that runs for hours.
"""
from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
)

from ..strategies import STRATEGY_NAMES, TARGET_NAMES

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$", re.ASCII)
MAX_ENV_VALUE = 64 * 1024
BUCKET = re.compile(r"^(s3|gs|r2|cos|oci|nebius|https)://[^\s]+$", re.ASCII)


def suggest(word: str, choices) -> str:
    import difflib

    m = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _whole(v: Any) -> Any:
    """Refuse booleans where a number is expected (pydantic would read `true` as 1)."""
    if isinstance(v, bool):
        raise ValueError("expected a whole number, not true/false")
    return v


def _number(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError("expected a number, not true/false")
    return v


def Int(ge: int = 0, le: int = 10**12, description: str | None = None):  # noqa: N802 - reads like a type
    return Annotated[int, BeforeValidator(_whole), Field(ge=ge, le=le, description=description)]


def Float(gt: float | None = None, ge: float | None = None, le: float | None = None,
          lt: float | None = None):  # noqa: N802
    return Annotated[float, BeforeValidator(_number), Field(gt=gt, ge=ge, le=le, lt=lt, allow_inf_nan=False)]


def _auto_or_positive(limit: int):
    def check(v: Any) -> Any:
        if v == "auto":
            return v
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"expected a whole number >= 1 or 'auto', got {v!r}")
        if not 1 <= v <= limit:
            raise ValueError(f"must be between 1 and {limit:,} (or 'auto'), got {v:,}")
        return v

    return check


def AutoInt(limit: int = 10**9):  # noqa: N802
    """A positive whole number, or "auto" (the planner decides): one type, one message."""
    return Annotated[int | str, BeforeValidator(_auto_or_positive(limit)),
                     WithJsonSchema({"anyOf": [{"type": "integer", "minimum": 1, "maximum": limit},
                                               {"const": "auto"}]})]


def _one_line(v: str) -> str:
    """A value that goes into an #SBATCH line: a line break would start a new line of the script."""
    if any(ch in v for ch in "\n\r\x00"):
        raise ValueError("must be a single line (no line break or NUL): it goes into an #SBATCH line of the job script")
    return v


def Line(max_length: int = 1024, description: str | None = None):  # noqa: N802
    return Annotated[str, AfterValidator(_one_line), Field(max_length=max_length, description=description)]


Strategy = Literal.__getitem__(("auto", *STRATEGY_NAMES))
Target = Literal.__getitem__(TARGET_NAMES)
Str = Annotated[str, Field(max_length=4096)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True, allow_inf_nan=False)
