"""Every shipped recipe's SkyPilot task, parsed by the oldest SkyPilot the [sky] extra allows.

`make install` keeps that version in .venv-sky-oldest (its number read from pyproject.toml); the other schema
tests use the version of constraints.txt. SkyPilot's own `Task.from_yaml_config` parses each rendered
task.yaml there, with the secrets given as `sky launch --secret NAME` gives them (names only in the file).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from sky_helpers import RECIPES, render_to

ROOT = Path(__file__).resolve().parents[2]
OLDEST = ROOT / ".venv-sky-oldest" / "bin" / "python"
VARIANTS = {
    "as-shipped": [],
    "managed": ["targets.sky.managed=true", "targets.sky.checkpoint_storage={bucket: 's3://dtlaunch-test/ckpt'}"],
}

PARSE = """
import json, os, sys
import sky
out = {"version": sky.__version__, "results": {}}
for d in sys.argv[1:]:
    os.chdir(d)
    import yaml
    cfg = yaml.safe_load(open("task.yaml"))
    secrets = [(k, "x") for k in (cfg.get("secrets") or {})]  # what --secret NAME passes
    try:
        t = sky.Task.from_yaml_config(cfg, secrets_overrides=secrets)
        out["results"][d] = {"ok": True, "num_nodes": t.num_nodes}
    except Exception as e:
        out["results"][d] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:800]}
print(json.dumps(out))
"""


def minimum() -> str:
    text = (ROOT / "pyproject.toml").read_text()
    (v,) = re.findall(r'^sky = \["skypilot>=([0-9.]+)"\]', text, flags=re.M)
    return v


def test_every_shipped_task_parses_on_the_oldest_allowed_skypilot(tmp_path):
    assert OLDEST.exists(), ".venv-sky-oldest is missing: `make install` creates it"
    dirs, expect = [], {}
    for recipe in RECIPES:
        for variant, overrides in VARIANTS.items():
            rec, art, out = render_to(tmp_path / f"{recipe.stem}-{variant}", recipe, overrides)
            dirs.append(str(out))
            expect[str(out)] = rec.resources.nodes
            if variant == "managed":
                assert "recover_on_exit_codes" in yaml.safe_load(art.files["task.yaml"])["resources"]["job_recovery"]
    p = subprocess.run([str(OLDEST), "-c", PARSE, *dirs], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert got["version"] == minimum()  # the venv holds the oldest the extra allows, not another
    bad = {d: r["error"] for d, r in got["results"].items() if not r["ok"]}
    assert not bad, bad
    assert {d: r["num_nodes"] for d, r in got["results"].items()} == expect


@pytest.mark.parametrize("field", ["job_recovery"])
def test_the_oldest_skypilot_refuses_what_it_does_not_know(tmp_path, field):
    """Guard: the parse above is strict (an unknown key fails it), so a pass means the schema took every field."""
    rec, art, out = render_to(tmp_path, RECIPES[0], VARIANTS["managed"])
    doc = yaml.safe_load((out / "task.yaml").read_text())
    doc["resources"][field]["no_such_key"] = 1
    (out / "task.yaml").write_text(yaml.safe_dump(doc))
    p = subprocess.run([str(OLDEST), "-c", PARSE, str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    (res,) = json.loads(p.stdout.strip().splitlines()[-1])["results"].values()
    assert not res["ok"] and "no_such_key" in res["error"]
