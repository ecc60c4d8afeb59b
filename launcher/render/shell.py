"""Quoting for generated shell: every value from a recipe goes through here.

A `Sh` marks a fragment that must be expanded by the shell at run time (e.g. "$SLURM_NNODES"); it is
emitted inside double quotes so it expands to one word. Everything else is a literal and goes through
shlex.quote, so `name: "x; touch /tmp/pwned"` stays a harmless string.
"""
from __future__ import annotations

import shlex
from typing import Iterable, Union


class Sh(str):
    """A run-time shell expression, e.g. Sh('$MASTER_ADDR:$PORT'). Must not contain double quotes."""

    def __new__(cls, value: str):
        if '"' in value or "`" in value:
            raise ValueError(f"shell expression must not contain quotes or backticks: {value!r}")
        return super().__new__(cls, value)


Word = Union[str, Sh]


def quote(word: Word) -> str:
    if isinstance(word, Sh):
        return f'"{word}"'
    return shlex.quote(str(word))


def join(words: Iterable[Word]) -> str:
    return " ".join(quote(w) for w in words)


def flag(name: str, value: Word) -> Word:
    """`--name=value`, keeping a run-time expression expandable."""
    if isinstance(value, Sh):
        return Sh(f"{name}={value}")
    return f"{name}={value}"


def exports(env: dict[str, Word]) -> str:
    """`export K=V` lines; keys are validated names, values quoted."""
    return "\n".join(f"export {k}={quote(v)}" for k, v in env.items())
