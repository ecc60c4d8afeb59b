"""Tensor, sequence and pipeline parallel layouts train for real on gloo ranks under torchrun, and their
losses are the single-rank run's: tp=2, pp=2 (1F1B), tp=2 x dp=2, pp=2 x dp=2 (interleaved 1F1B, ddp's
replicated FSDP2), tp=2 x pp=2 (sequence parallel), on 8 ranks tp=2 x pp=2 x dp=2 and tp=2 x HSDP (2 x 2),
and a Hugging Face Llama with biases at tp=2 (the layout the planner picks for recipes/llama3-405b.yaml trains at
its own tensor degree in tests/test_rehearse.py, through `dtlaunch rehearse`). A run resumes across
layout changes, tp2 x pp2 -> dp4 -> tp2 x dp2, with the loss continuing as the uninterrupted single-rank run's.
Every rank's parameter and optimizer bytes, read off the wrapped model, are the planner's for that rank.

Equality: the same tiny model, data and fp32 arithmetic, deterministic kernels, grad_clip 1.0 (the norms exceed
it from the first step, so clipping is active) and grad_accum 4 (2 with dp=2): what differs between layouts is
the order of floating-point sums (a split matmul, an all-reduce, a reduce-scatter). Those differences are ~1e-7
relative per operation and reach ~1e-6 on the loss within the first steps; TOL = 1e-5 leaves a 10x margin and is
still far below any real change (a mis-scaled gradient, a micro-batch counted twice or a skipped clip moves the
loss by >1e-3 by the second step). Fresh layouts are compared over their first 4 steps: AdamW amplifies
rounding in its normalised update, so longer comparisons measure chaos, not the layout. (Runs of 4 steps and of
12 see the same learning rates in steps 1-3, so their first 4 losses are comparable.)

Cost: four torchrun worlds (1, 2, 4 and 8 ranks) with several cases each (layout_train.py), about 2 minutes
on 2 cores.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path

import pytest

from launcher.jobenv import ExitCode
from launcher.plan.parts import part_of, rank_params
from launcher.plan.states import model_states
from launcher.runtime.checkpoint import disk
from rt_harness import (
    TORCHRUN,
    deep_merge,
    free_port,
    kill_tree,
    recipe_dict,
    torchrun_env,
    write_plan,
)

TOL = 1e-5  # loss, absolute (see the module docstring)
GRAD_RTOL = 1e-4  # gradient norms in the first steps, relative (~1e-5 seen: ~800k fp32 squares summed in another order)
# gradient norms after a resume (steps 5-12): by then AdamW has turned rounding differences into ~1e-6 relative
# differences of the weights, which move the norm by up to ~1e-4 (1.1e-4 seen) while the loss stays within TOL
GRAD_RTOL_LATER = 1e-3
FIRST = 4  # steps compared for a fresh layout
STEPS = 12  # the resume chain and the reference
HF_MODEL = "llama-tiny-biases"
TIMEOUT_S = 45  # training.timeout_seconds of every case (init_timeout_seconds: 60)  # q/k/v and MLP biases: column-wise biases split, row-wise ones whole


def base(accelerator: str, strategy: str, tp: int = 1, pp: int = 1, steps: int = FIRST, **parallelism) -> dict:
    return recipe_dict(
        parallelism={"strategy": strategy, "tensor": tp, "pipeline": pp, **parallelism},
        resources={"accelerator": accelerator},
        training={
            "deterministic": True,
            "steps": steps,
            "grad_clip": 1.0,
            "preflight": False,
            "timeout_seconds": TIMEOUT_S,
            "init_timeout_seconds": 60,
        },
        checkpoint={"every": 100, "export": "none"},
    )


def resume_chain(accelerator: str, strategy: str, tp: int, pp: int, shared: Path, **parallelism) -> dict:
    return deep_merge(base(accelerator, strategy, tp, pp, STEPS, **parallelism), {"checkpoint": {"dir": str(shared)}})


def preempt_at(step: int) -> dict:
    return {"DTLAUNCH_FAULT": f"signal:rank=0:step={step}:sig=USR2"}


def hf_recipe(model: Path, accelerator: str, tp: int) -> dict:
    rec = base(accelerator, "fsdp", tp)
    rec["model"] = {"hf": str(model)}
    return deep_merge(rec, {"training": {"micro_batch": 2, "global_batch": 8}})


def worlds_cases(root: Path) -> dict[int, list[tuple[str, dict, dict, int]]]:
    """nproc -> [(name, recipe, env, expected exit code)], run in order in one world each."""
    from test_rt_hf import model_dir

    hf = model_dir(root / "models", HF_MODEL, seed=123)
    shared = root / "shared-checkpoints"
    return {
        1: [("ref", base("cpu:1", "ddp", steps=STEPS), {}, 0), ("hf-ref", hf_recipe(hf, "cpu:1", 1), {}, 0)],
        2: [
            ("tp2", base("cpu:2", "fsdp", 2, sequence_parallel=True), {}, 0),
            ("pp2", base("cpu:2", "fsdp", 1, 2), {}, 0),
            ("hf-tp2", hf_recipe(hf, "cpu:2", 2), {}, 0),
            # fp16 with ShardedGradScaler on 2-D (dp x tp) DTensor gradients; the micro preset: fp16 is slow on CPU
            (
                "tp2-fp16",
                deep_merge(
                    base("cpu:2", "fsdp", 2, precision="fp16", loss_scaling="dynamic"),
                    {"model": {"preset": "micro", "seq_len": 64}},
                ),
                {},
                0,
            ),
        ],
        4: [
            ("tp2xdp2", base("cpu:4", "fsdp_grad_op", 2), {}, 0),
            ("pp2xdp2", base("cpu:4", "ddp", 1, 2, pipeline_schedule="interleaved_1f1b"), {}, 0),
            (
                "tp2xpp2",
                resume_chain("cpu:4", "fsdp", 2, 2, shared, sequence_parallel=True),
                preempt_at(FIRST),
                ExitCode.PREEMPTED,
            ),
            ("dp4", resume_chain("cpu:4", "fsdp", 1, 1, shared), preempt_at(2 * FIRST), ExitCode.PREEMPTED),
            ("tp2xdp2-resumed", resume_chain("cpu:4", "fsdp", 2, 1, shared), {}, 0),
        ],
        # 3D: 8 ranks on 2 cores is slow but works (~25 s a case)
        8: [
            ("tp2xpp2xdp2", base("cpu:8", "fsdp", 2, 2, sequence_parallel=True), {}, 0),
            # two "nodes" of 4: hybrid shards inside a node (2 ranks after tp 2), replicates across: HSDP x TP
            ("tp2xhsdp", deep_merge(base("cpu:4", "hybrid", 2), {"resources": {"nodes": 2}}), {}, 0),
        ],
    }


def run_world(root: Path, nproc: int, cases: list) -> tuple[dict[str, Path], str]:
    dirs, spec = {}, []
    for name, rec, env, expect in cases:
        d = root / name
        spec.append({"plan": str(write_plan(d, rec)), "run_dir": str(d), "env": env, "expect": int(expect)})
        dirs[name] = d
    cases_file = root / f"cases-{nproc}.json"
    cases_file.write_text(json.dumps(spec))
    cmd = [
        TORCHRUN,
        f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--max-restarts=0",
        str(Path(__file__).with_name("layout_train.py")),
        str(cases_file),
    ]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=torchrun_env())
    try:
        out, err = proc.communicate(timeout=420)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        out, err = proc.communicate()
    (root / f"torchrun-{nproc}.log").write_text(out + "\n----- stderr -----\n" + err)
    print(f"\n{nproc}-rank world: {len(cases)} cases, {time.monotonic() - t0:.1f}s, rc {proc.returncode}")
    return dirs, out + err


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    dirs, logs = {}, {}
    for nproc, cases in worlds_cases(root).items():
        d, log = run_world(root, nproc, cases)
        dirs.update(d)
        logs[nproc] = log
    return dirs, logs


def result(runs, name: str) -> tuple[Path, dict[int, dict]]:
    """The case's run directory and its logged steps; fails with the world's log if it did not run."""
    dirs, logs = runs
    d = dirs[name]
    r = d / "result-rank0.json"
    assert r.exists(), f"{name} did not run (its world died earlier):\n" + "\n".join(v[-3000:] for v in logs.values())
    res = json.loads(r.read_text())
    assert res["error"] is None, res["error"]
    rows = [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines() if line.strip()]
    # this case's own attempt: a case resumed from the shared checkpoints starts from the records kept there
    starts = [i for i, m in enumerate(rows) if m.get("event") == "start"]
    return d, {m["step"]: m for m in rows[starts[-1] if starts else 0 :] if "loss" in m}


def compare(runs, name: str, ref: str, steps, grad_rtol: float = GRAD_RTOL) -> float:
    """Max |loss - reference loss| over `steps`; asserts the losses and the clipped gradient norms agree."""
    _, mine = result(runs, name)
    _, theirs = result(runs, ref)
    worst = 0.0
    for s in steps:
        diff = abs(mine[s]["loss"] - theirs[s]["loss"])
        worst = max(worst, diff)
        assert diff < TOL, (name, s, mine[s]["loss"], theirs[s]["loss"])
        assert mine[s]["grad_norm"] == pytest.approx(theirs[s]["grad_norm"], rel=grad_rtol), (name, s)
    print(f"\n{name:16s} steps {steps.start}-{steps.stop - 1}: max |loss - single rank| = {worst:.2e}")
    return worst


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2", "pp2", "tp2xdp2", "pp2xdp2", "tp2xpp2", "tp2xpp2xdp2", "tp2xhsdp"])
def test_layout_losses_equal_the_single_rank_run(runs, name):
    """Built on the meta device and materialised shard by shard (interleaved: chunk by chunk), every layout
    starts from the eager single-rank model's weights: a wrong or duplicated shard, a stage drawing another
    stage's numbers, or a rotary table left unmaterialised would move the first step's loss by far more
    than TOL."""
    compare(runs, name, "ref", range(1, FIRST + 1))
    assert result(runs, name)[1][1]["grad_norm"] > 1.0  # clipping was active
    d, _ = result(runs, name)
    start = [m for m in map(json.loads, (d / "metrics.jsonl").read_text().splitlines()) if m.get("event") == "start"]
    assert start[0]["init"] == "meta", start
    ref_start = [
        m
        for m in map(json.loads, (result(runs, "ref")[0] / "metrics.jsonl").read_text().splitlines())
        if m.get("event") == "start"
    ]
    assert ref_start[0]["init"] == "eager"


@pytest.mark.slow
def test_hf_llama_with_biases_trains_tensor_parallel_like_one_rank(runs):
    compare(runs, "hf-tp2", "hf-ref", range(1, FIRST + 1))


@pytest.mark.slow
def test_fp16_tensor_parallel_trains_with_loss_scaling(runs):
    _, rows = result(runs, "tp2-fp16")
    assert sorted(rows) == list(range(1, FIRST + 1))
    assert all(math.isfinite(r["loss"]) and r.get("loss_scale") for r in rows.values())
    assert rows[FIRST]["loss"] < rows[1]["loss"]


@pytest.mark.slow
def test_resume_across_layout_changes_continues_the_loss(runs):
    """tp2 x pp2 (preempted at step 4) -> dp4 (preempted at 8) -> tp2 x dp2 (to 12), one checkpoint directory:
    each resume reshards the last checkpoint into the new layout and the loss goes on as the uninterrupted
    single-rank run's, to the same tolerance."""
    d, first = result(runs, "tp2xpp2")
    assert sorted(first) == list(range(1, FIRST + 1))
    shared = d.parent / "shared-checkpoints"
    meta = disk.read_meta(disk.step_path(shared, FIRST))
    assert meta["layout"] == {
        "strategy": "fsdp",
        "dp": 1,
        "tp": 2,
        "pp": 2,
        "shard": 1,
        "sequence_parallel": True,
        "pp_schedule": "1f1b",
    }
    compare(runs, "tp2xpp2", "ref", range(1, FIRST + 1))
    for name, start, stop, before, after in (
        ("dp4", FIRST, 2 * FIRST, "fsdp dp1 tp2 pp2", "fsdp dp4 tp1 pp1"),
        ("tp2xdp2-resumed", 2 * FIRST, STEPS, "fsdp dp4 tp1 pp1", "fsdp dp2 tp2 pp1"),
    ):
        d, rows = result(runs, name)
        resume = [
            m
            for m in (json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines())
            if m.get("event") == "resume"
        ]
        assert resume and resume[-1]["step"] == start, resume  # this case's (the earlier ones' are kept too)
        assert any(w.startswith(f"layout {before}") and f"-> {after}" in w for w in resume[-1]["warnings"]), resume
        assert sorted(rows) == list(range(start + 1, stop + 1))
        compare(runs, name, "ref", range(start + 1, stop + 1), GRAD_RTOL_LATER)
    assert disk.read_meta(disk.step_path(shared, 2 * FIRST))["layout"]["dp"] == 4


