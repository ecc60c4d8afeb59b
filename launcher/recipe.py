"""The recipe: one YAML file describing model, parallelism, resources, training, checkpoints, targets.

The schema is pydantic (so `dtlaunch schema` can emit JSON Schema for editors); loading keeps the
YAML line of every key so that each error names file, line and field path.
"""
from __future__ import annotations

import difflib
import hashlib
import json
import re
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from . import catalog
from .errors import RecipeError

Strategy = Literal["auto", "ddp", "fsdp", "fsdp_grad_op", "hybrid", "zero1", "zero2", "zero3"]
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True)


class ModelSpec(_Strict):
    """Either a preset, an explicit shape, or only a parameter count (model states only)."""

    preset: Optional[str] = Field(None, description="e.g. llama3-70b, llama2-7b, tiny")
    architecture: Literal["llama", "gpt"] = Field("llama", description="gpt = the Korthikanti et al. reference layer")
    layers: Optional[int] = Field(None, gt=0)
    hidden: Optional[int] = Field(None, gt=0)
    ffn_hidden: Optional[int] = Field(None, gt=0)
    heads: Optional[int] = Field(None, gt=0)
    kv_heads: Optional[int] = Field(None, gt=0)
    vocab: Optional[int] = Field(None, gt=0)
    tied_embeddings: Optional[bool] = None
    params: Optional[int] = Field(None, gt=0, description="parameter count, when the shape is unknown")
    seq_len: Optional[int] = Field(None, gt=0)
    rope_theta: Optional[float] = Field(None, gt=0)

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and v not in catalog.PRESETS:
            raise ValueError(f"unknown preset {v!r}{_suggest(v, catalog.PRESETS)}; known: {', '.join(catalog.PRESETS)}")
        return v

    @model_validator(mode="after")
    def _complete(self) -> "ModelSpec":
        shape_fields = ("layers", "hidden", "ffn_hidden", "heads", "vocab")
        given = [f for f in shape_fields if getattr(self, f) is not None]
        if self.preset is None and self.params is None and len(given) < len(shape_fields):
            missing = [f for f in shape_fields if getattr(self, f) is None]
            raise ValueError(
                "the model needs a `preset`, a full shape, or `params`; missing: " + ", ".join(missing)
            )
        return self

    def shape(self) -> Optional[catalog.ModelShape]:
        """The resolved shape (preset with explicit overrides), or None for a params-only model."""
        base = catalog.PRESETS.get(self.preset) if self.preset else None
        if base is None and self.layers is None:
            return None
        vals = {}
        for f in ("layers", "hidden", "ffn_hidden", "heads", "kv_heads", "vocab", "tied_embeddings", "seq_len", "rope_theta"):
            v = getattr(self, f)
            vals[f] = v if v is not None else (getattr(base, f) if base else None)
        if vals["kv_heads"] is None:
            vals["kv_heads"] = vals["heads"]
        if vals["tied_embeddings"] is None:
            vals["tied_embeddings"] = False
        if vals["ffn_hidden"] is None:
            vals["ffn_hidden"] = 4 * vals["hidden"]
        if vals["seq_len"] is None:
            vals["seq_len"] = 2048
        if vals["rope_theta"] is None:
            vals["rope_theta"] = 10000.0
        return catalog.ModelShape(**vals)

    def seq(self) -> int:
        s = self.shape()
        return s.seq_len if s else (self.seq_len or 2048)


