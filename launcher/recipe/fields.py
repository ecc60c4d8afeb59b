"""The recipe schema's building blocks: bounded numbers, one-line strings, names and the strict base struct.

A hostile or mistyped value must fail here, not as an overflow in the planner or a loop that runs for hours.

The schema is built on msgspec: its classes are made in C, so the schema adds little to `dtlaunch plan`'s
start-up, and msgspec converts strictly (a boolean is not a number, text is not a number, an unknown key
is an error) with no per-field code of ours. Checks that a type cannot say (a known accelerator, a SLURM time)
run in each section's `__post_init__`, which msgspec calls while it converts and locates at the section; a
check that raises `Invalid` also names its field.
"""

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from ..strategies import STRATEGY_NAMES
from ..targets.table import TARGET_NAMES

ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}\Z", re.ASCII)
MAX_ENV_VALUE = 64 * 1024
BUCKET = re.compile(r"^(s3|gs|r2|cos|oci|nebius|https)://[^\s]+\Z", re.ASCII)
ONE_LINE = r"^[^\n\r\x00]*\Z"


class Invalid(ValueError):
    """A section's check failed on one of its fields: the loader reports it at SECTION.FIELD, with `fix`. `field`
    may be a path inside the section, e.g. ("env", "X") or ("extra_sbatch", 2), to point at one entry."""

    def __init__(self, field: str | tuple, message: str, fix: str | None = None):
        super().__init__(message)
        self.field, self.fix = field, fix


def checked(field: str | tuple, parse, value):
    """parse(value), its ValueError reported at this field."""
    try:
        return parse(value)
    except ValueError as e:
        raise Invalid(field, str(e), getattr(e, "fix", None)) from None


def suggest(word: str, choices) -> str:
    import difflib

    m = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {m[0]!r}?)" if m else ""


def Int(ge: int = 0, le: int = 10**12, description: str | None = None):  # noqa: N802 - reads like a type
    """A whole number within bounds; msgspec refuses true/false (YAML's booleans) where a number is expected."""
    return Annotated[int, Meta(ge=ge, le=le, description=description)]


def Float(
    gt: float | None = None,
    ge: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    description: str | None = None,
):  # noqa: N802
    """A number within bounds. Every Float has an upper bound, so .inf fails it, and .nan fails every bound."""
    assert le is not None or lt is not None, "an unbounded float would accept .inf"
    # msgspec's stubs take either gt or ge (and either le or lt), not both; at run time None is "unset".
    bounds: dict[str, Any] = {"gt": gt, "ge": ge, "le": le, "lt": lt}
    return Annotated[float, Meta(**bounds, description=description)]


def AutoInt(limit: int = 10**9, description: str | None = None):  # noqa: N802
    """A positive whole number, or "auto" (the planner decides)."""
    return Annotated[Annotated[int, Meta(ge=1, le=limit)] | Literal["auto"], Meta(description=description)]


def Line(max_length: int = 1024, description: str | None = None):  # noqa: N802
    """A value that goes into an #SBATCH line: a line break would start a new line of the script."""
    return Annotated[str, Meta(max_length=max_length, pattern=ONE_LINE, description=description)]


def Text(max_length: int, description: str | None = None, pattern: str | None = None):  # noqa: N802
    return Annotated[str, Meta(max_length=max_length, description=description, pattern=pattern)]


def Doc(description: str, tp: Any) -> Any:  # noqa: N802
    """A type with the description `dtlaunch schema` shows for it."""
    return Annotated[tp, Meta(description=description)]


Strategy = Literal.__getitem__(("auto", *STRATEGY_NAMES))
Target = Literal.__getitem__(TARGET_NAMES)
Str = Annotated[str, Meta(max_length=4096)]


class Spec(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """A recipe section: unknown keys are errors (a typo must not be silently ignored)."""

    def replace(self, **changes: Any):
        """A copy with some fields changed (not validated again: the caller gives valid values), keeping what
        the section remembers besides its fields (where it was loaded from)."""
        out = msgspec.structs.replace(self, **changes)
        if hasattr(self, "__dict__"):
            out.__dict__.update(self.__dict__)
        return out
