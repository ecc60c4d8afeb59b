"""Quoting for generated shell: every value from a recipe goes through here.

A `ShellExpr` marks a fragment that must be expanded by the shell at run time (e.g. "$SLURM_NNODES"); it
is emitted inside double quotes so it expands to one word. Everything else is a literal and goes through
shlex.quote, so `name: "x; touch /tmp/pwned"` stays a harmless string.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from ..errors import DtlaunchError


class ShellExpr(str):
    """A run-time shell expression, e.g. ShellExpr('$MASTER_ADDR:$PORT'). Must not contain quotes or backticks,
    since it is emitted inside double quotes."""

    def __new__(cls, value: str):
        if '"' in value or "`" in value:
            raise ValueError(f"shell expression must not contain quotes or backticks: {value!r}")
        return super().__new__(cls, value)


Word = str | ShellExpr | int


def quote(word: Word) -> str:
    if isinstance(word, ShellExpr):
        return f'"{word}"'
    if isinstance(word, bool):
        raise TypeError("a shell word cannot be a bool; render it as text")
    return shlex.quote(str(word))


def join(words: Iterable[Word]) -> str:
    return " ".join(quote(w) for w in words)


def exported_or(name: str, default: str) -> ShellExpr:
    """`${name:-default}`: the value of `name` exported to the script, else `default` (itself expanded)."""
    return ShellExpr(f"${{{name}:-{default}}}")


def flag(name: str, value: Word) -> Word:
    """`--name=value`, keeping a run-time expression expandable."""
    if isinstance(value, ShellExpr):
        return ShellExpr(f"{name}={value}")
    return f"{name}={value}"


_SAFE_SBATCH = re.compile(r"^[A-Za-z0-9_.,:=@%/+\-\[\]]+$")


def sbatch_value(value: object, field: str = "a SLURM option") -> str:
    """Quote a value for an `#SBATCH` line.

    sbatch parses these lines itself (not the shell): it understands double quotes and backslash,
    not single quotes, and treats an unescaped `#` as a comment. A newline would start a new line of
    the script, so it is refused outright.
    """
    s = str(value)
    if "\n" in s or "\r" in s or "\x00" in s:
        raise DtlaunchError(
            f"{field}: the value {s[:80]!r} contains a newline or NUL; it cannot go into an #SBATCH line",
            fix=f"remove the line break from {field}",
        )
    if _SAFE_SBATCH.match(s):
        return s
    return '"' + re.sub(r'(["\\#])', r"\\\1", s) + '"'