class ParallelismSpec(_Strict):
    strategy: Strategy = "auto"
    backend: Literal["torch", "deepspeed"] = Field(
        "torch", description="which family `auto` picks from: torch (DDP/FSDP2) or deepspeed (ZeRO)"
    )
    data: Union[int, Literal["auto"]] = Field("auto", description="data-parallel degree; auto = world / (tensor*pipeline)")
    tensor: int = Field(1, ge=1)
    pipeline: int = Field(1, ge=1)
    sequence_parallel: bool = False
    precision: Literal["bf16", "fp16", "fp32"] = "bf16"
    loss_scaling: Literal["dynamic", "none"] = Field("dynamic", description="fp16 only: dynamic loss scaling")
    activation_checkpointing: Literal["auto", "none", "selective", "full"] = "auto"
    offload: Literal["auto", "none", "optimizer", "params"] = "auto"
    grad_accum: Union[int, Literal["auto"]] = "auto"
    launcher: Literal["torchrun", "deepspeed"] = Field(
        "torchrun", description="how DeepSpeed recipes start: torchrun on every node, or the deepspeed launcher"
    )

    @field_validator("data", "grad_accum")
    @classmethod
    def _positive(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 (or 'auto')")
        return v


class ResourcesSpec(_Strict):
    accelerator: str = Field("H100:8", description="TYPE:COUNT per node, as SkyPilot spells it, e.g. H100:8, cpu:2")
    gpu_memory_gb: Optional[float] = Field(None, gt=0, description="override the catalogue's memory per device")
    usd_per_gpu_hour: Optional[float] = Field(None, ge=0, description="override the catalogue's price")
    peak_tflops: Optional[float] = Field(None, gt=0, description="override the catalogue's dense bf16 peak")
    nodes: int = Field(1, ge=1)
    network: str = Field("best", description="best, infiniband, efa, tcp, loopback")
    mfu: float = Field(0.40, gt=0, le=1, description="assumed model FLOPs utilisation for time estimates")
    gpu_mtbf_hours: float = Field(catalog.GPU_MTBF_HOURS, gt=0, description="mean time between failures per GPU")
    storage_gbps_per_node: float = Field(catalog.STORAGE_GBPS_PER_NODE, gt=0)

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, v: str) -> str:
        name, _ = catalog.parse_accelerator(v)
        if name not in catalog.ACCELERATORS:
            raise ValueError(
                f"unknown accelerator {name!r}{_suggest(name, catalog.ACCELERATORS)}; known: {', '.join(catalog.ACCELERATORS)}"
            )
        return v

    @field_validator("network")
    @classmethod
    def _known_network(cls, v: str) -> str:
        if v not in catalog.NETWORKS:
            raise ValueError(f"unknown network {v!r}{_suggest(v, catalog.NETWORKS)}; known: {', '.join(catalog.NETWORKS)}")
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
    path: Optional[str] = Field(None, description="a token file (.bin uint16/uint32 or .npy, or .txt bytes) for source: file")
    dtype: Literal["uint16", "uint32", "bytes"] = "uint16"
    num_tokens: int = Field(1 << 20, gt=0, description="synthetic: how many tokens to generate")
    workers: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _path_for_file(self) -> "DataSpec":
        if self.source == "file" and not self.path:
            raise ValueError("source: file needs `path` (a local token file)")
        return self


class TrainingSpec(_Strict):
    micro_batch: int = Field(1, ge=1, description="sequences per GPU per forward pass")
    global_batch: Optional[int] = Field(None, ge=1, description="sequences per optimizer step, all GPUs")
    steps: Optional[int] = Field(None, ge=1)
    tokens: Optional[int] = Field(None, ge=1, description="alternative to steps: total training tokens")
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(3e-4, gt=0)
    min_lr: float = Field(0.0, ge=0)
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    seed: int = 0
    data: DataSpec = Field(default_factory=DataSpec)
    log_every: int = Field(1, ge=1)
    timeout_seconds: int = Field(600, ge=1, description="collective timeout after init; a hang ends the job after this")
    init_timeout_seconds: int = Field(900, ge=1, description="rendezvous / first collective timeout")
    deterministic: bool = False
    preflight: bool = True
    min_allreduce_fraction: float = Field(0.0, ge=0, le=1, description="fail preflight below this fraction of the network's expected bandwidth")

    @model_validator(mode="after")
    def _steps_or_tokens(self) -> "TrainingSpec":
        if self.steps is None and self.tokens is None:
            raise ValueError("set `steps` or `tokens`")
        if self.steps is not None and self.tokens is not None:
            raise ValueError("set only one of `steps` and `tokens`")
        return self


class CheckpointSpec(_Strict):
    dir: Optional[str] = Field(None, description="shared directory for checkpoints; {run_id} expands to the job's run id")
    every: Union[int, Literal["auto"]] = "auto"
    keep: int = Field(3, ge=1)
    async_: bool = Field(False, alias="async")
    export: Literal["none", "safetensors", "torch"] = "safetensors"

    @field_validator("every")
    @classmethod
    def _every(cls, v):
        if isinstance(v, int) and v < 1:
            raise ValueError("must be at least 1 step (or 'auto')")
        return v


class LocalTarget(_Strict):
    max_restarts: int = Field(3, ge=0)
    run_dir: str = "runs"


class SshSpec(_Strict):
    host: str
    user: Optional[str] = None
    port: int = Field(22, ge=1, le=65535)
    key_file: Optional[str] = None
    known_hosts: Optional[str] = None
    accept_unknown_host: bool = False
    remote_dir: str = "~/.dtlaunch/jobs"


