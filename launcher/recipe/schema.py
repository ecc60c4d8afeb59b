"""The recipe schema: msgspec structs, strict about what they accept.

Every number has bounds (a hostile or mistyped value must fail here, not as an overflow in the planner or a
loop that runs for hours), booleans are not numbers, infinities and NaN are refused, and strings that reach
shell scripts or file names are limited in length and content.
"""

import hashlib
import json
import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from .. import catalog
from ..errors import FieldError
from ..jobenv import CHECKPOINT_DIR as CHECKPOINT_DIR_ENV
from ..jobenv import RUN_ID as RUN_ID_ENV
from ..jobenv import env_owner
from ..targets.local.spec import LocalTarget
from ..targets.sky.spec import SkyTarget
from ..targets.slurm.spec import SlurmTarget
from .fields import (
    ENV_NAME,
    MAX_ENV_VALUE,
    RUN_ID,
    AutoInt,
    Doc,
    Float,
    Int,
    Invalid,
    Spec,
    Str,
    Strategy,
    Target,
    Text,
    checked,
    suggest,
)
from .model_spec import ModelSpec


class ParallelismSpec(Spec, kw_only=True):
    strategy: Strategy = "auto"
    backend: Doc(
        "which family `auto` picks from: torch (DDP/FSDP2) or deepspeed (ZeRO)", Literal["torch", "deepspeed"]
    ) = "torch"
    data: AutoInt(10_000_000, "data-parallel degree; auto = world / (tensor*pipeline)") = "auto"
    # auto: strategy auto's search chooses (a written degree it keeps); any other strategy takes 1 (off)
    tensor: AutoInt(1024, "tensor-parallel degree; auto = strategy auto's choice, else 1") = "auto"
    pipeline: AutoInt(1024, "pipeline-parallel degree; auto = strategy auto's choice, else 1") = "auto"
    sequence_parallel: Doc(
        "with tensor > 1: split the residual stream and the norms over the sequence across the tensor-parallel "
        "group; auto = strategy auto's choice, else off",
        bool | Literal["auto"],
    ) = "auto"
    pipeline_schedule: Doc(
        "with pipeline > 1: 1F1B (one stage per rank), or interleaved 1F1B (two stages per rank: "
        "smaller bubbles, more activations in flight)",
        Literal["1f1b", "interleaved_1f1b"],
    ) = "1f1b"
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    loss_scaling: Doc("fp16 only: dynamic loss scaling", Literal["dynamic", "none"]) = "dynamic"
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    offload: Literal["auto", "none", "optimizer", "params"] = "auto"
    grad_accum: AutoInt(1_000_000) = "auto"
    grad_reduce: Doc(
        "FSDP2 with grad_accum > 1: reduce-scatter gradients on every micro-batch (they stay sharded), "
        "or once per step (each rank keeps the unsharded fp32 gradients meanwhile); auto = once per step "
        "when that fits",
        Literal["auto", "every_micro_batch", "once_per_step"],
    ) = "auto"
    launcher: Doc(
        "how DeepSpeed recipes start: torchrun on every node, or the deepspeed launcher",
        Literal["torchrun", "deepspeed"],
    ) = "torchrun"


