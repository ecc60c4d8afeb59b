"""Tracking where users already look, and the validation loss (training.tracking, training.eval_every).

One real 2-rank FSDP2 run with W&B (offline) and TensorBoard selected and a validation loss every 2 steps, preempted
at step 3 and run again (it resumes): the W&B run is dtlaunch's run id in both attempts and holds the logged
losses; TensorBoard's scalars are metrics.jsonl's losses; the training losses equal those of a run with nothing
selected and no evaluation, which writes no tensorboard/ or wandb/ directory. Then what needs no torchrun: the
held-out data, the sinks' own behaviour (a resumed attempt's TensorBoard hides what a failed one wrote after the
checkpoint), the missing-package and recipe refusals.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
from pathlib import Path

import pytest
import yaml

from launcher.jobenv import ExitCode
from launcher.runtime.failures import ConfigError
from rt_harness import recipe_dict, run_torchrun, write_plan

# the sinks' packages (dtlaunch[track]); looked up, not imported: importing wandb alone takes a second or more
TRACK = pytest.mark.skipif(
    importlib.util.find_spec("wandb") is None or importlib.util.find_spec("tensorboard") is None,
    reason="needs wandb and tensorboard: pip install 'dtlaunch[track]'",
)

RUN_ID = "trk-run-7"
STEPS, STOP, EVAL_EVERY = 6, 3, 2


def _wandb_env(root: Path) -> dict:
    """W&B offline, every file it writes under `root` (its config and caches too, never the home directory)."""
    dirs = {k: root / k.lower() for k in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR")}
    for d in dirs.values():
        d.mkdir(parents=True, exist_ok=True)
    # WANDB_PROJECT empty: the recipe's name is the project, whatever the environment says
    return {
        "WANDB_MODE": "offline",
        "WANDB_SILENT": "true",
        "WANDB_PROJECT": "",
        **{k: str(v) for k, v in dirs.items()},
    }


def _recipe(**training) -> dict:
    return recipe_dict(
        name="trk",
        parallelism={"strategy": "fsdp"},
        training={"steps": STEPS, "deterministic": True, **training},
        checkpoint={"every": 2},
    )


def _wandb_runs(wandb_dir: Path) -> list[dict]:
    """Each offline W&B run under `wandb_dir`, read with wandb's own reader: its id, project, name, history."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    out = []
    for f in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        ds = datastore.DataStore()
        ds.open_for_scan(str(f))
        run: dict = {"dir": f.parent.name, "history": {}}
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            kind = rec.WhichOneof("record_type")
            if kind == "run":
                run.update(id=rec.run.run_id, project=rec.run.project, name=rec.run.display_name)
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                run["history"][row["_step"]] = row
        out.append(run)
    return out


