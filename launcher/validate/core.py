"""Rules as data: the registry every rule module adds to."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
from msgspec.structs import asdict


class Finding(msgspec.Struct, frozen=True):
    rule: str
    severity: str  # error | warning
    field: str
    message: str
    fix: str
    file: str | None = None  # the recipe file, or `--set KEY=VALUE` when an override gave the field
    line: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


class Rule(msgspec.Struct, frozen=True):
    id: str
    severity: str
    field: str
    summary: str
    # (recipe, plan[, choices]) -> (message, fix[, field]) when the rule fires; choices with `choices` below
    check: Callable[..., tuple[str, ...] | None]
    targets: tuple[str, ...] = ()  # the targets it applies to; () = every target
    trainer_only: bool = False  # about dtlaunch's own trainer: silent when the recipe runs the user's entrypoint
    choices: bool = False  # the check also takes the SkyPilot accelerator choices (plan.choices.Choices or None)


RULES: list[Rule] = []


def rule(
    id: str,
    severity: str,
    field: str,
    summary: str,
    targets: tuple[str, ...] = (),  # noqa: A002
    trainer_only: bool = False,
    choices: bool = False,
):
    def deco(fn):
        RULES.append(Rule(id, severity, field, summary, fn, targets, trainer_only, choices))
        return fn

    return deco
