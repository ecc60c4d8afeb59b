"""The recipe schema: pydantic models, strict about what they accept.

Every number has bounds (a hostile or mistyped value must fail here, not as an overflow in the planner or a
loop that runs for hours), booleans are not numbers, infinities and NaN are refused, and strings that reach
shell scripts or file names are limited in length and content.
"""
from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from .. import catalog
from ..errors import FieldError
from .fields import ENV_NAME, MAX_ENV_VALUE, RUN_ID, AutoInt, Float, Int, Str, Strategy, Target, _Strict, suggest
from .model_spec import ModelSpec
from .target_specs import LocalTarget, SkyTarget, SlurmTarget


class ParallelismSpec(_Strict):
    strategy: Strategy = "auto"
    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="which family `auto` picks from: torch (DDP/FSDP2) or deepspeed (ZeRO)"
    )
    data: AutoInt(10_000_000) = Field("auto", description="data-parallel degree; auto = world / (tensor*pipeline)")
    tensor: Int(1, 1024) = 1
    pipeline: Int(1, 1024) = 1
    sequence_parallel: bool = Field(False, description="with tensor > 1: split the residual stream and the norms "
                                                       "over the sequence across the tensor-parallel group")
    pipeline_schedule: Literal["1f1b", "interleaved_1f1b"] = Field(
        "1f1b", description="with pipeline > 1: 1F1B (one stage per rank), or interleaved 1F1B (two stages per "
                            "rank: smaller bubbles, more activations in flight)")
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    loss_scaling: Literal["dynamic", "none"] = Field("dynamic", description="fp16 only: dynamic loss scaling")
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    offload: Literal["auto", "none", "optimizer", "params"] = "auto"
    grad_accum: AutoInt(1_000_000) = "auto"
    grad_reduce: Literal["auto", "every_micro_batch", "once_per_step"] = Field(
        "auto", description="FSDP2 with grad_accum > 1: reduce-scatter gradients on every micro-batch (they stay "
                            "sharded), or once per step (each rank keeps the unsharded fp32 gradients meanwhile); "
                            "auto = once per step when that fits")
    launcher: Literal["torchrun", "deepspeed"] = Field(
        "torchrun", description="how DeepSpeed recipes start: torchrun on every node, or the deepspeed launcher"
    )


class ResourcesSpec(_Strict):
    accelerator: str = Field("H100:8", max_length=64,
                             description="TYPE:COUNT per node, as SkyPilot spells it, e.g. H100:8, cpu:2")
    gpu_memory_gb: Float(gt=0, le=100000) | None = Field(None, description="override the catalogue's memory per device")
    usd_per_gpu_hour: Float(ge=0, le=1000000) | None = Field(None, description="override the catalogue's price")
    peak_tflops: Float(ge=0.001, le=1000000) | None = Field(None, description="override the catalogue's dense bf16 peak")
    nodes: Int(1, 100_000) = 1
    network: str = Field("best", max_length=64, description="best, infiniband, efa, tcp, loopback")
    mfu: Float(gt=0, le=1) = Field(0.40, description="assumed model FLOPs utilisation for time estimates")
    gpu_mtbf_hours: Float(gt=0, le=1e9) = Field(catalog.GPU_MTBF_HOURS, description="mean time between failures per GPU")
    storage_gbps_per_node: Float(ge=0.001, le=1_000_000) = catalog.STORAGE_GBPS_PER_NODE
    socket_ifname: str | None = Field(
        None, max_length=256, pattern=r"^[A-Za-z0-9_.:^,=-]+$",
        description="NCCL/gloo network interface(s), e.g. eth0 or ^docker; unset = let NCCL choose (best)")
    image: str | None = Field(
        None, max_length=512,
        description="a Docker/OCI image every target's job runs in, e.g. nvcr.io/nvidia/pytorch:24.05-py3 "
                    "(SkyPilot: image_id; SLURM: targets.slurm.container picks pyxis or Apptainer)")

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, v: str) -> str:
        name, _ = catalog.parse_accelerator(v)
        if name not in catalog.ACCELERATORS:
            raise ValueError(f"unknown accelerator {name!r}{suggest(name, catalog.ACCELERATORS)}; "
                             f"known: {', '.join(catalog.ACCELERATORS)}")
        return v

    @field_validator("image")
    @classmethod
    def _image(cls, v: str | None) -> str | None:
        if v is not None:
            from .images import parse_image

            parse_image(v)
        return v

    @field_validator("network")
    @classmethod
    def _known_network(cls, v: str) -> str:
        if v not in catalog.NETWORKS:
            raise ValueError(f"unknown network {v!r}{suggest(v, catalog.NETWORKS)}; known: {', '.join(catalog.NETWORKS)}")
        return v

    @property
    def accel_name(self) -> str:
        return catalog.parse_accelerator(self.accelerator)[0]

    @property
    def per_node(self) -> int:
        return catalog.parse_accelerator(self.accelerator)[1]

    @property
    def world_size(self) -> int:
        return self.per_node * self.nodes

    def device(self) -> catalog.Accelerator:
        base = catalog.ACCELERATORS[self.accel_name]
        return catalog.Accelerator(
            base.name,
            self.gpu_memory_gb if self.gpu_memory_gb is not None else base.memory_gb,
            self.peak_tflops if self.peak_tflops is not None else base.peak_tflops,
            self.usd_per_gpu_hour if self.usd_per_gpu_hour is not None else base.usd_per_hour,
            base.bf16,
            base.is_gpu,
        )


