"""Errors a user can act on. The CLI prints them; nothing here ever becomes a traceback.

Every error carries what went wrong and, where we know it, how to fix it, in one shape: a `Problem`
(file, line, field, message, fix) for mistakes in a recipe, a message plus `fix` for everything else.
"""

from __future__ import annotations

import msgspec
from msgspec.structs import asdict


class Problem(msgspec.Struct, frozen=True):
    """One mistake in a recipe (or a --set override, or a plan file), located as precisely as we can."""

    file: str
    field: str
    message: str
    fix: str | None = None
    line: int | None = None

    def render(self) -> str:
        where = self.file + (f":{self.line}" if self.line else "")
        s = f"{where}: {self.field}: {self.message}"
        if self.fix:
            s += f"\n    fix: {self.fix}"
        return s

    def to_dict(self) -> dict:
        return asdict(self)


class FieldError(ValueError):
    """A recipe validator's error that knows its own fix (the loader shows it instead of a generic hint)."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.fix = fix


class DtlaunchError(Exception):
    """Base for every error the CLI turns into a message and a non-zero exit code."""

    exit_code = 2

    def __init__(self, message: str, fix: str | None = None):
        self.message, self.fix = message, fix
        super().__init__(self.render())

    def render(self) -> str:
        return self.message + (f"\n    fix: {self.fix}" if self.fix else "")


class RecipeError(DtlaunchError):
    """One or more problems in a recipe: each names file, line, field, what is wrong and a fix."""

    def __init__(self, problems: list[Problem], more: int = 0):
        self.problems = list(problems)
        self.more = more  # problems found but not listed (the list is capped)
        text = "\n".join(p.render() for p in self.problems)
        if more:
            text += f"\n... and {more} more problem(s) of the same kind"
        super().__init__(text)


class BackendError(DtlaunchError):
    """A target could not do what was asked (submit, status, cancel); the message says why and what to do."""

    exit_code = 3
