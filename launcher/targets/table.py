"""The table of targets, `TARGETS`: one row per package under launcher/targets/ (see __init__). Apart from the
protocols in __init__ (which name the plan, the recipe and the artifacts) so that the recipe's schema can read
the names without importing what sits above it."""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from ..errors import DtlaunchError


class TargetSpec(msgspec.Struct, frozen=True):
    """A target's row: its name (`--target NAME`, the recipe's `targets.NAME`) and where its package keeps its
    renderer, its backend and its handle ("module:attribute" inside launcher/targets/NAME/)."""

    name: str
    renderer: str
    backend: str
    handle: str

    @property
    def package(self) -> str:
        return f"{__package__}.{self.name}"

    def module(self, name: str):
        """The package's module `name` (e.g. "rules"), imported now."""
        return importlib.import_module(f"{self.package}.{name}")

    def load(self, part: str) -> Any:
        """The renderer, backend class or handle class (part: "renderer", "backend" or "handle"), imported now."""
        mod, _, attr = getattr(self, part).partition(":")
        return getattr(self.module(mod), attr)


TARGETS: dict[str, TargetSpec] = {
    t.name: t
    for t in (
        TargetSpec("local", "render:render_local", "backend:LocalBackend", "request:LocalHandle"),
        TargetSpec("slurm", "render:render_slurm", "backend:SlurmBackend", "request:SlurmHandle"),
        TargetSpec("sky", "render:render_sky", "backend:SkyBackend", "request:SkyHandle"),
    )
}
TARGET_NAMES: tuple[str, ...] = tuple(TARGETS)


def target(name: str) -> TargetSpec:
    if name not in TARGETS:
        raise DtlaunchError(f"unknown target {name!r}", fix=f"use one of {', '.join(TARGET_NAMES)}")
    return TARGETS[name]
