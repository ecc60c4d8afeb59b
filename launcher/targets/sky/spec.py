"""The recipe's `targets.sky` section (with its checkpoint storage and data mounts): what SkyPilot accepts,
checked where it is written rather than by `sky launch` after the queue.
"""

import re
from typing import Annotated, Literal

from msgspec import Meta

from ... import catalog
from ...recipe.fields import BUCKET, Doc, Int, Invalid, Spec, Str, Text, checked, suggest


class SkyStorage(Spec, kw_only=True):
    """Checkpoint storage every node (and every recovery) sees: a bucket or a SkyPilot volume, mounted."""

    bucket: Text(1024, "e.g. s3://my-bucket/ckpt, gs://..., r2://...") | None = None
    volume: (
        Text(256, "a SkyPilot volume (sky volumes apply), instead of a bucket", r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?\Z")
        | None
    ) = None
    mount: Text(1024, "where the nodes see it") = "/checkpoints"
    mode: Doc(
        "MOUNT_CACHED writes to local disk and uploads in the background (fast saves)", Literal["MOUNT_CACHED", "MOUNT"]
    ) = "MOUNT_CACHED"

    def __post_init__(self) -> None:
        if self.bucket is not None and not BUCKET.match(self.bucket):
            raise Invalid(
                "bucket",
                f"{self.bucket!r} is not a bucket URI: use s3://, gs://, r2://, cos://, oci://, nebius:// or https://",
            )
        v = self.mount
        if not (v.startswith("/") or v.startswith("~/")) or "{" in v or ".." in v.split("/"):
            raise Invalid("mount", f"{v!r}: the mount point must be an absolute path or start with ~/")
        self.mount = v.rstrip("/") or "/"
        if (self.bucket is None) == (self.volume is None):
            raise ValueError("give exactly one of `bucket` and `volume`")


class SkyDataMount(Spec, kw_only=True):
    """Weights or data every node reads: a bucket mounted (or copied) at `path`, or a local directory copied."""

    path: Text(1024, "where the nodes see it, e.g. /data")
    source: Text(1024, "a bucket URI (s3://..., gs://...) or a directory on the machine that launches")
    mode: Doc(
        "MOUNT streams from the bucket; COPY copies it onto each node's disk before setup (a local source "
        "is always copied)",
        Literal["MOUNT", "COPY"],
    ) = "MOUNT"

    def __post_init__(self) -> None:
        if not self.path.startswith("/") or "{" in self.path or ".." in self.path.split("/"):
            raise Invalid("path", f"{self.path!r}: the mount point must be an absolute path")
        self.path = self.path.rstrip("/") or "/"
        if self.mode == "MOUNT" and not BUCKET.match(self.source):
            raise Invalid(
                "mode", f"{self.source!r} is not a bucket: a local directory can only be copied", "set mode: COPY"
            )


class SkyTarget(Spec, kw_only=True):
    infra: Text(256, "e.g. aws, gcp/us-central1, k8s") | None = None
    cloud: Text(64) | None = None
    region: Text(128) | None = None
    zone: Text(128) | None = None
    spot: bool = False
    managed: bool = False
    disk_size: (
        Int(
            1,
            65536,
            "GB of disk per node (default: the cloud's, 256 on most); with MOUNT_CACHED checkpoint "
            "storage the checkpoints are cached there before they upload",
        )
        | None
    ) = None
    max_restarts_on_errors: Int(0, 1000) = 3
    recovery: Doc(
        "how a managed job recovers: same_nodes (SkyPilot's FAILOVER: relaunched on its cluster while that is "
        "up) or fresh_nodes (EAGER_NEXT_REGION: the cluster terminated and provisioned anew, another region "
        "first), which leaves a node that failed its check or straggled behind; auto: fresh_nodes for spot, "
        "same_nodes otherwise",
        Literal["auto", "same_nodes", "fresh_nodes"],
    ) = "auto"
    max_restarts: Int(0, 1000, "torchrun restarts inside one launch") = 2
    setup: Annotated[list[Str], Meta(max_length=1000)] = []
    workdir: Str | None = None
    checkpoint_storage: Doc(
        "shared checkpoint storage; required for multi-node, managed and spot jobs", SkyStorage | None
    ) = None
    data_mounts: Annotated[
        list[SkyDataMount],
        Meta(
            max_length=32,
            description="weights and data files the nodes read (model.hf_weights, training.data.path "
            "must lie under one)",
        ),
    ] = []
    autostop_minutes: (
        Int(1, 100000, "`sky launch` clusters: stop after this many idle minutes (null: never)") | None
    ) = 10
    autodown: Doc("with autostop: tear the cluster down instead of stopping it", bool) = True
    deepspeed_ssh: Doc(
        "parallelism.launcher: deepspeed: the head starts every node's workers over ssh/pdsh "
        "(default: every node runs DeepSpeed's launcher itself, --no_ssh); pdsh passes values to "
        "every node's shell unescaped, so paths, env values and entrypoint args may not hold $ ` \" "
        "\\ or line breaks (validate and the job script refuse them)",
        bool,
    ) = False
    accelerators: Annotated[
        list[Text(64)],
        Meta(
            max_length=16,
            description="fallbacks after resources.accelerator, e.g. [A100-80GB:8]: each is planned on "
            "its own, those that cannot fit are dropped; same device count per node",
        ),
    ] = []
    fallback: Doc(
        "with accelerators: ordered = try the cheapest plan first (dtlaunch's cost estimate); any_of = let "
        "SkyPilot pick the cheapest available",
        Literal["ordered", "any_of"],
    ) = "ordered"
    instance_type: (
        Text(128, "a cloud instance type, e.g. p5.48xlarge, a3-highgpu-8g", r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z") | None
    ) = None
    cpus: Doc("vCPUs per node: N, or N+ for at least N", Text(16) | int | float | None) = None
    memory: Doc("memory per node in GB: N, or N+ for at least N", Text(16) | int | float | None) = None
    ports: Annotated[
        list[int | Text(16)],
        Meta(max_length=100, description="ports to open on the nodes: 8080 or ranges like 10000-10010"),
    ] = []
    disk_tier: Doc(
        "disk performance tier (SkyPilot's disk_tier)", Literal["low", "medium", "high", "ultra", "best"] | None
    ) = None

    def __post_init__(self) -> None:
        for a in self.accelerators:
            name, _ = checked("accelerators", catalog.parse_accelerator, a)
            if name not in catalog.ACCELERATORS:
                raise Invalid(
                    "accelerators",
                    f"unknown accelerator {name!r}{suggest(name, catalog.ACCELERATORS)}; "
                    f"known: {', '.join(catalog.ACCELERATORS)}",
                )
            if not catalog.ACCELERATORS[name].is_gpu:
                raise Invalid(
                    "accelerators",
                    f"{a!r}: SkyPilot has no cpu accelerator; a fallback is a GPU type, e.g. A100-80GB:8",
                )
        self.cpus = checked("cpus", _amount, self.cpus)
        self.memory = checked("memory", _amount, self.memory)
        self.ports = checked("ports", _ports, self.ports)

    def is_managed(self) -> bool:
        """A managed job (sky jobs launch): spot capacity only makes sense with recovery, so spot implies it."""
        return self.managed or self.spot

    def recovery_strategy(self) -> str:
        """SkyPilot's job_recovery strategy for `recovery`. Spot capacity vanishes region-wide; an on-demand
        failure is usually one bad node, which FAILOVER keeps (it relaunches on the cluster while that is up)
        and EAGER_NEXT_REGION leaves (it terminates the cluster first)."""
        fresh = self.recovery == "fresh_nodes" or (self.recovery == "auto" and self.spot)
        return "EAGER_NEXT_REGION" if fresh else "FAILOVER"


def _amount(v):
    if v is None:
        return v
    if isinstance(v, int):
        v = str(v) if 0 < v < 10**6 else "out of range"
    elif isinstance(v, float):
        v = format(v, "g")
    if re.fullmatch(r"\d{1,6}(\.\d{1,3})?\+?", v, flags=re.ASCII) and float(v.rstrip("+")) > 0:
        return v
    raise ValueError(f"{str(v)[:40]!r}: a positive number, optionally followed by + (at least), e.g. 8 or 32+")


def _ports(v: list) -> list[int | str]:
    out: list[int | str] = []
    for p in v:
        lo, hi = (p, p) if isinstance(p, int) else (None, None)
        if isinstance(p, str):
            m = re.fullmatch(r"(\d{1,5})(?:-(\d{1,5}))?", p, flags=re.ASCII)
            if m:
                lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo is None or hi is None or not 1 <= lo <= hi <= 65535:
            raise ValueError(f"{str(p)[:40]!r}: a port is a number 1-65535 or a range LOW-HIGH within it")
        out.append(lo if lo == hi else f"{lo}-{hi}")
    return out