class SlurmTarget(_Strict):
    partition: Optional[str] = None
    account: Optional[str] = None
    qos: Optional[str] = None
    time: str = Field("24:00:00", description="SLURM time limit, e.g. 24:00:00 or 2-00:00:00")
    cpus_per_task: Optional[int] = Field(None, ge=1)
    mem: Optional[str] = Field(None, description="e.g. 0 (all), 500G")
    constraint: Optional[str] = None
    exclusive: bool = True
    signal_seconds: int = Field(120, ge=1, description="send USR2 this long before the time limit")
    max_requeues: int = Field(5, ge=0)
    max_failures: int = Field(3, ge=0)
    max_restarts: int = Field(2, ge=0, description="torchrun restarts inside one allocation")
    submit: Literal["sbatch", "submitit"] = "sbatch"
    ssh: Optional[SshSpec] = None
    extra_sbatch: list[str] = Field(default_factory=list)
    setup: list[str] = Field(default_factory=list, description="shell lines run before training, e.g. module load")

    @field_validator("time", mode="before")
    @classmethod
    def _minutes(cls, v):
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v  # `time: 90` means 90 minutes

    @field_validator("time")
    @classmethod
    def _time(cls, v: str) -> str:
        if not re.fullmatch(r"(\d+-)?\d{1,3}(:\d{2}){0,2}", v):
            raise ValueError("use minutes, HH:MM:SS or D-HH:MM:SS, e.g. 24:00:00")
        return v


class SkyTarget(_Strict):
    infra: Optional[str] = Field(None, description="e.g. aws, gcp/us-central1, k8s")
    cloud: Optional[str] = None
    region: Optional[str] = None
    zone: Optional[str] = None
    spot: bool = False
    managed: bool = False
    disk_size: int = Field(512, ge=1)
    max_restarts_on_errors: int = Field(3, ge=0)
    max_restarts: int = Field(2, ge=0, description="torchrun restarts inside one launch")
    setup: list[str] = Field(default_factory=list)
    workdir: Optional[str] = None


class TargetsSpec(_Strict):
    default: Literal["local", "slurm", "sky"] = "local"
    local: LocalTarget = Field(default_factory=LocalTarget)
    slurm: SlurmTarget = Field(default_factory=SlurmTarget)
    sky: SkyTarget = Field(default_factory=SkyTarget)


class Recipe(_Strict):
    name: str
    model: ModelSpec
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec)
    resources: ResourcesSpec = Field(default_factory=ResourcesSpec)
    training: TrainingSpec
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec)
    targets: TargetsSpec = Field(default_factory=TargetsSpec)
    env: dict[str, str] = Field(default_factory=dict, description="plain environment variables for the job")
    secrets: list[str] = Field(default_factory=list, description="names of environment variables passed through; never values")

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
                out[k] = str(val).lower() if isinstance(val, bool) else str(val)
            return out
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
        """A scheduler-safe name derived from `name` (the recipe's name may hold anything)."""
        n = re.sub(r"[^A-Za-z0-9._-]+", "-", self.name).strip("-._") or "job"
        return n[:63]

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


# ----------------------------------------------------------------------------- loading


class _LineLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # libyaml when present: 5-10x faster
    """SafeLoader that remembers the line of every mapping key, by field path."""


def _compose_lines(node: yaml.Node, path: tuple, lines: dict[tuple, int]) -> None:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else str(k.value)
            lines[path + (key,)] = k.start_mark.line + 1
            _compose_lines(v, path + (key,), lines)
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            _compose_lines(v, path + (i,), lines)


def _suggest(word: str, choices) -> str:
    m = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {m[0]!r}?)" if m else ""