class DataSpec(_Strict):
    source: Literal["synthetic", "file"] = "synthetic"
    path: Str | None = Field(None, description="a token file (.bin uint16/uint32 or .npy, or .txt bytes) for source: file")
    dtype: Literal["uint16", "uint32", "bytes"] = "uint16"
    # Synthetic tokens are generated in memory (4 bytes each): 2**31 is already 8 GB per rank.
    num_tokens: Int(2, 2**31 - 1, "synthetic: how many tokens to generate") = 1 << 20
    workers: Int(0, 256) = 0

    @model_validator(mode="after")
    def _path_for_file(self) -> DataSpec:
        if self.source == "file" and not self.path:
            raise ValueError("source: file needs `path` (a local token file)")
        return self


class TrainingSpec(_Strict):
    micro_batch: Int(1, 1_000_000, "sequences per GPU per forward pass") = 1
    global_batch: Int(1, 10 ** 9, "sequences per optimizer step, all GPUs") | None = None
    steps: Int(1, 10 ** 12) | None = None
    tokens: Int(1, 10 ** 17, "alternative to steps: total training tokens") | None = None
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: Float(gt=0, le=10) = 3e-4
    min_lr: Float(ge=0, le=10) = 0.0
    weight_decay: Float(ge=0, le=10) = 0.1
    betas: tuple[Float(ge=0, lt=1), Float(ge=0, lt=1)] = (0.9, 0.95)
    grad_clip: Float(ge=0, le=1e6) = 1.0
    warmup_steps: Int(0, 10**12) = 0
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    seed: Int(0, 2**63 - 1) = 0
    data: DataSpec = Field(default_factory=DataSpec)
    log_every: Int(1, 10**9) = 1
    timeout_seconds: Int(1, 10**7, "collective timeout after init; a hang ends the job after this") = 600
    init_timeout_seconds: Int(1, 10**7, "rendezvous / first collective timeout") = 900
    deterministic: bool = False
    max_nonfinite_steps: Int(1, 1000, "end the run (exit 45) after this many steps in a row with a NaN/inf loss") = 3
    preflight: bool = True
    min_allreduce_fraction: Float(ge=0, le=1) = Field(
        0.0, description="fail preflight below this fraction of the network's expected bandwidth")

    @model_validator(mode="after")
    def _steps_or_tokens(self) -> TrainingSpec:
        if self.steps is not None and self.tokens is not None:
            raise FieldError("set only one of `steps` (optimizer steps) and `tokens` (training tokens)",
                             "keep one; to override one on the command line, unset the other: "
                             "--set training.steps=100 --set training.tokens=null")
        return self


