"""Generated shell lives in template files (launcher/render/templates/*.j2), so the Python side holds a
context and the shell reads as shell.

Jinja2 with autoescape off (this is shell, not HTML), so every value is inserted through a filter that
quotes it for its context: `q` (one shell word: a literal through shlex.quote, a ShellExpr in double
quotes), `cmd` (a list of words), `sbatch` (an #SBATCH option value). tests/test_templates.py checks that
no template inserts a value any other way. StrictUndefined turns a missing context value into an error at
render time instead of an empty string in a script.
"""
from __future__ import annotations

from functools import lru_cache

from ..errors import DtlaunchError
from ..recipe.fields import ENV_NAME
from .shell import join, quote, sbatch_value


def envname(name: str) -> str:
    """An environment variable name, checked again where it meets the shell."""
    if not ENV_NAME.match(name):
        raise DtlaunchError(f"{name!r} is not an environment variable name")
    return name


def verbatim(line: str) -> str:
    """A line the recipe asks to run as written (targets.*.setup): the one deliberate exception to quoting."""
    if "\x00" in line:
        raise DtlaunchError("a setup line contains a NUL byte")
    return line


def _bytecode_cache(jinja2):
    """Jinja's own cache of compiled templates, in the per-user directory it creates and checks (mode 0700,
    owned by this user, under the system temp dir). Compiling the templates is about a fifth of a `render`;
    an entry is keyed by the template's name and checked against its source's checksum and this Python's
    marshal format, so an edited template or another interpreter recompiles. No usable directory (or a full
    disk) only means no cache."""

    class Quiet(jinja2.FileSystemBytecodeCache):
        def dump_bytecode(self, bucket) -> None:
            try:
                super().dump_bytecode(bucket)
            except OSError:
                pass

    try:
        return Quiet()
    except (OSError, RuntimeError):
        return None


@lru_cache(maxsize=1)
def environment():
    import jinja2  # imported by render only; `plan` and `validate` never pay for it

    env = jinja2.Environment(
        loader=jinja2.PackageLoader("launcher.render", "templates"),
        bytecode_cache=_bytecode_cache(jinja2),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(q=quote, cmd=join, sbatch=sbatch_value, envname=envname, verbatim=verbatim)
    return env


def render_template(name: str, **context) -> str:
    return environment().get_template(name).render(**context)