class ResourcesSpec(Spec, kw_only=True):
    accelerator: Text(64, "TYPE:COUNT per node, as SkyPilot spells it, e.g. H100:8, cpu:2") = "H100:8"
    gpu_memory_gb: Float(gt=0, le=100000, description="override the catalogue's memory per device") | None = None
    usd_per_gpu_hour: Float(ge=0, le=1000000, description="override the catalogue's price") | None = None
    peak_tflops: Float(ge=0.001, le=1000000, description="override the catalogue's dense bf16 peak") | None = None
    nodes: Int(1, 100_000) = 1
    network: Text(64, "best, infiniband, efa, tcp, loopback") = "best"
    mfu: Float(gt=0, le=1, description="assumed model FLOPs utilisation for time estimates") = 0.40
    gpu_mtbf_hours: Float(gt=0, le=1e9, description="mean time between failures per GPU") = catalog.GPU_MTBF_HOURS
    storage_gbps_per_node: Float(ge=0.001, le=1_000_000) = catalog.STORAGE_GBPS_PER_NODE
    calibration: Doc(
        "a calibration file from `dtlaunch calibrate` (relative to the recipe): the MFU and checkpoint write rate "
        "it measured replace mfu and storage_gbps_per_node",
        Str | None,
    ) = None
    socket_ifname: (
        Text(
            256,
            "NCCL/gloo network interface(s), e.g. eth0 or ^docker; unset = let NCCL choose (best)",
            r"^[A-Za-z0-9_.:^,=-]+\Z",
        )
        | None
    ) = None
    image: (
        Text(
            512,
            "a Docker/OCI image every target's job runs in, e.g. nvcr.io/nvidia/pytorch:24.05-py3 "
            "(SkyPilot: image_id; SLURM: targets.slurm.container picks pyxis or Apptainer)",
        )
        | None
    ) = None

    def __post_init__(self) -> None:
        name, _ = checked("accelerator", catalog.parse_accelerator, self.accelerator)
        if name not in catalog.ACCELERATORS:
            raise Invalid(
                "accelerator",
                f"unknown accelerator {name!r}{suggest(name, catalog.ACCELERATORS)}; "
                f"known: {', '.join(catalog.ACCELERATORS)}",
            )
        if self.image is not None:
            from .images import parse_image

            checked("image", parse_image, self.image)
        if self.network not in catalog.NETWORKS:
            raise Invalid(
                "network",
                f"unknown network {self.network!r}{suggest(self.network, catalog.NETWORKS)}; "
                f"known: {', '.join(catalog.NETWORKS)}",
            )

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


class DataSpec(Spec, kw_only=True):
    source: Literal["synthetic", "file"] = "synthetic"
    path: Doc("a token file (.bin uint16/uint32 or .npy, or .txt bytes) for source: file", Str | None) = None
    dtype: Literal["uint16", "uint32", "bytes"] = "uint16"
    # Synthetic tokens are generated in memory (4 bytes each): 2**31 is already 8 GB per rank.
    num_tokens: Int(2, 2**31 - 1, "synthetic: how many tokens to generate") = 1 << 20
    workers: Int(0, 256) = 0

    def __post_init__(self) -> None:
        if self.source == "file" and not self.path:
            raise ValueError("source: file needs `path` (a local token file)")


Beta = Float(ge=0, lt=1)


class TrackingSpec(Spec, kw_only=True):
    """Where rank 0 sends the step figures besides metrics.jsonl and the log: off unless selected."""

    tensorboard: Doc(
        "write TensorBoard event files to RUN_DIR/tensorboard (needs tensorboard: pip install 'dtlaunch[track]')",
        bool,
    ) = False
    wandb: Doc(
        "log to Weights & Biases; the W&B run id is the run's id, so a resumed run continues the same W&B run "
        "(needs wandb: pip install 'dtlaunch[track]'; an API key through secrets: [WANDB_API_KEY], or "
        "WANDB_MODE=offline)",
        bool,
    ) = False
    wandb_project: Text(128, "the W&B project; default: WANDB_PROJECT, else the recipe's name") | None = None

    def __post_init__(self) -> None:
        p = self.wandb_project
        if p is not None and (not p.strip() or set(p) & set("/\\#?%:\n\r\t\x00")):
            raise Invalid(
                "wandb_project",
                f"{p!r} is not a W&B project name: it must not be empty or hold / \\ # ? % : or a line break",
                "name the entity with WANDB_ENTITY, and the project alone here",
            )


