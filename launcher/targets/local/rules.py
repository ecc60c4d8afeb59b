"""validate's rules for the local target."""

from __future__ import annotations

from ...plan import Plan
from ...recipe import Recipe
from ...validate.core import rule

LOCAL = ("local",)


@rule("image-local", "warning", "resources.image", "resources.image on the local target", LOCAL)
def _image_local(r: Recipe, p: Plan):
    if r.resources.image:
        return (
            f"the local target runs this machine's Python, not {r.resources.image}",
            "fine for a quick test; the image is used on SLURM and SkyPilot",
        )
