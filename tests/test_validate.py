"""Each validation rule fires on the sharp edge it names (for its target), stays quiet on the shipped
recipes, and every finding names the file and line of its field, or the --set item that gave it."""

import json

import pytest

from launcher.plan import make_plan
from launcher.recipe import load, load_text
from launcher.validate import RULES, has_errors, validate
from testpaths import RECIPES

BASE = """
name: v
model: {preset: tiny}
parallelism: {strategy: ddp, precision: bf16}
resources: {accelerator: "H100:8", nodes: 1}
training: {micro_batch: 1, global_batch: 8, steps: 100}
checkpoint: {dir: /ckpt}
"""


def findings(*overrides, target=None):
    r = load_text(BASE, "base.yaml", overrides=list(overrides))
    return {f.rule: f for f in validate(r, make_plan(r), target)}


def test_base_is_clean_on_every_target():
    for target in ("local", "slurm", "sky"):
        assert not has_errors(findings(target=target).values()), target


CASES = [
    (["parallelism.precision=fp16", "parallelism.loss_scaling=none"], "fp16-loss-scaling", None),
    (["model.preset=llama3-70b", "parallelism.strategy=ddp"], "does-not-fit", None),
    (["parallelism.data=3"], "layout-world-size", None),
    (["training.global_batch=12"], "batch-divisible", None),
    (["training.global_batch=4"], "batch-too-small", None),
    (
        [
            "parallelism.tensor=4",
            "parallelism.data=auto",
            "model.kv_heads=4",
            "model.heads=8",
            "model.hidden=128",
            "model.preset=null",
            "model.layers=2",
            "model.ffn_hidden=256",
            "model.vocab=256",
            "parallelism.tensor=16",
            "resources.nodes=2",
            "training.global_batch=16",
        ],
        "tp-across-nodes",
        None,
    ),
    (["parallelism.tensor=4"], "heads-tp", None),
    (["parallelism.offload=optimizer"], "offload-ddp", None),
    (["parallelism.strategy=zero2", "parallelism.offload=params"], "offload-params-stage", None),
    (
        [
            "model.preset=llama3-8b",
            "model.seq_len=32768",
            "parallelism.strategy=fsdp",
            "parallelism.activation_checkpointing=none",
        ],
        "long-seq-no-ac",
        None,
    ),
    (["resources.nodes=16", "model.seq_len=1024", "training.global_batch=128"], "tiny-batch-many-gpus", None),
    (
        ["resources.nodes=2", "checkpoint.dir=/tmp/ckpt/{run_id}", "training.global_batch=16"],
        "checkpoint-dir-multinode",
        "slurm",
    ),
    (["parallelism.precision=fp32"], "fp32-on-bf16-gpu", None),
    (["parallelism.precision=fp32"], "fp32-gqa-gpu", None),  # the tiny preset: 4 heads, 2 kv heads
    (
        [
            "model.preset=llama3-70b",
            "parallelism.strategy=fsdp",
            "resources.nodes=4",
            "training.global_batch=2048",
            "training.timeout_seconds=120",
        ],
        "step-longer-than-watchdog",
        None,
    ),
    (["targets.sky.infra=k8s", "targets.sky.disk_tier=high"], "sky-k8s-unsupported", "sky"),
    (["targets.sky.infra=k8s", "targets.sky.autodown=false"], "sky-k8s-unsupported", "sky"),
    (
        ["targets.sky.infra=k8s", "targets.sky.spot=true", "targets.sky.checkpoint_storage={bucket: 's3://b/c'}"],
        "sky-k8s-spot",
        "sky",
    ),
    (
        [
            "model.preset=llama3-70b",
            "parallelism.strategy=fsdp",
            "resources.nodes=2",
            "training.global_batch=64",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
            "targets.sky.disk_size=200",
        ],
        "sky-disk-checkpoint-cache",
        "sky",
    ),
    (
        ["parallelism.strategy=zero2", "parallelism.offload=optimizer", "training.optimizer=sgd"],
        "offload-torch-optimizer",
        None,
    ),
    (["checkpoint.async=true", "checkpoint.keep=1"], "async-keep", None),
    (["resources.accelerator=V100:8"], "bf16-unsupported", None),
    (["secrets=[WANDB_API_KEY]", "env={WANDB_API_KEY: abc}"], "secret-in-env", None),
    (["env={HF_TOKEN: abc}"], "secret-looking-env", None),
    (["checkpoint.every=500"], "no-checkpoint-before-end", None),
    (["parallelism.sequence_parallel=true"], "sequence-parallel-no-tp", None),
    (["parallelism.launcher=deepspeed"], "deepspeed-launcher-strategy", None),
    (["resources.mfu=0.9"], "mfu-optimistic", None),
    (
        ["resources.accelerator=cpu:2", "parallelism.strategy=zero2", "parallelism.precision=fp16"],
        "deepspeed-fp16-cpu",
        None,
    ),
    (
        ["parallelism.tensor=2", "parallelism.strategy=zero3", "parallelism.backend=deepspeed"],
        "deepspeed-model-parallel",
        None,
    ),
    (["parallelism.tensor=2", "model.tied_embeddings=true"], "tied-model-parallel", None),
    (["parallelism.tensor=2", "model.ffn_hidden=351"], "tp-shape", None),
    (["parallelism.pipeline=2", "training.global_batch=4"], "pipeline-schedule", None),
    (["parallelism.pipeline=2", "parallelism.precision=fp16"], "fp16-pipeline", None),
    (["parallelism.pipeline=2", "training.eval_every=5"], "eval-pipeline", None),
    (
        [
            "model={hf_config: {model_type: llama, hidden_size: 64, intermediate_size: 176, num_hidden_layers: 2, "
            "num_attention_heads: 4, num_key_value_heads: 2, vocab_size: 256}}",
            "parallelism.pipeline=2",
        ],
        "hf-model-parallel",
        None,
    ),
    (["parallelism.pipeline=8"], "pipeline-layers", None),
    (["parallelism.strategy=fsdp", "parallelism.offload=optimizer"], "fsdp-optimizer-offload", None),
    (["parallelism.strategy=ddp", "parallelism.grad_reduce=once_per_step"], "grad-reduce-ignored", None),
    (
        ["parallelism.strategy=fsdp", "parallelism.grad_reduce=once_per_step", "training.global_batch=8"],
        "grad-reduce-ignored",
        None,
    ),
    (["resources.nodes=2", "checkpoint.dir=ckpt/run", "training.global_batch=16"], "checkpoint-dir-relative", "slurm"),
    (["parallelism.strategy=hybrid"], "hybrid-single-node", None),
    (["parallelism.strategy=zero2"], "backend-strategy", None),
    (
        [
            "resources.accelerator=cpu:2",
            "resources.nodes=2",
            "training.global_batch=8",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
            "checkpoint.dir=null",
        ],
        "cpu-multi-node",
        "sky",
    ),
    (
        ["model.preset=llama3-70b", "parallelism.strategy=fsdp", "targets.slurm.signal_seconds=1"],
        "slurm-time-short",
        "slurm",
    ),
    (["training.data.source=file", "training.data.path=/nonexistent/tokens.bin"], "data-path", None),
    # runtime refusals, found before the queue
    (["training.steps=null"], "no-training-length", None),
    (["model.architecture=gpt"], "runtime-architecture", None),
    (["model={params: 1000000000}"], "runtime-shape", None),
    (["training.data.num_tokens=100"], "data-too-small", None),
    # SkyPilot
    (["resources.nodes=2", "training.global_batch=16"], "sky-checkpoint-storage", "sky"),
    (["targets.sky.managed=true"], "sky-checkpoint-storage", "sky"),
    (
        ["targets.sky.checkpoint_storage={bucket: 's3://b/c'}", "checkpoint.dir=/elsewhere/{run_id}"],
        "sky-checkpoint-dir-outside-storage",
        "sky",
    ),
    (
        [
            "resources.nodes=2",
            "training.global_batch=16",
            "targets.sky.infra=aws",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
            "checkpoint.dir=null",
        ],
        "sky-aws-efa-interfaces",
        "sky",
    ),
    (
        [
            "parallelism.strategy=zero2",
            "parallelism.launcher=deepspeed",
            "targets.sky.deepspeed_ssh=true",
            "env={X: '$(id)'}",
        ],
        "deepspeed-ssh-env",
        "sky",
    ),
    (
        [
            "parallelism.strategy=zero2",
            "parallelism.launcher=deepspeed",
            "targets.sky.deepspeed_ssh=true",
            "checkpoint.dir='/ckpt/$(id)/{run_id}'",
        ],
        "deepspeed-ssh-values",
        "sky",
    ),
    (
        [
            "parallelism.strategy=zero2",
            "parallelism.launcher=deepspeed",
            "targets.sky.deepspeed_ssh=true",
            "secrets=[HF_TOKEN]",
        ],
        "deepspeed-ssh-secrets",
        "sky",
    ),
    # SLURM
    (["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"], "deepspeed-launcher-target", "slurm"),
    (["parallelism.strategy=zero2", "parallelism.launcher=deepspeed"], "deepspeed-launcher-target", "local"),
    (["training.on_straggler=exit"], "straggler-exit-target", "local"),
    (
        [
            "training.on_straggler=exit",
            "targets.sky.managed=true",
            "targets.sky.checkpoint_storage={bucket: 's3://b/c'}",
            "checkpoint.dir=null",
        ],
        "sky-straggler-same-nodes",
        "sky",
    ),
    (["training.on_straggler=exit"], "sky-straggler-same-nodes", "sky"),  # unmanaged: nothing recovers it
    (['targets.slurm.extra_sbatch=["--nodes=4"]'], "slurm-extra-sbatch-plan", "slurm"),
    (["targets.slurm.exclusive=false"], "slurm-cpus", "slurm"),
    (["targets.slurm.submit=submitit", "targets.slurm.ssh={host: login.example}"], "slurm-submitit-ssh", "slurm"),
    (['targets.slurm.extra_sbatch=["--mem-per-gpu=10G"]'], "slurm-extra-sbatch-field", "slurm"),
    (["resources.accelerator=cpu:2", "targets.slurm.mem_per_gpu=10G"], "slurm-mem-per-gpu-without-gpus", "slurm"),
    (["resources.accelerator=cpu:2", "targets.slurm.cpus_per_gpu=2"], "slurm-cpus-per-gpu-without-gpus", "slurm"),
    (["resources.accelerator=cpu:2", "targets.slurm.gpu_type=a100"], "slurm-gpu-type-without-gpus", "slurm"),
    (["targets.slurm.gpu_request=gres", "targets.slurm.mem_per_gpu=80G"], "slurm-gres-per-gpu-options", "slurm"),
    (["targets.slurm.nodelist=gpu[1-2]"], "slurm-nodelist-count", "slurm"),
    (["targets.slurm.nodelist=gpu1", "targets.slurm.exclude=gpu[1-3]"], "slurm-nodelist-excluded", "slurm"),
    (["targets.slurm.mail_user=me@example.org"], "slurm-mail-user-no-type", "slurm"),
    (["resources.image=nvcr.io/nvidia/pytorch:24.05-py3"], "slurm-image-no-container", "slurm"),
    (["targets.slurm.container={runtime: pyxis}"], "slurm-container-no-image", "slurm"),
    (
        [
            "resources.image=org/train:1",
            "targets.slurm.container={runtime: apptainer}",
            "checkpoint.dir=/my ckpt/{run_id}",
        ],
        "slurm-container-checkpoint-mount",
        "slurm",
    ),
    (
        [
            "resources.image=org/train:1",
            "targets.slurm.container={runtime: pyxis}",
            "training.data.source=file",
            "training.data.path=/datasets/tokens.bin",
        ],
        "slurm-container-input-unmounted",
        "slurm",
    ),
    (
        ["resources.nodes=2", "training.data.source=file", "training.data.path=/tmp/tokens.bin"],
        "slurm-input-node-local",
        "slurm",
    ),
    (["training.data.source=file", "training.data.path=/home/me/tokens.bin"], "sky-input-unmounted", "sky"),
    (["resources.image=org/train:1"], "image-local", "local"),
    # SkyPilot knobs
    (["targets.sky.accelerators=[V100:8]"], "sky-fallback-dropped", "sky"),
    (
        ["targets.sky.instance_type=p5.48xlarge", "targets.sky.accelerators=[A100-80GB:8]"],
        "sky-instance-type-fallbacks",
        "sky",
    ),
    (["resources.accelerator=cpu:4", "targets.sky.cpus=2"], "sky-cpus-fewer-than-ranks", "sky"),
    # the user's entrypoint
    (["entrypoint={script: no_such_train.py, workdir: /}"], "entrypoint-missing", None),
]