class TrainingSpec(Spec, kw_only=True):
    micro_batch: Int(1, 1_000_000, "sequences per GPU per forward pass") = 1
    global_batch: Int(1, 10**9, "sequences per optimizer step, all GPUs") | None = None
    steps: Int(1, 10**12) | None = None
    tokens: Int(1, 10**17, "alternative to steps: total training tokens") | None = None
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: Float(gt=0, le=10) = 3e-4
    min_lr: Float(ge=0, le=10) = 0.0
    weight_decay: Float(ge=0, le=10) = 0.1
    betas: tuple[Beta, Beta] = (0.9, 0.95)
    grad_clip: Float(ge=0, le=1e6) = 1.0
    warmup_steps: Int(0, 10**12) = 0
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    seed: Int(0, 2**63 - 1) = 0
    data: DataSpec = msgspec.field(default_factory=DataSpec)
    log_every: Int(1, 10**9) = 1
    tracking: Doc("TensorBoard and Weights & Biases, besides metrics.jsonl; off by default", TrackingSpec) = (
        msgspec.field(default_factory=TrackingSpec)
    )
    eval_every: Int(
        0,
        10**9,
        "every this many steps, the loss on held-out data (val_loss; dtlaunch's trainer, not with pipeline "
        "parallelism); 0 = never. Synthetic data holds out a separate stream of the same walk; a token file, its "
        "last eval_batches global batches, which training then never reads",
    ) = 0
    eval_batches: Int(1, 10_000, "global batches of held-out data each evaluation reads") = 4
    timeout_seconds: Int(1, 10**7, "collective timeout after init; a hang ends the job after this") = 600
    init_timeout_seconds: Int(1, 10**7, "rendezvous / first collective timeout") = 900
    deterministic: bool = False
    max_nonfinite_steps: Int(1, 1000, "end the run (exit 45) after this many steps in a row with a NaN/inf loss") = 3
    preflight: bool = True
    min_allreduce_fraction: Float(
        ge=0, le=1, description="fail preflight below this fraction of the network's expected bandwidth"
    ) = 0.0
    on_straggler: Doc(
        "a rank whose forward stays much slower than the others' for 3 log steps: warn (named in the log and "
        "metrics.jsonl), or exit (checkpoint; its node exits 44, so the SLURM job requeues without it)",
        Literal["warn", "exit"],
    ) = "warn"

    def __post_init__(self) -> None:
        if self.steps is not None and self.tokens is not None:
            raise FieldError(
                "set only one of `steps` (optimizer steps) and `tokens` (training tokens)",
                "keep one; to override one on the command line, unset the other: "
                "--set training.steps=100 --set training.tokens=null",
            )


class CheckpointSpec(Spec, kw_only=True):
    dir: Doc("shared directory for checkpoints; {run_id} expands to the job's run id", Str | None) = None
    every: AutoInt(10**12) = "auto"
    adapt: Doc(
        "at each restart, save at the interval this run's own interruptions, saves and recoveries call for "
        "(availability-optimal, as `status --goodput` prints it) instead of checkpoint.every",
        bool,
    ) = False
    keep: Int(1, 10_000) = 3
    async_: bool = msgspec.field(default=False, name="async")
    export: Literal["none", "safetensors", "torch"] = "safetensors"
    resume_changed_recipe: Doc(
        "resume a checkpoint written by a recipe with another model, optimizer, schedule or "
        "data (normally refused: it is another run's checkpoint)",
        bool,
    ) = False
    grace_seconds: AutoInt(
        86_400,
        "after TERM/USR2, how long torchrun waits for the workers to checkpoint and exit "
        "before it kills them; auto = 3 checkpoint writes + 30 s (at least 30)",
    ) = "auto"


MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*\Z", re.ASCII)