def _tb_scalars(tb_dir: Path, tag: str) -> dict[int, float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    events = acc.Scalars(tag)
    steps = [e.step for e in events]
    assert len(steps) == len(set(steps)), f"{tag}: a step shows twice: {steps}"
    return {e.step: e.value for e in events}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the tracked run: its run dir, W&B dir, both attempts; the plain run)."""
    root = tmp_path_factory.mktemp("tracking")
    env = {**_wandb_env(root / "w"), "DTLAUNCH_RUN_ID": RUN_ID}
    tracked = root / "tracked"
    plan = write_plan(
        tracked, _recipe(eval_every=EVAL_EVERY, eval_batches=2, tracking={"tensorboard": True, "wandb": True})
    )
    first = run_torchrun(plan, tracked, env={**env, "DTLAUNCH_FAULT": f"signal:rank=0:step={STOP}:sig=USR2"})
    assert ExitCode.PREEMPTED in first.worker_codes, first.output[-3000:]
    second = run_torchrun(plan, tracked, env=env)
    assert second.rc == 0, second.output[-3000:]
    assert f"resumed from step {STOP}" in second.stdout
    plain_env = {**_wandb_env(root / "plain-w"), "DTLAUNCH_RUN_ID": "trk-plain"}
    plain = run_torchrun(write_plan(root / "plain", _recipe()), root / "plain", env=plain_env)
    assert plain.rc == 0, plain.output[-3000:]
    return {"tracked": second, "first": first, "wandb": root / "w" / "wandb_dir", "plain": plain, "plain_env": root}


@pytest.mark.slow
@TRACK
def test_wandb_offline_run_is_the_dtlaunch_run_and_resumes_it(runs):
    res = runs["tracked"]
    losses = res.losses()
    assert sorted(losses) == list(range(1, STEPS + 1))
    attempts = _wandb_runs(runs["wandb"])
    assert len(attempts) == 2, [a["dir"] for a in attempts]  # one offline run per attempt, synced into one
    for a in attempts:
        assert a["id"] == RUN_ID and a["dir"].endswith(f"-{RUN_ID}"), a
        assert a["project"] == "trk" and a["name"] == "trk"
    # the first attempt logged up to the preemption, the resumed one from the next step: no step twice
    assert sorted(attempts[0]["history"]) == list(range(1, STOP + 1))
    assert sorted(attempts[1]["history"]) == list(range(STOP + 1, STEPS + 1))
    history = {**attempts[0]["history"], **attempts[1]["history"]}
    for step, loss in losses.items():
        assert history[step]["loss"] == pytest.approx(loss, rel=1e-12), step
        assert history[step]["lr"] > 0 and history[step]["tokens_per_s"] > 0 and history[step]["host_rss_mb"] > 0
    vals = {m["step"]: m["val_loss"] for m in res.metrics() if "val_loss" in m}
    assert {s: history[s].get("val_loss") for s in vals} == vals


@pytest.mark.slow
@TRACK
def test_tensorboard_scalars_are_the_metrics(runs):
    res = runs["tracked"]
    tb = res.run_dir / "tensorboard"
    assert len(list(tb.glob("events.out.tfevents.*"))) == 2  # one file per attempt
    losses = _tb_scalars(tb, "loss")
    assert losses == pytest.approx(res.losses(), rel=1e-6)  # float32 in the event file
    vals = {m["step"]: m["val_loss"] for m in res.metrics() if "val_loss" in m}
    assert _tb_scalars(tb, "val_loss") == pytest.approx(vals, rel=1e-6)
    assert set(_tb_scalars(tb, "lr")) == set(losses)


@pytest.mark.slow
@TRACK
def test_validation_loss_every_n_steps_leaves_training_unchanged(runs):
    res, plain = runs["tracked"], runs["plain"]
    vals = {m["step"]: m["val_loss"] for m in res.metrics() if "val_loss" in m}
    assert sorted(vals) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
    assert all(math.isfinite(v) for v in vals.values())
    assert vals[STEPS] < vals[EVAL_EVERY]  # the model that is evaluated is the one being trained
    assert "val_loss" in res.stdout and not any("val_loss" in m for m in plain.metrics())
    # the same training data and weights with and without evaluations (before and after the resume)
    ours, theirs = res.losses(), plain.losses()
    before = runs["first"].losses()
    assert {s: before[s] for s in range(1, STOP + 1)} == {s: theirs[s] for s in range(1, STOP + 1)}
    assert ours == pytest.approx(theirs, abs=1e-5)


@pytest.mark.slow
@TRACK
def test_nothing_selected_writes_no_sink(runs):
    plain = runs["plain"]
    assert not (plain.run_dir / "tensorboard").exists() and not (plain.run_dir / "wandb").exists()
    wandb_dir = runs["plain_env"] / "plain-w" / "wandb_dir"
    assert list(wandb_dir.iterdir()) == []
    assert "W&B" not in plain.output


@pytest.mark.slow
def test_pipeline_parallel_refuses_eval(run_dir):
    rec = recipe_dict(parallelism={"strategy": "fsdp", "pipeline": 2}, training={"eval_every": 2, "steps": 4})
    res = run_torchrun(write_plan(run_dir, rec), run_dir)
    assert set(res.worker_codes) == {ExitCode.CONFIG}, res.output[-3000:]
    assert "training.eval_every needs a forward pass outside the pipeline" in res.output
    assert "parallelism.pipeline: 1" in res.output


# ----------------------------------------------------------------------------- without torchrun


def _spec(**over):
    from launcher.recipe.schema import DataSpec

    return DataSpec(**over)


def test_synthetic_held_out_is_another_walk_of_the_same_chain():
    from launcher.runtime.data import SyntheticTokens, build_dataloader, build_eval_data

    kw = dict(vocab=256, seq_len=16, micro_batch=2, rank=0, world_size=2, seed=5)
    spec = _spec(num_tokens=20000)
    plain = build_dataloader(spec, grad_accum=1, device="cpu", is_gpu=False, **kw)
    held = build_dataloader(spec, grad_accum=1, device="cpu", is_gpu=False, held_out=64, **kw)
    assert len(held.dataset) == len(plain.dataset)  # the training data is the same with a held-out set
    assert held.next_step()[0][0].equal(plain.next_step()[0][0])
    ev = build_eval_data(spec, global_batch=4, eval_batches=3, **kw)
    assert len(ev.dataset) == 12
    micro = list(ev.micro_batches("cpu"))
    assert len(micro) == 3 and all(x.shape == (2, 16) and y.shape == (2, 16) for x, y in micro)
    train = SyntheticTokens(20000, 256, 5).tokens.tolist()
    val = SyntheticTokens(12 * 16 + 1, 256, 5, stream=1).tokens.tolist()
    assert val[:32] != train[:32]
    # every transition of the held-out walk is one the training walk makes: the same chain, not another task
    assert set(zip(val, val[1:], strict=False)) <= set(zip(train, train[1:], strict=False))


def test_file_held_out_is_the_last_sequences(tmp_path):
    from launcher.runtime.data import build_dataloader, build_eval_data

    path = tmp_path / "tokens.bin"
    n_tokens = 10 * 8 + 1  # 10 sequences of 8
    path.write_bytes(struct.pack(f"<{n_tokens}H", *range(n_tokens)))
    spec = _spec(source="file", path=str(path))
    kw = dict(vocab=1000, seq_len=8, micro_batch=1, rank=0, world_size=1, seed=0)
    train = build_dataloader(spec, grad_accum=2, device="cpu", is_gpu=False, held_out=4, **kw)
    assert len(train.dataset) == 6
    ev = build_eval_data(spec, global_batch=2, eval_batches=2, **kw)
    firsts = sorted(int(x[0, 0]) for x, _ in ev.micro_batches("cpu"))
    assert firsts == [48, 56, 64, 72]  # sequences 6..9: after every sequence training reads
    with pytest.raises(ConfigError, match="held out for the validation loss"):
        build_dataloader(spec, grad_accum=2, device="cpu", is_gpu=False, held_out=10, **kw)


@TRACK
def test_tensorboard_of_a_resumed_attempt_hides_what_the_failed_one_wrote_after_the_checkpoint(tmp_path):
    from launcher.recipe.schema import TrackingSpec
    from launcher.runtime.metrics import Metrics

    def attempt(losses: dict[int, float], resumed_at: int | None) -> None:
        m = Metrics(tmp_path, enabled=True, total_steps=5, is_gpu=False)
        m.open_sinks(TrackingSpec(tensorboard=True), run_id="r", name="n", config={})
        if resumed_at is not None:
            m.event("resume", step=resumed_at)
        for step, loss in losses.items():
            m.step(step, loss=loss, lr=0.1, tokens_per_s=1.0, step_time=1.0, grad_norm=None)
        m.validation(max(losses), 9.5, sequences=4, seconds=0.1)
        m.close()

    attempt({1: 5.0, 2: 4.0, 3: 3.0, 4: 2.0}, None)  # failed after step 4; its checkpoint is step 2
    attempt({3: 3.5, 4: 2.5, 5: 1.5}, 2)
    assert _tb_scalars(tmp_path / "tensorboard", "loss") == {1: 5.0, 2: 4.0, 3: 3.5, 4: 2.5, 5: 1.5}
    assert _tb_scalars(tmp_path / "tensorboard", "val_loss") == {5: 9.5}
    assert "grad_norm" not in _tb_tags(tmp_path / "tensorboard")  # None is left out, not logged as 0


def _tb_tags(tb_dir: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return acc.Tags()["scalars"]


def test_a_missing_package_is_a_config_error_on_every_rank(monkeypatch):
    from launcher.recipe.schema import TrackingSpec
    from launcher.runtime.metrics import check_tracking

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    check_tracking(TrackingSpec(tensorboard=True))
    with pytest.raises(ConfigError) as e:
        check_tracking(TrackingSpec(wandb=True))
    assert "training.tracking.wandb" in str(e.value) and "pip install wandb" in (e.value.fix or "")


def test_recipe_fields_default_off_and_refusals():
    from launcher.errors import DtlaunchError
    from launcher.recipe import load_text

    base = {"name": "x", "model": {"preset": "tiny"}, "training": {"steps": 10}}
    tr = load_text(yaml.safe_dump(base), source="<t>").training
    assert (tr.tracking.tensorboard, tr.tracking.wandb, tr.tracking.wandb_project) == (False, False, None)
    assert (tr.eval_every, tr.eval_batches) == (0, 4)
    cases = [
        ({"tracking": {"wandbb": True}}, "did you mean 'wandb'"),
        ({"tracking": {"wandb": True, "wandb_project": "team/proj"}}, "not a W&B project name"),
        ({"eval_every": -1}, "training.eval_every"),
    ]
    for training, words in cases:
        with pytest.raises(DtlaunchError, match=words):
            load_text(yaml.safe_dump({**base, "training": {"steps": 10, **training}}), source="<t>")
    with pytest.raises(DtlaunchError, match="training.eval_every.*own loop"):  # the trainer's, not a user's loop
        load_text(
            yaml.safe_dump({**base, "training": {"steps": 10, "eval_every": 5}, "entrypoint": {"script": "t.py"}}),
            source="<t>",
        )


@TRACK
@pytest.mark.slow
def test_a_users_own_loop_gets_the_sinks_too(run_cli, tmp_path):
    """The sinks open in the lifecycle both loops share (launcher.Job): the plain-PyTorch example, run by
    `dtlaunch up` with TensorBoard selected, writes the losses its own loop reports."""
    example = Path(__file__).resolve().parents[2] / "examples" / "plain-pytorch"
    rec = yaml.safe_load((example / "recipe.yaml").read_text())
    rec["entrypoint"]["workdir"] = str(example)  # the recipe is written elsewhere: anchor its relative script
    rec["training"].update(steps=10, log_every=5, tracking={"tensorboard": True})
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump(rec))
    code, out, err = run_cli("up", tmp_path / "recipe.yaml", "-o", tmp_path / "run")
    assert code == 0, out + err
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = {m["step"]: m["loss"] for m in rows if "loss" in m}
    assert sorted(logged) == [5, 10]
    assert _tb_scalars(tmp_path / "run" / "tensorboard", "loss") == pytest.approx(logged)


@TRACK
def test_wandb_without_an_api_key_is_a_config_error_with_the_fix(tmp_path, monkeypatch):
    from launcher.recipe.schema import TrackingSpec
    from launcher.runtime.metrics import Metrics

    for k in ("WANDB_API_KEY", "WANDB_DIR", "WANDB_PROJECT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no stored login either
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(k, str(tmp_path / k.lower()))
    m = Metrics(tmp_path / "run", enabled=True, total_steps=2, is_gpu=False)
    try:
        with pytest.raises(ConfigError, match="W&B refused the run") as e:
            m.open_sinks(TrackingSpec(wandb=True), run_id="r1", name="n", config={})
        assert "secrets: [WANDB_API_KEY]" in (e.value.fix or "") and "WANDB_MODE=offline" in (e.value.fix or "")
    finally:
        m.close()
    assert not (tmp_path / "run" / "wandb").exists()