BYTES_CASES = [
    "tp2",
    "pp2",
    "hf-tp2",
    "tp2xdp2",
    "pp2xdp2",
    "dp4",
    "tp2xdp2-resumed",
    "tp2xpp2xdp2",
    "tp2xhsdp",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", BYTES_CASES)
def test_every_ranks_states_are_the_planners(runs, name):
    """Per rank, the bytes of the parameters and of AdamW's two moments that the wrapped model really holds
    (DTensor local shards: tensor-parallel splits, pipeline stages, FSDP2 shards) equal the planner's figures
    for that rank's pipeline position (`parts.rank_params`, `states.model_states`, as `memory.breakdown` sizes
    a rank), exactly."""
    d, _ = result(runs, name)
    from launcher import planfile

    recipe, plan, _ = planfile.read(d / "plan.json")
    shape = recipe.model.shape()
    ranks = sorted(d.glob("rank-*.json"))
    assert len(ranks) == plan.world_size
    rows = []
    for f in ranks:
        held = json.loads(f.read_text())
        pp_rank = held["coords"][0]
        lay = plan.layout
        params, _, optim = model_states(
            rank_params(shape, "llama", plan.params, lay, part_of(shape, lay, pp_rank)), lay
        )
        rows.append((held["rank"], held["coords"], held["params"], params, held["optim"], optim))
        assert held["params"] == pytest.approx(params, rel=1e-12), (name, held)
        assert held["optim"] == pytest.approx(optim, rel=1e-12), (name, held)
    print(f"\n{name}: " + "; ".join(f"rank {r} {tuple(c)}: params {p} B, optimizer {o} B" for r, c, p, _, o, _ in rows))


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tp2xpp2xdp2", "tp2xhsdp", "pp2xdp2", "tp2xdp2"])
def test_every_training_group_gets_the_training_timeout(runs, name):
    """Once the first step is done, every process group of every rank (the world, each mesh dimension's, FSDP2's,
    the step agreement's) times out after training.timeout_seconds; only the checkpoint group keeps the long
    start-up timeout (a big save may take minutes). Sub-groups kept the backend's default (gloo 30 min, NCCL
    10 min) before: a stuck rank in a tensor- or pipeline-parallel collective went unnoticed for that long."""
    d, _ = result(runs, name)
    for f in sorted(d.glob("rank-*.json")):
        held = json.loads(f.read_text())
        timeouts = dict(held["timeouts"])
        assert timeouts.pop(held["checkpoint_group"]) == 60
        assert len(timeouts) >= 3, timeouts  # the world, the agreement's group, the mesh's
        assert set(timeouts.values()) == {TIMEOUT_S}, (name, held["rank"], timeouts)


@pytest.mark.slow
def test_the_runs_print_none_of_the_third_party_warnings_the_runtime_quiets(runs):
    """Warnings torch raises for what the runtime does on purpose, each shown safe where it is filtered
    (engines/mesh.py): FSDP2's view-tensor warning for the tensor-parallel embedding, DTensor's implicit
    replication of the fp16 sharded scaler's flag, DDP's deprecated broadcast_buffers."""
    _, logs = runs
    quieted = ("returned a view tensor", "Found a non-scalar tensor with numel=1", "`broadcast_buffers` is deprecated")
    for nproc, log in logs.items():
        for text in quieted:
            assert text not in log, f"{nproc}-rank world: {text!r}"


# Layouts whose every rank's peak under MemTracker (real tensors, the runtime's own wrapping) is compared with the
# planner's: (ranks, the tiny recipe's overrides, tolerance). 1%: what tests/test_trace.py asks of data-parallel
# layouts; tensor-parallel and pipeline layouts land within 0.3% (1F1B), the first pipeline rank of ddp's
# all-forwards-first case too. Interleaved 1F1B 5%: the planner adds the whole receive buffers to the most
# activations in flight, where torch reuses a received input as the block's saved input for the micro-batches in
# flight (seen: -1.4% on the first rank, +4.5% on the last, whose head-only stage makes the overlap a large share).
# Tensor x pipeline 6%, an open gap: the tracker sees more residual-stream-sized temporaries in a block's
# backward than the planner counts when both split the model (seen: -4.9% on the first rank in bf16, -0.8% in
# fp32; -3.1% on the last), while each alone matches within 0.3%.
MEMORY = {
    "tp2": (2, ["parallelism.tensor=2"], 0.01),
    "tp2-sp-bf16-selective": (
        2,
        [
            "parallelism.tensor=2",
            "parallelism.sequence_parallel=true",
            "parallelism.precision=bf16",
            "parallelism.activation_checkpointing=selective",
        ],
        0.01,
    ),
    # 3%: the second rank's traced peak varies between runs (seen -0.7% and -2.0% from the plan, the first
    # rank's within 0.1%, the same code and data); the source of that variation is not pinned down yet
    "tp2-sp-bf16-full": (
        2,
        [
            "parallelism.tensor=2",
            "parallelism.sequence_parallel=true",
            "parallelism.precision=bf16",
            "parallelism.activation_checkpointing=full",
        ],
        0.03,
    ),
    "pp2": (2, ["parallelism.pipeline=2"], 0.01),
    "pp2-bf16": (2, ["parallelism.pipeline=2", "parallelism.precision=bf16"], 0.01),
    "pp2-interleaved": (2, ["parallelism.pipeline=2", "parallelism.pipeline_schedule=interleaved_1f1b"], 0.05),
    # 2%: now and then one rank's peak is exactly 128 KiB (+1.16%) above the usual one, on the same code and
    # data (1 run in 6 here, once in CI). 128 KiB is the head's fp32 gradient on one tensor-parallel rank
    # (vocab/2 x hidden x 4 B): most likely the reduce-scatter's input, which gloo's thread releases when the
    # collective completes, sometimes after the next allocation has set the peak. The usual peak is 0.004% off.
    "tp2xdp2-bf16": (4, ["parallelism.tensor=2", "parallelism.precision=bf16"], 0.02),
    "tp2xdp2-grad-op": (4, ["parallelism.tensor=2", "parallelism.strategy=fsdp_grad_op"], 0.02),
    # 2 micro-batches through 2 stages: the first rank runs both forwards before any backward
    "pp2xdp2-ddp": (4, ["parallelism.pipeline=2", "parallelism.strategy=ddp"], 0.01),
    "tp2xpp2-sp-bf16": (
        4,
        [
            "parallelism.tensor=2",
            "parallelism.pipeline=2",
            "parallelism.sequence_parallel=true",
            "parallelism.precision=bf16",
        ],
        0.06,
    ),
    "tp2xpp2-bf16": (4, ["parallelism.tensor=2", "parallelism.pipeline=2", "parallelism.precision=bf16"], 0.06),
}


@pytest.fixture(scope="module")
def memory(tmp_path_factory):
    root = tmp_path_factory.mktemp("memory")
    for nproc in sorted({n for n, _, _ in MEMORY.values()}):
        cases = [{"sets": sets, "out": str(root / name)} for name, (n, sets, _) in MEMORY.items() if n == nproc]
        (root / f"cases-{nproc}.json").write_text(json.dumps(cases))
        cmd = [
            TORCHRUN,
            f"--nproc-per-node={nproc}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{free_port()}",
            "--max-restarts=0",
            str(Path(__file__).with_name("layout_memory.py")),
            str(root / f"cases-{nproc}.json"),
        ]
        t0 = time.monotonic()
        res = subprocess.run(cmd, capture_output=True, text=True, env=torchrun_env(), timeout=420)
        (root / f"torchrun-{nproc}.log").write_text(res.stdout + "\n----- stderr -----\n" + res.stderr)
        print(f"\nmemory, {nproc}-rank world: {len(cases)} layouts, {time.monotonic() - t0:.1f}s, rc {res.returncode}")
        assert res.returncode == 0, res.stderr[-4000:]
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY))
def test_the_planners_peak_is_what_the_runtime_allocates(memory, name):
    """Every rank's peak of a training step, measured by PyTorch's MemTracker on the runtime's real tensors
    (tensor-parallel DTensors, pipeline stages and their buffers, FSDP2's shards and gathered copies), against
    the planner's largest moment for that rank (`parts.part_of`, `moments.timeline`)."""
    nproc, _, tol = MEMORY[name]
    rows = [json.loads(f.read_text()) for f in sorted((memory / name).glob("rank-*.json"))]
    assert len(rows) == nproc
    for r in rows:
        assert r["planned"] == pytest.approx(r["traced"], rel=tol), (name, r)
    print(
        f"\n{name}: "
        + "; ".join(
            f"rank {r['rank']} traced {r['traced']:,} B, planned {r['planned']:,} B "
            f"({r['planned'] / r['traced'] - 1:+.2%}, {r['planned_at']})"
            for r in rows
        )
    )