class EntrypointSpec(Spec, kw_only=True):
    """The user's own training code, started by the job instead of `python -m launcher.runtime.train`."""

    script: Doc(
        "a Python file, relative to workdir (shipped with the job): torchrun runs it on every rank", Str | None
    ) = None
    module: Text(512, "a module importable from workdir, run like `python -m MODULE`") | None = None
    args: Annotated[
        list[Text(4096)], Meta(max_length=1000, description="arguments passed to the script or module, as written")
    ] = []
    workdir: Doc(
        "the directory shipped with the job (relative to the recipe file, default: the recipe file's "
        "directory); the code runs from its copy",
        Str | None,
    ) = None
    exclude: Annotated[
        list[Text(512)],
        Meta(
            max_length=200,
            description="glob patterns of files not to ship (e.g. data/*, *.ckpt), besides .git, caches and venvs",
        ),
    ] = []

    def __post_init__(self) -> None:
        v = self.script
        if v is not None:
            parts = v.replace("\\", "/").split("/")
            if not v.strip() or v.startswith("/") or v.startswith("~") or ".." in parts or "\x00" in v:
                raise Invalid(
                    "script",
                    f"{v!r}: a path relative to entrypoint.workdir, inside it (the job runs a copy of workdir)",
                )
            if not v.endswith(".py"):
                raise Invalid("script", f"{v!r}: a Python file (.py); for a package use entrypoint.module")
        if self.module is not None and not MODULE_NAME.match(self.module):
            raise Invalid(
                "module", f"{self.module!r} is not a module name (dotted Python identifiers, e.g. mypkg.train)"
            )
        for a in self.args:
            if "\x00" in a:
                raise Invalid("args", "contains a NUL byte, which no command-line argument can hold")
        if (self.script is None) == (self.module is None):
            raise ValueError("set exactly one of entrypoint.script (a .py file) and entrypoint.module")


class TargetsSpec(Spec, kw_only=True):
    default: Target = "local"
    local: LocalTarget = msgspec.field(default_factory=LocalTarget)
    slurm: SlurmTarget = msgspec.field(default_factory=SlurmTarget)
    sky: SkyTarget = msgspec.field(default_factory=SkyTarget)


class Recipe(Spec, kw_only=True, dict=True):
    name: Text(200)
    run_id: Doc(
        "the run's identity (checkpoints, metrics): set it to resume an earlier run; default: the "
        "scheduler's job id (SLURM), the managed job's task id (SkyPilot), the name (local)",
        str | None,
    ) = None
    model: ModelSpec
    parallelism: ParallelismSpec = msgspec.field(default_factory=ParallelismSpec)
    resources: ResourcesSpec = msgspec.field(default_factory=ResourcesSpec)
    training: TrainingSpec
    checkpoint: CheckpointSpec = msgspec.field(default_factory=CheckpointSpec)
    entrypoint: Doc(
        "the user's own training code; default: dtlaunch's trainer (python -m launcher.runtime.train)",
        EntrypointSpec | None,
    ) = None
    targets: TargetsSpec = msgspec.field(default_factory=TargetsSpec)
    env: Annotated[dict[str, Any], Meta(max_length=1000, description="plain environment variables for the job")] = {}
    secrets: Annotated[
        list[str], Meta(max_length=100, description="names of environment variables passed through; never values")
    ] = []

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise Invalid("name", "must not be empty")
        if self.run_id is not None and not RUN_ID.match(self.run_id):
            raise Invalid(
                "run_id",
                f"{self.run_id!r}: a run id is 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit",
            )
        self.env = _env_values(self.env)
        if self.entrypoint is not None:
            self._check_entrypoint_training()
        for s in self.secrets:
            if not ENV_NAME.match(s):
                raise Invalid(
                    "secrets", f"{s!r} is not an environment variable name; secrets lists names only, never values"
                )

    def _check_entrypoint_training(self) -> None:
        """What only dtlaunch's own trainer does: with the user's loop it would silently do nothing."""
        if self.training.eval_every:
            raise Invalid(
                ("training", "eval_every"),
                "the held-out loss is computed by dtlaunch's trainer; an entrypoint trains with its own loop",
                "evaluate in your own loop, or remove training.eval_every",
            )

    def set_source(self, source: Any) -> None:
        """Remember where the recipe came from (loading.SourceMap: file and line of each field)."""
        self.__dict__["source"] = source

    def locate(self, field: str) -> tuple[str | None, int | None]:
        """(file or `--set KEY=VALUE`, line) of a field, when the recipe was loaded from text."""
        source = self.__dict__.get("source")
        return source.locate(field) if source is not None else (None, None)

    def base_dir(self) -> str | None:
        """The directory of the recipe file it was loaded from (None for text or a plan file)."""
        return getattr(self.__dict__.get("source"), "base_dir", None)

    @property
    def job_name(self) -> str:
        """A scheduler-safe name derived from `name` (the recipe's name may hold anything).

        Names with no ASCII letters or digits at all (e.g. only CJK or emoji) would collapse to the same
        name; a short digest of the original keeps them apart.
        """
        n = re.sub(r"[^A-Za-z0-9._-]+", "-", self.name).strip("-._")
        if n == self.name:
            return n[:63]
        tag = hashlib.sha256(self.name.encode()).hexdigest()[:8]
        if not re.search(r"[A-Za-z0-9]", n):
            return f"job-{tag}"
        return f"{n[:54]}-{tag}"[:63]

    def to_dict(self) -> dict[str, Any]:
        """The recipe as JSON holds it (lists, not tuples), so a copy read back from a checkpoint or plan file
        compares equal to it."""
        return msgspec.json.decode(msgspec.json.encode(self))

    def digest(self) -> str:
        """A recipe's identity: the fields that differ from their defaults. A newer dtlaunch that only adds
        optional fields leaves it unchanged, and so does writing out a default."""
        return hashlib.sha256(json.dumps(_given(self), sort_keys=True).encode()).hexdigest()[:16]


