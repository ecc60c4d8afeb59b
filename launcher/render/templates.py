"""Generated shell lives in template files (launcher/render/templates/*.j2), so the Python side holds a
context and the shell reads as shell.

The templates are Jinja syntax, compiled ahead of time into plain Python (compiled_templates.py, by
scripts/compile_templates.py): Jinja's import alone was a fifth of a `render`. As under Jinja with
StrictUndefined and no autoescape (this is shell, not HTML), a value enters a script only through a
quoting filter (template_filters.py), and a missing context value is an error, not an empty string.
"""
from __future__ import annotations

from .compiled_templates import TEMPLATES


def render_template(name: str, **context) -> str:
    out: list[str] = []
    TEMPLATES[name](context, out.append)
    return "".join(out)
