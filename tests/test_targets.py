"""The targets' table and the layout every target package follows (launcher/targets/__init__.py): each row's
parts load and keep the protocol, each package imports in any order without anything heavy, and the recipe,
the template loader and validate see every target."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from launcher.errors import DtlaunchError
from launcher.recipe import TargetsSpec
from launcher.targets import TARGET_NAMES, TARGETS, backend, target
from launcher.validate import RULES

HEAVY = ("torch", "deepspeed", "sky", "submitit", "paramiko", "transformers", "jinja2")
# The one module of a target that may import its scheduler's library at module level: it runs in the job.
JOB_SIDE = {"launcher.targets.slurm.submitit_job"}


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_each_row_names_a_renderer_backend_and_handle_that_keep_the_protocol(name):
    row = TARGETS[name]
    renderer = row.load("renderer")
    params = inspect.signature(renderer).parameters
    assert list(params)[:3] == ["recipe", "plan", "files"]
    assert params["choices"].kind is inspect.Parameter.KEYWORD_ONLY and params["choices"].default is None
    be = backend(name)
    assert be.name == name
    # launcher.targets.Backend is a Protocol (structural): these methods are what it asks for
    assert all(callable(getattr(be, m, None)) for m in ("submit", "wait", "status", "logs", "cancel"))
    handle = row.load("handle")
    assert handle.__dataclass_params__.frozen  # the registry stores it as JSON and decodes it by the row


def test_an_unknown_target_is_refused_with_the_known_ones():
    with pytest.raises(DtlaunchError, match="unknown target 'nope'") as e:
        target("nope")
    assert e.value.fix == "use one of local, slurm, sky"


def test_every_target_has_its_recipe_section_rules_and_templates():
    sections = {f.name: f.type for f in msgspec.structs.fields(TargetsSpec)}
    assert set(sections) == {"default", *TARGET_NAMES}
    for name, row in TARGETS.items():
        assert sections[name] is row.module("spec").__dict__[sections[name].__name__]
        assert any(name in r.targets for r in RULES), f"no validate rule names {name}"
        assert list((Path(row.module("render").__file__).parent / "templates").glob("*.j2")), name


@pytest.mark.parametrize("name", TARGET_NAMES)
def test_a_target_package_imports_in_any_order_and_nothing_heavy(name):
    """spec.py first is the order that needs the package's import of the recipe schema (spec.py is part of the
    schema, which imports it); then every other module, as the CLI and the job would."""
    pkg = Path(TARGETS[name].module("spec").__file__).parent
    modules = [f"{TARGETS[name].package}.{p.stem}" for p in sorted(pkg.glob("*.py")) if p.stem != "__init__"]
    modules = ["spec", *(m for m in modules if not m.endswith(".spec") and m not in JOB_SIDE)]
    code = (
        "import importlib, sys\n"
        f"importlib.import_module({TARGETS[name].package + '.spec'!r})\n"
        f"for m in {modules[1:]!r}:\n    importlib.import_module(m)\n"
        f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "", f"{name} imported {r.stdout.strip()}"