# Reserved variables a recipe field sets: the fix names the field.
_ENV_FIELDS = {RUN_ID_ENV: "run_id", CHECKPOINT_DIR_ENV: "checkpoint.dir"}


def _env_values(v: dict) -> dict[str, str]:
    """env values as the job's environment holds them: text (numbers and booleans written as YAML spells them)."""
    out = {}
    for k, val in v.items():
        if not ENV_NAME.match(k):
            raise Invalid("env", f"{k!r} is not a valid environment variable name (letters, digits, _)")
        if who := env_owner(k):
            sets = f"{who} sets it for every " + ("rank" if who == "torchrun" else "job")
            instead = f" (set {_ENV_FIELDS[k]} instead)" if k in _ENV_FIELDS else ""
            raise Invalid(
                ("env", k),
                f"{k} is reserved: {sets}, and the recipe's value would override it",
                f"remove env.{k}: {sets}{instead}",
            )
        if isinstance(val, (dict, list)) or val is None:
            raise Invalid("env", f"{k}: value must be a string or number")
        if isinstance(val, float) and (val != val or val in (float("inf"), float("-inf"))):
            raise Invalid("env", f"{k}: {val} is not a finite number; quote it if you mean the text")
        s = str(val).lower() if isinstance(val, bool) else str(val)
        if "\x00" in s:
            raise Invalid("env", f"{k}: the value contains a NUL byte, which no environment variable can hold")
        if len(s) > MAX_ENV_VALUE:
            raise Invalid("env", f"{k}: the value is {len(s):,} characters long (at most {MAX_ENV_VALUE:,})")
        out[k] = s
    return out


def parse(data: Any) -> Recipe:
    """A Recipe from plain data (a loaded YAML document, a plan file's copy): msgspec.ValidationError on any
    mistake."""
    # strict=False reads numbers and booleans that YAML left as text, as pydantic did: PyYAML reads `1e-4`
    # (no dot) as a string, and users write learning rates that way. Booleans are still not numbers.
    return msgspec.convert(data, Recipe, strict=False)


def _given(section: msgspec.Struct) -> dict:
    """The fields of `section` (as a recipe spells them) that differ from the defaults their structs declare,
    sections recursively; a section left at its defaults is left out."""
    out = {}
    for f in msgspec.structs.fields(section):
        value = getattr(section, f.name)
        if isinstance(value, msgspec.Struct):
            if sub := _given(value):
                out[f.encode_name] = sub
            continue
        if f.default is not msgspec.NODEFAULT:
            default = f.default
        elif f.default_factory is not msgspec.NODEFAULT:
            default = f.default_factory()
        else:
            default = msgspec.NODEFAULT  # a required field: always part of the identity
        if value != default:
            out[f.encode_name] = msgspec.to_builtins(value)
    return out
