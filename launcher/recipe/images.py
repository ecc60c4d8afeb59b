"""Container images: one Docker/OCI reference in the recipe (`resources.image`), spelled the way each runtime
wants it. The three runtimes disagree on the spelling of the same image, and a wrong spelling fails only on
the node, after the job has waited in the queue:

* SkyPilot: `docker:nvcr.io/nvidia/pytorch:24.05-py3` (`image_id` with a `docker:` prefix);
* Apptainer/Singularity: `docker://nvcr.io/nvidia/pytorch:24.05-py3`;
* pyxis (enroot): `nvcr.io#nvidia/pytorch:24.05-py3`: enroot separates the registry with `#`, and reads
  `nvcr.io/nvidia/pytorch` as an image on Docker Hub named that.

So the recipe holds the plain reference, checked here, and the renderers convert it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST = re.compile(rf"(?:{_LABEL})(?:\.{_LABEL})*(?::\d{{1,5}})?", re.ASCII)
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*", re.ASCII)
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", re.ASCII)
_DIGEST = re.compile(r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}", re.ASCII)
FORMS = (
    "a Docker/OCI image reference, [REGISTRY[:PORT]/]NAME[:TAG][@DIGEST], e.g. "
    "nvcr.io/nvidia/pytorch:24.05-py3 or pytorch/pytorch:2.3.1-cuda12.1-cudnn8-runtime"
)


class ImageRef(NamedTuple):
    registry: str | None  # None: Docker Hub
    name: str  # path components, e.g. nvidia/pytorch
    tag: str | None
    digest: str | None

    def tail(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    def docker(self) -> str:
        return (f"{self.registry}/" if self.registry else "") + self.tail()


def parse_image(ref: str) -> ImageRef:
    """ValueError with the accepted form; a scheme (docker://) or a file path is refused with the reason."""
    if "://" in ref or ref.startswith("docker:"):
        raise ValueError(
            f"{ref[:80]!r}: write the image without a scheme ({FORMS}); dtlaunch adds the spelling each "
            "runtime wants (docker: for SkyPilot, docker:// for Apptainer, REGISTRY# for pyxis)"
        )
    if ref.startswith(("/", ".", "~")):
        raise ValueError(
            f"{ref[:80]!r} is a file, not an image reference: put a cluster's image file in "
            "targets.slurm.container.image instead"
        )
    rest, digest = ref, None
    if "@" in rest:
        rest, _, digest = rest.partition("@")
        if not _DIGEST.fullmatch(digest):
            raise ValueError(f"{ref[:80]!r}: {digest[:80]!r} is not a digest (e.g. sha256:<64 hex digits>)")
    first, slash, after = rest.partition("/")
    registry = None
    if slash and ("." in first or ":" in first or first == "localhost"):
        if not _HOST.fullmatch(first):
            raise ValueError(f"{ref[:80]!r}: {first[:80]!r} is not a registry host[:port]")
        registry, rest = first, after
    name, tag = rest, None
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, _, tag = name.rpartition(":")
        if not _TAG.fullmatch(tag):
            raise ValueError(f"{ref[:80]!r}: {tag[:80]!r} is not a tag (letters, digits, _ . -, at most 128)")
    parts = name.split("/")
    if not name or not all(_COMPONENT.fullmatch(p) for p in parts):
        raise ValueError(f"{ref[:80]!r} is not an image reference: use {FORMS} (names are lowercase)")
    return ImageRef(registry, name, tag, digest)


def for_sky(ref: str) -> str:
    return "docker:" + parse_image(ref).docker()


def for_apptainer(ref: str) -> str:
    return "docker://" + parse_image(ref).docker()


def for_enroot(ref: str) -> str:
    """pyxis's --container-image: REGISTRY#NAME[:TAG], or NAME[:TAG] for Docker Hub."""
    img = parse_image(ref)
    return (f"{img.registry}#" if img.registry else "") + img.tail()