class CheckpointSpec(_Strict):
    dir: Str | None = Field(None, description="shared directory for checkpoints; {run_id} expands to the job's run id")
    every: AutoInt(10**12) = "auto"
    keep: Int(1, 10_000) = 3
    async_: bool = Field(False, alias="async")
    export: Literal["none", "safetensors", "torch"] = "safetensors"
    resume_changed_recipe: bool = Field(
        False, description="resume a checkpoint written by a recipe with another model, optimizer, schedule or data "
                           "(normally refused: it is another run's checkpoint)")
    grace_seconds: AutoInt(86_400) = Field(
        "auto", description="after TERM/USR2, how long torchrun waits for the workers to checkpoint and exit before "
                            "it kills them; auto = 3 checkpoint writes + 30 s (at least 30)")


MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", re.ASCII)


def _no_nul(v: str) -> str:
    if "\x00" in v:
        raise ValueError("contains a NUL byte, which no command-line argument can hold")
    return v


class EntrypointSpec(_Strict):
    """The user's own training code, started by the job instead of `python -m launcher.train`."""

    script: Str | None = Field(
        None, description="a Python file, relative to workdir (shipped with the job): torchrun runs it on every rank")
    module: str | None = Field(None, max_length=512,
                                  description="a module importable from workdir, run like `python -m MODULE`")
    args: list[Annotated[str, AfterValidator(_no_nul), Field(max_length=4096)]] = Field(
        default_factory=list, max_length=1000, description="arguments passed to the script or module, as written")
    workdir: Str | None = Field(
        None, description="the directory shipped with the job (relative to the recipe file, default: the recipe "
                          "file's directory); the code runs from its copy")
    exclude: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=200,
        description="glob patterns of files not to ship (e.g. data/*, *.ckpt), besides .git, caches and venvs")

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is None:
            return v
        parts = v.replace("\\", "/").split("/")
        if not v.strip() or v.startswith("/") or v.startswith("~") or ".." in parts or "\x00" in v:
            raise ValueError(f"{v!r}: a path relative to entrypoint.workdir, inside it (the job runs a copy of workdir)")
        if not v.endswith(".py"):
            raise ValueError(f"{v!r}: a Python file (.py); for a package use entrypoint.module")
        return v

    @field_validator("module")
    @classmethod
    def _module(cls, v: str | None) -> str | None:
        if v is not None and not MODULE_NAME.match(v):
            raise ValueError(f"{v!r} is not a module name (dotted Python identifiers, e.g. mypkg.train)")
        return v

    @model_validator(mode="after")
    def _one(self) -> EntrypointSpec:
        if (self.script is None) == (self.module is None):
            raise ValueError("set exactly one of entrypoint.script (a .py file) and entrypoint.module")
        return self


class TargetsSpec(_Strict):
    default: Target = "local"
    local: LocalTarget = Field(default_factory=LocalTarget)
    slurm: SlurmTarget = Field(default_factory=SlurmTarget)
    sky: SkyTarget = Field(default_factory=SkyTarget)


