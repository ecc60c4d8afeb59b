"""`prepare`, the one way render, up and launcher.submit go: the plan is made once per target, and what validate
checks is the plan the job ships."""

from __future__ import annotations

import launcher.plan as plan_module
import launcher.plan.choices as choices_module
from launcher.prepare import check, prepare
from launcher.validate import RULES, Rule, validate
from testpaths import RECIPES

FALLBACKS = ["targets.sky.accelerators=[A100-80GB:8, L4:8]"]


def test_a_sky_render_with_fallbacks_plans_each_accelerator_once(monkeypatch, capsys):
    planned = []
    real = plan_module.make_plan

    def counting(recipe, *a, **k):
        planned.append(recipe.resources.accelerator)
        return real(recipe, *a, **k)

    monkeypatch.setattr(plan_module, "make_plan", counting)
    monkeypatch.setattr(choices_module, "make_plan", counting)
    prep = prepare(RECIPES / "llama3-8b.yaml", FALLBACKS, target="sky")
    check(prep, force=True, action="rendered")
    # one plan per accelerator, for render and validate together (it was 11 for this render)
    assert sorted(planned) == sorted(["H100:8", "A100-80GB:8", "L4:8"]), planned


def test_validate_checks_the_plan_the_job_ships():
    """With fallbacks the job ships the plan made for the smallest device; the rules see that one, not the
    primary accelerator's."""
    prep = prepare(RECIPES / "llama3-8b.yaml", FALLBACKS, target="sky")
    shipped = prep.choices.shipped
    primary = prep.choices.choices[0].own
    assert prep.choices.basis == "L4:8" and shipped.memory.total != primary.memory.total
    seen = []
    probe = Rule("probe", "warning", "model", "", lambda r, p: seen.append(p), ("sky",))
    validate(prep.recipe, primary, "sky", [*RULES, probe])  # given the primary, as `dtlaunch validate` is
    assert [p.memory.total for p in seen] == [shipped.memory.total]
    assert prep.tasks[0][2] is shipped  # what `check` validates
