"""The only ways a value enters a shell template (registered as Jinja filters by templates.py).

Each filter quotes for one context: `q` (one shell word: a literal through shlex.quote, a ShellExpr in
double quotes), `cmd` (a list of words), `sbatch` (an #SBATCH option value), `envname` (a variable name,
checked again where it meets the shell), `int` (a whole number) and `verbatim`, the one deliberate
exception (targets.*.setup lines, run as written). tests/test_templates.py checks that no template
inserts a value any other way.
"""

from __future__ import annotations

from ..errors import DtlaunchError
from ..recipe.fields import ENV_NAME
from .shell import join, quote, sbatch_value


def envname(name: str) -> str:
    if not ENV_NAME.match(name):
        raise DtlaunchError(f"{name!r} is not an environment variable name")
    return name


def verbatim(line: str) -> str:
    if "\x00" in line:
        raise DtlaunchError("a setup line contains a NUL byte")
    return line


def whole(value: object) -> int:
    """Jinja's own `int` filter turns anything it cannot read into 0; in a script, that 0 would be a
    silent wrong port or timeout, so anything but a number is a bug to surface."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"a template's `int` needs a number, got {value!r}")
    return int(value)


FILTERS = {"q": quote, "cmd": join, "sbatch": sbatch_value, "envname": envname, "verbatim": verbatim, "int": whole}