@pytest.mark.parametrize("overrides,rule,target", CASES, ids=[f"{c[1]}-{c[2] or 'any'}" for c in CASES])
def test_rule_fires(overrides, rule, target):
    f = findings(*overrides, target=target)
    assert rule in f, f"{rule} did not fire; got {sorted(f)}"
    assert f[rule].message and f[rule].fix


def test_every_rule_has_a_firing_case():
    assert {r.id for r in RULES} == {c[1] for c in CASES}


def test_target_rules_stay_out_of_other_targets():
    ov = ["resources.nodes=2", "training.global_batch=16"]
    assert "sky-checkpoint-storage" in findings(*ov, target="sky")
    assert "sky-checkpoint-storage" not in findings(*ov, target="slurm")
    assert "slurm-cpus" not in findings("targets.slurm.exclusive=false", target="sky")


def test_findings_name_the_line_or_the_set_item():
    r = load_text(BASE.replace("global_batch: 8", "global_batch: 12"), "base.yaml")
    (f,) = [f for f in validate(r, make_plan(r)) if f.rule == "batch-divisible"]
    assert (f.file, f.line) == (
        "base.yaml",
        BASE.splitlines().index("training: {micro_batch: 1, global_batch: 8, steps: 100}") + 1,
    )
    f = findings("training.global_batch=12")["batch-divisible"]
    assert (f.file, f.line) == ("--set training.global_batch=12", None)