def _model_at(path: tuple) -> Optional[type[BaseModel]]:
    """The pydantic model that owns the mapping at `path`, for 'did you mean' on unknown keys."""
    model: Any = Recipe
    for part in path:
        if isinstance(part, int):
            return None
        field = model.model_fields.get(part) or next(
            (f for f in model.model_fields.values() if f.alias == part), None
        )
        if field is None:
            return None
        ann = field.annotation
        cands = [ann] + list(getattr(ann, "__args__", ()))
        nxt = next((c for c in cands if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if nxt is None:
            return None
        model = nxt
    return model


def _field_names(model: type[BaseModel]) -> list[str]:
    return [f.alias or n for n, f in model.model_fields.items()]


def _format_errors(err: ValidationError, source: str, lines: dict[tuple, int]) -> list[dict]:
    out = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and ("[" in p or p in ("function-after", "function-before"))))
        # pydantic puts union branch names ('int', "literal['auto']") into loc; drop them.
        loc = tuple(p for p in loc if not (isinstance(p, str) and p in ("int", "str", "float", "bool") or (isinstance(p, str) and p.startswith("literal["))))
        path = ".".join(str(p) for p in loc) or "(top level)"
        line = None
        for n in range(len(loc), -1, -1):
            if loc[:n] in lines:
                line = lines[loc[:n]]
                break
        typ = e["type"]
        msg = e["msg"]
        fix = None
        if typ == "extra_forbidden":
            owner = _model_at(loc[:-1])
            names = _field_names(owner) if owner else []
            msg = f"unknown key {loc[-1]!r}{_suggest(loc[-1], names)}"
            fix = "allowed keys here: " + ", ".join(names) if names else "remove it"
        elif typ == "missing":
            msg = "required field is missing"
            fix = f"add `{loc[-1]}:`" if loc else None
        elif typ.startswith("literal_error"):
            fix = "use one of the listed values"
        elif msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        elif "input" in e and typ.endswith("_type") or typ.endswith("_parsing"):
            msg = f"{msg} (got {e.get('input')!r})"
            fix = _TYPE_FIX.get(typ.split("_")[0])
        if fix is None:
            fix = f"see the `{loc[-1] if loc else 'recipe'}` entry of `dtlaunch schema` for what this field accepts"
        out.append({"file": source, "line": line, "field": path, "message": msg, "fix": fix})
    # Several union branches report the same field; keep the first message per field.
    seen, uniq = set(), []
    for o in out:
        if o["field"] not in seen:
            seen.add(o["field"])
            uniq.append(o)
    return uniq


_TYPE_FIX = {
    "int": "give a whole number, e.g. 8",
    "float": "give a number, e.g. 0.4",
    "bool": "give true or false",
    "string": "give a text value (quote it if it looks like a number)",
    "dict": "give a mapping of key: value lines",
    "model": "give a mapping of key: value lines",
    "list": "give a list, e.g. [A, B]",
    "tuple": "give a list of two numbers, e.g. [0.9, 0.95]",
}


def _set_path(data: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    cur = data
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[k] = nxt
        cur = nxt
    cur[keys[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """`training.steps=10` -> ("training.steps", 10); the value is read as YAML."""
    key, sep, raw = item.partition("=")
    if not sep or not key.strip():
        raise RecipeError([{"file": "--set", "line": None, "field": item, "message": "expected KEY=VALUE, e.g. training.steps=100", "fix": None}])
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_text(text: str, source: str = "<recipe>", overrides: Optional[list[str]] = None) -> Recipe:
    """Parse and validate a recipe, raising RecipeError (never a traceback) on any problem."""

    def fail(message: str, line: Optional[int] = None, fix: Optional[str] = None, field: str = "(file)"):
        raise RecipeError([{"file": source, "line": line, "field": field, "message": message, "fix": fix}])

    if "\x00" in text:
        fail("this is not a text YAML file (it contains NUL bytes)", fix="point dtlaunch at a recipe .yaml file")
    try:
        loader = _LineLoader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        fail(f"YAML syntax error: {problem}", mark.line + 1 if mark else None, "check indentation, colons and quotes on that line")
    except Exception as e:  # pragma: no cover - yaml raises odd errors on odd bytes
        fail(f"could not read YAML: {e}")
    if data is None:
        fail("the recipe is empty", 1, "start from recipes/tiny.yaml")
    if not isinstance(data, dict):
        fail(f"the recipe must be a mapping of sections (name, model, ...), got a {type(data).__name__}", 1,
             "start from recipes/tiny.yaml")
    for k in data:
        if not isinstance(k, str):
            fail(f"keys must be strings, got {k!r}", None)
    lines: dict[tuple, int] = {}
    if node is not None:
        _compose_lines(node, (), lines)
    for item in overrides or []:
        key, value = parse_override(item)
        _set_path(data, key, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_errors(e, source, lines)) from None
    except (ValueError, TypeError) as e:  # a validator raised outside pydantic's wrapping
        fail(str(e))


def load(path: str | Path, overrides: Optional[list[str]] = None) -> Recipe:
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)", "message": "file not found",
                            "fix": "check the path; shipped recipes live in recipes/"}]) from None
    except IsADirectoryError:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)", "message": "is a directory, not a recipe file",
                            "fix": "name a .yaml file"}]) from None
    except OSError as e:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)", "message": f"cannot read: {e.strerror}",
                            "fix": None}]) from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecipeError([{"file": str(p), "line": None, "field": "(file)",
                            "message": "not UTF-8 text (is this a binary file?)", "fix": "point dtlaunch at a recipe .yaml file"}]) from None
    return load_text(text, str(p), overrides)


def json_schema() -> dict:
    return Recipe.model_json_schema(by_alias=True)
