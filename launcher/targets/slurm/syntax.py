"""SLURM's own little languages (memory sizes, host lists, dependencies, mail types), parsed strictly so a
typo is a located recipe error instead of an sbatch rejection after the job has queued, or a value sbatch
reads differently from what was meant (a `/` in a host list makes sbatch read a file of that name)."""

from __future__ import annotations

import itertools
import re

from ...errors import FieldError

MEM_FORMS = "a number with an optional K, M, G or T suffix (MB by default), e.g. 500G"
_MEM = re.compile(r"\d{1,9}[KMGT]?", re.ASCII)


def parse_mem(text: str, *, zero: bool = True) -> str:
    """A memory size as sbatch's --mem/--mem-per-gpu take it; `zero` allows 0 (--mem=0: all of the node's)."""
    if not _MEM.fullmatch(text):
        raise ValueError(
            f"{text!r} is not a SLURM memory size: use {MEM_FORMS}"
            + (", or 0 for all of the node's memory" if zero else "")
        )
    if not zero and int(text.rstrip("KMGT")) == 0:
        raise ValueError(f"{text!r}: a memory size per GPU must be above 0 ({MEM_FORMS})")
    return text


# ----------------------------------------------------------------------------- host lists

MAX_HOSTS = 100_000  # more names than any cluster has: an expansion beyond this is a typo, not a cluster
_NAME = r"[A-Za-z0-9_.-]+"
_RANGE = r"\d{1,9}(?:-\d{1,9})?"
_BRACKET = rf"\[{_RANGE}(?:,{_RANGE})*\]"
_HOST = re.compile(rf"(?:{_NAME}|{_BRACKET})+", re.ASCII)
_PART = re.compile(rf"({_NAME})|\[([^\]]*)\]", re.ASCII)
HOSTLIST_FORMS = "node names and ranges, comma-separated, e.g. node[01-04,07],gpu12"


def _split_top(text: str) -> list[str]:
    """Split at commas outside brackets (node[1,3],node7 is two items)."""
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    items.append("".join(cur))
    return items


def _numbers(body: str) -> list[str]:
    out: list[str] = []
    for r in body.split(","):
        lo, _, hi = r.partition("-")
        hi = hi or lo
        if int(hi) < int(lo):
            raise ValueError(f"[{body}]: the range {r} runs backwards")
        if int(hi) - int(lo) + len(out) >= MAX_HOSTS:
            raise ValueError(f"[{body}] names more than {MAX_HOSTS:,} hosts")
        width = len(lo) if lo.startswith("0") else 0  # node[01-10]: zero-padded like the first number
        out += [str(n).zfill(width) for n in range(int(lo), int(hi) + 1)]
    return out


def parse_hostlist(value: str | list) -> str:
    """A host list as sbatch's --nodelist/--exclude take it. A YAML list of names is joined with commas."""
    if isinstance(value, list):
        if not value or not all(isinstance(v, str) for v in value):
            raise ValueError("a host list is a string (node[1-4],gpu7) or a list of node names")
        value = ",".join(value)
    if not isinstance(value, str):
        raise ValueError("a host list is a string (node[1-4],gpu7) or a list of node names")
    if "/" in value:
        raise ValueError(
            f"{value[:80]!r}: sbatch reads a host list with a '/' as a file on the submitting "
            f"machine; list the nodes instead ({HOSTLIST_FORMS})"
        )
    for item in _split_top(value):
        if not _HOST.fullmatch(item):
            raise ValueError(f"{item[:80]!r} is not a host name or range: use {HOSTLIST_FORMS}")
    expand_hostlist(value)  # ranges run forwards and stay bounded
    return value


def expand_hostlist(value: str) -> list[str]:
    """Every host a (valid) host list names, in order, without duplicates."""
    hosts: dict[str, None] = {}
    for item in _split_top(value):
        parts = [[m.group(1)] if m.group(1) is not None else _numbers(m.group(2)) for m in _PART.finditer(item)]
        total = 1
        for p in parts:
            total *= len(p)
            if total > MAX_HOSTS:
                raise ValueError(f"{item[:80]!r} names more than {MAX_HOSTS:,} hosts")
        for combo in itertools.product(*parts):
            hosts["".join(combo)] = None
        if len(hosts) > MAX_HOSTS:
            raise ValueError(f"the host list names more than {MAX_HOSTS:,} hosts")
    return list(hosts)


# ----------------------------------------------------------------------------- dependencies