@pytest.mark.parametrize("path", sorted(RECIPES.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_recipes_have_no_errors_on_their_target(path):
    r = load(path)
    errs = [f for f in validate(r, make_plan(r)) if f.severity == "error"]
    assert not errs, errs


def test_validate_cli_exit_codes_json_and_lines(run_cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("global_batch: 8", "global_batch: 12"))
    tiny = str(RECIPES / "tiny.yaml")
    code, out, _ = run_cli("validate", tiny, str(bad), "--format", "json")
    assert code == 1
    res = {r["file"]: r for r in json.loads(out)}
    assert res[tiny]["ok"] and not res[str(bad)]["ok"]
    (f,) = [f for f in res[str(bad)]["findings"] if f["rule"] == "batch-divisible"]
    assert f["line"] == 6 and f["file"] == str(bad)
    code, out, _ = run_cli("validate", str(bad))
    assert code == 1 and f"{bad}:6: error [batch-divisible]" in out
    code, out, _ = run_cli("validate", tiny)
    assert code == 0 and "ok" in out
    code, out, _ = run_cli(
        "validate", "-t", "sky", tiny, "--set", "resources.nodes=2", "--set", "resources.accelerator=cpu:1"
    )
    assert code == 1 and "tiny.yaml:28: error [sky-checkpoint-storage]" in out


def test_a_vocabulary_smaller_than_the_tensor_degree_is_a_located_error_not_a_crash(run_cli):
    code, out, err = run_cli("validate", RECIPES / "llama3-405b.yaml", "--set", "model.vocab=1")
    assert code == 1 and "internal error" not in out + err, out + err
    # the runtime splits the vocabulary evenly over the tensor-parallel ranks: the tp-shape rule says so
    assert "llama3-405b.yaml:10: error [tp-shape] parallelism.tensor: tensor 8 does not divide vocab 1" in out, out
    # planning alone (the user's own entrypoint runs it) gives a plan, with a loss chunk of a fraction of a column
    r = load(RECIPES / "llama3-405b.yaml", ["model.vocab=1"])
    p = make_plan(r)
    assert p.layout.tp > 1 and p.memory.total > 0
