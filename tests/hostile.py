"""Hostile recipes and overrides, generated: what a typo, a bad merge or an attacker hands the CLI.

`cases(n, seed)` yields (id, files, argv-tail) triples: a recipe text (or a special file) plus `--set`
overrides. Used by tests/test_hostile.py, which runs each through validate, plan and every render in a
process with a memory limit and a per-command time limit.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import yaml

BASE = {
    "name": "tiny",
    "model": {"preset": "tiny"},
    "parallelism": {"strategy": "fsdp", "precision": "fp32", "activation_checkpointing": "none", "offload": "none"},
    "resources": {"accelerator": "cpu:2", "nodes": 1, "network": "loopback"},
    "training": {
        "micro_batch": 4,
        "global_batch": 16,
        "steps": 40,
        "lr": 3.0e-3,
        "data": {"source": "synthetic", "num_tokens": 200000},
    },
    "checkpoint": {"every": 10, "keep": 2},
    "targets": {"default": "local"},
}

FIELDS = [
    "name",
    "run_id",
    "model.preset",
    "model.layers",
    "model.hidden",
    "model.heads",
    "model.kv_heads",
    "model.vocab",
    "model.params",
    "model.seq_len",
    "model.rope_theta",
    "model.architecture",
    "parallelism.strategy",
    "parallelism.tensor",
    "parallelism.pipeline",
    "parallelism.data",
    "parallelism.grad_accum",
    "resources.accelerator",
    "resources.nodes",
    "resources.gpu_memory_gb",
    "resources.peak_tflops",
    "resources.usd_per_gpu_hour",
    "resources.mfu",
    "resources.storage_gbps_per_node",
    "resources.gpu_mtbf_hours",
    "resources.network",
    "resources.socket_ifname",
    "training.steps",
    "training.tokens",
    "training.lr",
    "training.betas",
    "training.seed",
    "training.micro_batch",
    "training.global_batch",
    "training.timeout_seconds",
    "training.data.num_tokens",
    "training.data.path",
    "checkpoint.dir",
    "checkpoint.every",
    "checkpoint.keep",
    "checkpoint.grace_seconds",
    "targets.slurm.partition",
    "targets.slurm.time",
    "targets.slurm.mem",
    "targets.slurm.extra_sbatch",
    "targets.slurm.setup",
    "targets.slurm.signal_seconds",
    "targets.sky.infra",
    "targets.sky.workdir",
    "targets.sky.checkpoint_storage",
    "targets.sky.disk_size",
    "env",
    "secrets",
    "env.HOSTILE",
    "resources.image",
    "targets.slurm.mem_per_gpu",
    "targets.slurm.cpus_per_gpu",
    "targets.slurm.gpu_request",
    "targets.slurm.gpu_type",
    "targets.slurm.nodelist",
    "targets.slurm.exclude",
    "targets.slurm.reservation",
    "targets.slurm.dependency",
    "targets.slurm.mail_type",
    "targets.slurm.mail_user",
    "targets.slurm.container",
    "targets.slurm.container.mounts",
    "targets.slurm.container.image",
    "targets.sky.accelerators",
    "targets.sky.fallback",
    "targets.sky.instance_type",
    "targets.sky.cpus",
    "targets.sky.memory",
    "targets.sky.ports",
    "targets.sky.disk_tier",
]


def _values(r: random.Random) -> list:
    shell = ["$(touch /tmp/pwned)", "`id`", "; rm -rf /", "'\"", "a\nb", "a\rb", "#SBATCH --uid=0", "\\", "x\x00y"]
    unicode = ["模型训练", "🚀🚀", "..", ".", "", " ", "\u202e", "ｆｕｌｌ", "H100:８", "H100:²", " H100 : 8 ", "H100:"]
    numbers = [
        0,
        -1,
        1,
        2**31,
        2**63,
        10**400,
        -(10**400),
        float("inf"),
        float("-inf"),
        float("nan"),
        1e-300,
        1e300,
        0.5,
        True,
        False,
        None,
    ]
    shapes = [[], {}, [[[]]], {"a": {"b": {}}}, [1, "x", None], "x" * r.choice([1, 100, 70_000])]
    return shell + unicode + numbers + shapes


def _set(d: dict, path: str, value) -> None:
    keys = path.split(".")
    cur = d
    for k in keys[:-1]:
        nxt = cur.get(k)
        if not isinstance(nxt, dict):
            nxt = cur[k] = {}
        cur = nxt
    cur[keys[-1]] = value


def _dump(d) -> str:
    return yaml.safe_dump(d, sort_keys=False, allow_unicode=True, width=10**9)


def _field_case(r: random.Random) -> tuple[str, str]:
    d = yaml.safe_load(_dump(BASE))
    path = r.choice(FIELDS)
    value = r.choice(_values(r))
    _set(d, path, value)
    return f"field:{path}", _dump(d)


def _alias_bomb(levels: int, width: int) -> str:
    lines = ["a: &a [" + ", ".join(["lol"] * width) + "]"]
    prev = "a"
    for i in range(1, levels):
        name = chr(ord("a") + i)
        lines.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * width) + "]")
        prev = name
    return "\n".join(lines) + f"\nname: *{prev}\n"


def _raw_case(r: random.Random) -> tuple[str, str]:
    base = _dump(BASE)
    makers = {
        "bomb": lambda: _alias_bomb(r.randint(3, 9), r.randint(3, 9)),
        "deep-flow": lambda: (lambda n: base + "env: " + "[" * n + "]" * n + "\n")(
            r.choice([40, 1000, 100_000, 300_000])
        ),
        "deep-block": lambda: (lambda n: base + "".join("  " * i + f"k{i}:\n" for i in range(n)) + "  " * n + "v: 1\n")(
            r.choice([40, 500, 5000])
        ),
        "dup": lambda: base + f"training:\n  steps: {r.randint(1, 10**6)}\n",
        "unknown-many": lambda: (
            lambda n: base + "model:\n  preset: tiny\n" + "".join(f"  k{i}: {i}\n" for i in range(n))
        )(r.choice([30, 3000, 30_000])),
        "recursive": lambda: base.replace("secrets", "x") + "secrets: &r [*r]\n",
        "merge": lambda: "defaults: &d {steps: 5}\n" + base.replace("training:\n", "training:\n  <<: *d\n", 1),
        "tabs": lambda: base.replace("  ", "\t"),
        "scalar-top": lambda: r.choice(["42", "'just a string'", "null", "~", ".inf"]),
        "list-top": lambda: "- a\n- b\n",
        "huge-scalar": lambda: base.replace("name: tiny", "name: " + "x" * r.choice([1000, 900_000])),
        "bad-utf8-ish": lambda: base + "name: \udcff\n".encode("utf-8", "surrogateescape").decode("utf-8", "replace"),
        "keys-not-text": lambda: base + "? [a, b]\n: 1\n1: 2\n",
        "bom": lambda: "\ufeff" + base,
    }
    kind = r.choice(list(makers))
    return kind, makers[kind]()


def _override_case(r: random.Random) -> tuple[str, list[str]]:
    path = r.choice(FIELDS + ["nonexistent.path", "model.preset.x", "", ".", "a..b", "training"])
    raw = r.choice(
        [
            "",
            "null",
            ".inf",
            ".nan",
            "[" * 5000 + "]" * 5000,
            "1e999",
            "9" * 500,
            "true",
            "{a: [1, {b: *x}]}",
            "$(id)",
            "H100:８",
            "x" * 70_000,
            "&a [*a]",
            "'unclosed",
        ]
    )
    sep = r.choice(["=", "=", "=", ""])
    return f"set:{path}", [f"{path}{sep}{raw}"]


SPECIAL_FILES = ["/dev/zero", "/dev/null", "<dir>", "<fifo>", "<symlink-loop>", "<big>", "<missing>", "<binary>"]


def cases(n: int, seed: int = 20261123) -> Iterator[tuple[str, dict, list[str]]]:
    """(case id, {"recipe": text} or {"special": kind}, overrides)."""
    r = random.Random(seed)
    for kind in SPECIAL_FILES:
        yield f"file:{kind}", {"special": kind}, []
    for i in range(n - len(SPECIAL_FILES)):
        roll = r.random()
        if roll < 0.45:
            cid, text = _field_case(r)
            yield f"{i}:{cid}", {"recipe": text}, []
        elif roll < 0.75:
            cid, text = _raw_case(r)
            yield f"{i}:raw:{cid}", {"recipe": text}, []
        else:
            cid, ov = _override_case(r)
            yield f"{i}:{cid}", {"recipe": _dump(BASE)}, ov
