"""Generated shell lives in template files, so the Python side holds a context and the shell reads as shell:
each target's own in its package (launcher/targets/NAME/templates/*.j2), the partials several targets include
(the run's identity, the interpreter check, the outcome) in launcher/render/templates/. One loader searches
them all, so a template's name is unique among them (a test checks) and an include names no directory.

Jinja2 renders them, imported on the first render only: `plan`, `validate` and `--help` never pay for it. As
this is shell, not HTML, nothing is autoescaped: a value enters a script only through a quoting filter
(template_filters.py; a test checks every `{{ }}`), and under StrictUndefined a value the renderer did not
pass is an error, not an empty word. Every template also sees `code` (the exit codes), `jobenv` (the
names launcher/jobenv.py gives the job's environment, e.g. `{{ jobenv.RUN_ID }}`) and `line_prefix` (the
label torchrun puts on each rank's lines: jobenv.log_line_prefix).
"""

from __future__ import annotations

import functools

from .. import jobenv
from ..targets import TARGETS
from .shell import ShellExpr
from .template_filters import FILTERS


@functools.cache
def environment():
    """The options the templates are written for: a block tag's own line leaves no trace in the output, and
    the file's last line break is kept."""
    import jinja2

    loaders = [jinja2.PackageLoader(__package__), *(jinja2.PackageLoader(t.package) for t in TARGETS.values())]
    env = jinja2.Environment(
        loader=jinja2.ChoiceLoader(loaders),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(FILTERS)
    # _labels.sh.j2's, inside a double-quoted shell word: the node's name expanded there, ${rank} left for torchrun
    line_prefix = ShellExpr(jobenv.log_line_prefix("$NODE_NAME", "\\${rank}"))
    env.globals.update(code=jobenv.ExitCode, jobenv=jobenv, line_prefix=line_prefix)
    return env


def render_template(name: str, **context) -> str:
    return environment().get_template(name).render(**context)