class Recipe(_Strict):
    name: str = Field(max_length=200)
    run_id: str | None = Field(
        None, description="the run's identity (checkpoints, metrics): set it to resume an earlier run; default: "
                          "the scheduler's job id (SLURM), the managed job's task id (SkyPilot), the name (local)")
    model: ModelSpec
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    entrypoint: EntrypointSpec | None = Field(
        None, description="the user's own training code; default: dtlaunch's trainer (python -m launcher.train)")
    targets: TargetsSpec = Field(default_factory=TargetsSpec)
    env: dict[str, str] = Field(default_factory=dict, max_length=1000,
                                description="plain environment variables for the job")
    secrets: list[str] = Field(default_factory=list, max_length=100,
                               description="names of environment variables passed through; never values")
    _source: Any = PrivateAttr(None)  # loading.SourceMap: file and line of each field, for later findings

    def set_source(self, source: Any) -> None:
        self._source = source

    def locate(self, field: str) -> tuple[str | None, int | None]:
        """(file or `--set KEY=VALUE`, line) of a field, when the recipe was loaded from text."""
        return self._source.locate(field) if self._source is not None else (None, None)

    def base_dir(self) -> str | None:
        """The directory of the recipe file it was loaded from (None for text or a plan file)."""
        return getattr(self._source, "base_dir", None)

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_values(cls, v):
        if isinstance(v, dict):
            out = {}
            for k, val in v.items():
                if not isinstance(k, str) or not ENV_NAME.match(k):
                    raise ValueError(f"{k!r} is not a valid environment variable name (letters, digits, _)")
                if isinstance(val, (dict, list)) or val is None:
                    raise ValueError(f"{k}: value must be a string or number")
                if isinstance(val, float) and val != val or val in (float("inf"), float("-inf")):
                    raise ValueError(f"{k}: {val} is not a finite number; quote it if you mean the text")
                s = str(val).lower() if isinstance(val, bool) else str(val)
                if "\x00" in s:
                    raise ValueError(f"{k}: the value contains a NUL byte, which no environment variable can hold")
                if len(s) > MAX_ENV_VALUE:
                    raise ValueError(f"{k}: the value is {len(s):,} characters long (at most {MAX_ENV_VALUE:,})")
                out[k] = s
            return out
        return v

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, v: str | None) -> str | None:
        if v is not None and not RUN_ID.match(v):
            raise ValueError(f"{v!r}: a run id is 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit")
        return v

    @field_validator("secrets")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        for s in v:
            if not ENV_NAME.match(s):
                raise ValueError(f"{s!r} is not an environment variable name; secrets lists names only, never values")
        return v

    @property
    def job_name(self) -> str:
        """A scheduler-safe name derived from `name` (the recipe's name may hold anything).

        Names with no ASCII letters or digits at all (e.g. only CJK or emoji) would collapse to the same
        name; a short digest of the original keeps them apart.
        """
        n = re.sub(r"[^A-Za-z0-9._-]+", "-", self.name).strip("-._")
        tag = hashlib.sha256(self.name.encode()).hexdigest()[:8]
        if not re.search(r"[A-Za-z0-9]", n):
            return f"job-{tag}"
        if n != self.name:
            n = f"{n[:54]}-{tag}"
        return n[:63]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        """A recipe's identity: unchanged by a newer dtlaunch that only added optional fields it leaves unset."""
        d = self.to_dict()
        for path, default in LATER_FIELDS:
            *parents, leaf = path.split(".")
            cur = d
            for k in parents:
                cur = cur.get(k) if isinstance(cur, dict) else None
            if isinstance(cur, dict) and cur.get(leaf, default) == default:
                cur.pop(leaf, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# Fields added after the first recipe format, with their defaults: left at the default, they are left out of
# Recipe.digest(), so the same recipe keeps the same hash across dtlaunch versions.
LATER_FIELDS: tuple[tuple[str, Any], ...] = (
    ("resources.image", None),
    ("targets.slurm.mem_per_gpu", None), ("targets.slurm.gpu_request", "gpus_per_node"),
    ("targets.slurm.gpu_type", None), ("targets.slurm.nodelist", None), ("targets.slurm.exclude", None),
    ("targets.slurm.reservation", None), ("targets.slurm.dependency", None), ("targets.slurm.mail_type", None),
    ("targets.slurm.mail_user", None), ("targets.slurm.container", None),
    ("targets.sky.accelerators", []), ("targets.sky.fallback", "ordered"), ("targets.sky.instance_type", None),
    ("targets.sky.cpus", None), ("targets.sky.memory", None), ("targets.sky.ports", []),
    ("targets.sky.disk_tier", None),
    ("entrypoint", None), ("model.hf", None), ("model.hf_config", None), ("model.hf_weights", None),
    ("parallelism.pipeline_schedule", "1f1b"),
)