DEPENDENCY_TYPES = ("after", "afterany", "afterburstbuffer", "aftercorr", "afternotok", "afterok")
DEPENDENCY_FORMS = (
    "TYPE:JOBID[:JOBID...] joined by ',' (all) or '?' (any), e.g. afterok:123:124,afterany:125, "
    "after:123+10 (minutes after it starts), or singleton; TYPE is one of " + ", ".join(DEPENDENCY_TYPES)
)
_JOB = re.compile(r"\d{1,10}(?:_\d{1,10})?", re.ASCII)  # a job, or one task of an array job (123_4)
_JOB_DELAY = re.compile(r"\d{1,10}(?:_\d{1,10})?(?:\+\d{1,7})?", re.ASCII)


def parse_dependency(text: str) -> str:
    """sbatch --dependency, checked item by item (sbatch reports only "Job dependency problem")."""
    t = text.strip()
    if not t:
        raise ValueError(f"an empty dependency; use {DEPENDENCY_FORMS}")
    if "," in t and "?" in t:
        raise ValueError(f"{t!r} mixes ',' (all of) and '?' (any of): SLURM allows one separator per dependency")
    for item in re.split(r"[,?]", t):
        if item == "singleton":
            continue
        kind, sep, jobs = item.partition(":")
        if kind not in DEPENDENCY_TYPES or not sep:
            hint = f" (did you mean {kind.lower()!r}?)" if kind.lower() in DEPENDENCY_TYPES else ""
            raise ValueError(f"{item[:80]!r} is not a dependency{hint}: use {DEPENDENCY_FORMS}")
        pattern = _JOB_DELAY if kind == "after" else _JOB
        for job in jobs.split(":"):
            if not pattern.fullmatch(job):
                raise ValueError(
                    f"{item[:80]!r}: {job[:40]!r} is not a job id"
                    + (" (with an optional +MINUTES)" if kind == "after" else "")
                    + f"; use {DEPENDENCY_FORMS}"
                )
    return t


# ----------------------------------------------------------------------------- mail

MAIL_TYPES = (
    "NONE",
    "BEGIN",
    "END",
    "FAIL",
    "REQUEUE",
    "ALL",
    "INVALID_DEPEND",
    "STAGE_OUT",
    "TIME_LIMIT",
    "TIME_LIMIT_90",
    "TIME_LIMIT_80",
    "TIME_LIMIT_50",
    "ARRAY_TASKS",
)


def parse_mail_types(value: str | list) -> list[str]:
    """sbatch --mail-type: a list (or comma-separated text) of SLURM's event names, case as SLURM prints them."""
    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, list) or not items:
        raise ValueError("mail_type is a list of events, e.g. [END, FAIL]")
    out: list[str] = []
    for it in items:
        if not isinstance(it, str) or it.strip().upper() not in MAIL_TYPES:
            from ...recipe.fields import suggest

            raise ValueError(
                f"{str(it)[:40]!r} is not a SLURM mail type{suggest(str(it).upper(), MAIL_TYPES)}; "
                f"known: {', '.join(MAIL_TYPES)}"
            )
        name = it.strip().upper()
        if name not in out:
            out.append(name)
    return out


# ----------------------------------------------------------------------------- extra #SBATCH options

# --name[=value | value] or -X[value | value]: what the job script can write as an #SBATCH line (render refuses
# an entry that is not an option; a bare `-` or `--` would be a line sbatch refuses after the job is queued).
_SBATCH_OPTION = re.compile(r"--[A-Za-z][A-Za-z0-9-]*(?:[=\s].*)?|-[A-Za-z].*", re.ASCII | re.S)


def parse_sbatch_option(entry: str, *, submitit: bool = False) -> str:
    """One targets.slurm.extra_sbatch entry, refused here (located) if the job script or submitit's parameters
    cannot carry it: submitit writes `--name=value` pairs only (`submitit_value` for the rest)."""
    e = entry.strip()
    if not _SBATCH_OPTION.fullmatch(e):
        raise FieldError(
            f"{e[:80]!r} is not an sbatch option",
            "start each entry with -- and the option's name, e.g. --comment=nightly (or a one-letter "
            "option, e.g. -w node1)",
        )
    if submitit:
        if not e.startswith("--") or any(c.isspace() for c in e.partition("=")[0]):
            raise FieldError(
                f"{e[:80]!r}: submitit writes long options only, as --name=value",
                "use the long form, e.g. --nodelist=node1 instead of -w node1, or targets.slurm.submit: sbatch",
            )
        submitit_value(e)
    return entry


def submitit_value(value: str) -> str:
    """A value submitit writes into an #SBATCH line: it quotes with shlex.quote, and sbatch still reads a
    backslash inside those single quotes as an escape."""
    if "\\" in value:
        raise FieldError(
            f"{value[:80]!r} contains a backslash, which sbatch reads as an escape even inside the "
            "single quotes submitit writes",
            "remove the backslash, or use targets.slurm.submit: sbatch",
        )
    return value
