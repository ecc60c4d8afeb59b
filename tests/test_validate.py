"""Each validation rule fires on the sharp edge it names, and stays quiet on the shipped recipes."""
import pytest

from launcher.plan import make_plan
from launcher.recipe import load, load_text
from launcher.validate import has_errors, validate

BASE = """
name: v
model: {preset: tiny}
parallelism: {strategy: ddp, precision: bf16}
resources: {accelerator: "H100:8", nodes: 1}
training: {micro_batch: 1, global_batch: 8, steps: 100}
checkpoint: {dir: /ckpt}
"""


def findings(*overrides):
    r = load_text(BASE, overrides=list(overrides))
    return {f.rule: f for f in validate(r, make_plan(r))}


def test_base_is_clean():
    assert not has_errors(findings().values())


@pytest.mark.parametrize("overrides,rule", [
    (["parallelism.precision=fp16", "parallelism.loss_scaling=none"], "fp16-loss-scaling"),
    (["model.preset=llama3-70b", "parallelism.strategy=ddp"], "does-not-fit"),
    (["parallelism.data=3"], "layout-world-size"),
    (["training.global_batch=12"], "batch-divisible"),
    (["training.global_batch=4"], "batch-too-small"),
    (["parallelism.tensor=3", "parallelism.data=auto"], "heads-tp"),
    (["parallelism.offload=optimizer"], "offload-ddp"),
    (["parallelism.strategy=zero2", "parallelism.offload=params"], "offload-params-stage"),
    (["model.preset=llama3-8b", "model.seq_len=32768", "parallelism.strategy=fsdp",
      "parallelism.activation_checkpointing=none"], "long-seq-no-ac"),
    (["resources.nodes=16", "model.seq_len=1024"], "tiny-batch-many-gpus"),
    (["resources.nodes=2", "checkpoint.dir=null", "training.global_batch=16"], "checkpoint-dir-multinode"),
    (["parallelism.precision=fp32"], "fp32-on-bf16-gpu"),
    (["checkpoint.async=true", "checkpoint.keep=1"], "async-keep"),
    (["resources.accelerator=V100:8"], "bf16-unsupported"),
    (["secrets=[WANDB_API_KEY]", "env={WANDB_API_KEY: abc}"], "secret-in-env"),
    (["env={HF_TOKEN: abc}"], "secret-looking-env"),
    (["checkpoint.every=500"], "no-checkpoint-before-end"),
    (["parallelism.sequence_parallel=true"], "sequence-parallel-no-tp"),
    (["parallelism.launcher=deepspeed"], "deepspeed-launcher-strategy"),
    (["resources.mfu=0.9"], "mfu-optimistic"),
    (["resources.accelerator=cpu:2", "parallelism.strategy=zero2", "parallelism.precision=fp16"], "deepspeed-fp16-cpu"),
    (["parallelism.tensor=2"], "runtime-tp-pp"),
    (["parallelism.tensor=16", "resources.nodes=2", "training.global_batch=16"], "tp-across-nodes"),
    (["parallelism.pipeline=8"], "pipeline-layers"),
    (["parallelism.strategy=fsdp", "parallelism.offload=optimizer"], "fsdp-optimizer-offload"),
    (["resources.nodes=2", "checkpoint.dir=ckpt/run", "training.global_batch=16"], "checkpoint-dir-relative"),
    (["parallelism.strategy=hybrid"], "hybrid-single-node"),
    (["parallelism.strategy=zero2"], "backend-strategy"),
    (["resources.accelerator=cpu:2", "resources.nodes=2", "targets.default=sky"], "cpu-multi-node"),
    (["model.preset=llama3-70b", "parallelism.strategy=fsdp", "targets.slurm.signal_seconds=1"], "slurm-time-short"),
    (["training.data.source=file", "training.data.path=/nonexistent/tokens.bin"], "data-path"),
])
def test_rule_fires(overrides, rule):
    f = findings(*overrides)
    assert rule in f, f"{rule} did not fire; got {sorted(f)}"
    assert f[rule].message and f[rule].fix


def test_shipped_recipes_have_no_errors():
    import glob

    for path in glob.glob("recipes/*.yaml"):
        r = load(path)
        errs = [f for f in validate(r, make_plan(r)) if f.severity == "error"]
        assert not errs, (path, errs)


def test_validate_cli_exit_codes_and_json(run_cli, tmp_path):
    import json

    bad = tmp_path / "bad.yaml"
    bad.write_text(BASE.replace("global_batch: 8", "global_batch: 12"))
    code, out, _ = run_cli("validate", "recipes/tiny.yaml", str(bad), "--format", "json")
    assert code == 1
    res = {r["file"]: r for r in json.loads(out)}
    assert res["recipes/tiny.yaml"]["ok"] and not res[str(bad)]["ok"]
    assert any(f["rule"] == "batch-divisible" for f in res[str(bad)]["findings"])
    code, out, _ = run_cli("validate", "recipes/tiny.yaml")
    assert code == 0 and "ok" in out
