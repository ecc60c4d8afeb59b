"""A recipe's schema errors as Problems: every mistake at once, each located (file or `--set` item, line,
field) and said in the recipe's words with a fix.

msgspec stops at the first mistake and says it in its own words ("Expected `int` >= 1 - at `$.training.steps`").
So `collect` reads the path and the kind of each error, rewords it, then takes the mistaken value out of a
copy of the document (its field falls back to its default) and converts again, until the copy converts or a
required field is missing. Imported only when a recipe has a mistake.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any

import msgspec

from ..errors import Problem
from .fields import ONE_LINE, suggest
from .limits import MAX_DEPTH, MAX_PROBLEMS, Path_, dotted
from .schema import Recipe, parse

MAX_ROUNDS = 200  # conversions of the copy, at most: a bound on the work a hostile recipe can cause
_PATH = re.compile(r"\$((?:\.[A-Za-z_][A-Za-z0-9_]*|\[\d+\]|\[\.\.\.\])*)", re.ASCII)
_STEP = re.compile(r"\.([A-Za-z_][A-Za-z0-9_]*)|\[(\d+)\]|\[\.\.\.\]", re.ASCII)

_TYPE_FIX = {
    "int": "give a whole number, e.g. 8",
    "float": "give a number, e.g. 0.4",
    "finite": "give a finite number (not .inf or .nan)",
    "bool": "give true or false",
    "str": "give a text value (quote it if it looks like a number)",
    "object": "give a mapping of key: value lines",
    "array": "give a list, e.g. [A, B]",
}
_TYPE_WORDS = {
    "int": "a whole number",
    "float": "a number",
    "str": "text",
    "bool": "true/false",
    "object": "a mapping",
    "array": "a list",
    "null": "null (nothing)",
}


def _words(spelled: str) -> str:
    """msgspec's `int | str | null` in the recipe's words."""
    parts = [_TYPE_WORDS.get(t.strip(), t.strip()) for t in spelled.split("|")]
    return " or ".join(dict.fromkeys(parts))


def _split(err: msgspec.ValidationError) -> tuple[str, Path_, BaseException | None]:
    """(message, path, the check's own exception) of one msgspec error. A check's message is the exception's
    text, so a user's value inside it cannot be mistaken for the location that msgspec appends."""
    text, cause = str(err), err.__cause__
    msg, loc = text, ""
    if cause is not None and text.startswith(str(cause)):
        msg, rest = str(cause), text[len(str(cause)) :]
        loc = rest[len(" - at `") : -1] if rest.startswith(" - at `") else ""
    elif m := re.fullmatch(r"(.*) - at `key` in `(\$[^`]*)`", text, re.S):
        got = re.search(r"got `([^`]*)`", m.group(1))  # e.g. `1: x` under env
        msg, loc = "a key must be text" + (f", not {_words(got.group(1))}" if got else ""), m.group(2)
    else:
        head, sep, tail = text.rpartition(" - at `")
        if sep and tail.endswith("`") and _PATH.fullmatch(tail[:-1]):
            msg, loc = head, tail[:-1]
    path: list = []
    for m in _STEP.finditer(loc[1:] if loc.startswith("$") else ""):
        if m.group(1) is not None:
            path.append(m.group(1))
        elif m.group(2) is not None:
            path.append(int(m.group(2)))
        else:
            break  # a mapping's key: the mapping is the place to point at
    return msg, tuple(path), cause


@functools.cache
def _schema() -> Any:
    """The recipe's schema as msgspec.inspect describes it (built once: the search asks it every round)."""
    import msgspec.inspect as mi

    return mi.type_info(Recipe)


def _alternatives(t: Any) -> list:
    """The plain types a schema type stands for, in order: descriptions unwrapped, unions flattened."""
    import msgspec.inspect as mi

    out, todo = [], [t]
    while todo:
        t = todo.pop()
        if isinstance(t, mi.Metadata):
            todo.append(t.type)
        elif isinstance(t, mi.UnionType):
            todo.extend(reversed(t.types))
        elif t is not None:
            out.append(t)
    return out


def _type_at(path: Path_) -> Any:
    """The schema's type (msgspec.inspect) at a field path, or None."""
    import msgspec.inspect as mi

    t: Any = _schema()
    for part in path:
        t = next((x for x in _alternatives(t) if isinstance(x, (mi.StructType, mi.ListType, mi.TupleType))), None)
        if isinstance(part, int) and isinstance(t, mi.ListType):
            t = t.item_type
        elif isinstance(part, int) and isinstance(t, mi.TupleType):
            t = t.item_types[part] if part < len(t.item_types) else None
        elif isinstance(part, str) and isinstance(t, mi.StructType):
            t = next((f.type for f in t.fields if f.encode_name == part), None)
        else:
            return None
    return t


def _struct_at(path: Path_) -> Any:
    import msgspec.inspect as mi

    return next((x for x in _alternatives(_type_at(path)) if isinstance(x, mi.StructType)), None)


def _keys_at(path: Path_) -> list[str]:
    s = _struct_at(path)
    return [f.encode_name for f in s.fields] if s is not None else []


def _missing_keys(data: Any, path: Path_) -> list[str]:
    s, have = _struct_at(path), _value_at(data, path)
    if s is None or not isinstance(have, dict):
        return []
    return [f.encode_name for f in s.fields if f.required and f.encode_name not in have]


def _takes_int(path: Path_) -> bool:
    import msgspec.inspect as mi

    return any(isinstance(x, mi.IntType) for x in _alternatives(_type_at(path)))


def _choices_at(path: Path_) -> tuple:
    import msgspec.inspect as mi

    return tuple(v for x in _alternatives(_type_at(path)) if isinstance(x, mi.LiteralType) for v in x.values)


_MISSING = object()


def _value_at(data: Any, path: Path_) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


def _got(v: Any) -> str:
    r = repr(v)
    return f" (got {r[:80] + '...' if len(r) > 80 else r})" if v is not _MISSING else ""


def _message(err: msgspec.ValidationError, data: Any) -> tuple[Path_, str, str | None, str]:
    """(field path, what is wrong, what to do, kind) of one msgspec error, in the recipe's words. The kind is
    "missing" (a required field), "section" (a check across a section's fields) or "field"."""
    msg, path, cause = _split(err)
    if cause is not None:
        field = getattr(cause, "field", None)
        where = field if isinstance(field, tuple) else (field,)  # a field, or a path to one entry of it
        return (path + where if field else path), msg, getattr(cause, "fix", None), "field" if field else "section"
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", msg, re.S):
        key = m.group(1)
        names = _keys_at(path)
        return (
            path + (key,),
            f"unknown key {key!r}{suggest(key, names)}",
            "allowed keys here: " + ", ".join(names) if names else "remove it",
            "field",
        )
    if m := re.fullmatch(r"Object missing required field `(.*)`", msg, re.S):
        return path + (m.group(1),), "required field is missing", f"add `{m.group(1)}:`", "missing"
    return (path, *_value_message(msg, path, _value_at(data, path)), "field")


def _value_message(msg: str, path: Path_, value: Any) -> tuple[str, str | None]:
    """(what is wrong, what to do) for a value msgspec refused."""
    if m := re.fullmatch(r"Invalid enum value (.*)", msg, re.S):
        choices = _choices_at(path)
        v = value if value is not _MISSING else m.group(1)
        listed = ("one of " if len(choices) > 1 else "") + ", ".join(map(repr, choices))
        if _takes_int(path):  # e.g. grad_accum: a number or 'auto'
            listed = "a whole number or " + listed
        return (
            f"{str(v)[:80]!r} is not {listed}{suggest(v, choices)}" if choices else msg,
            "use one of the listed values",
        )
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number{_got(value)}", _TYPE_FIX["finite"]
    if m := re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", msg):
        want = m.group(1)
        return f"expected {_words(want)}, not {_words(m.group(2))}{_got(value)}", _TYPE_FIX.get(want.split(" | ")[0])
    if m := re.fullmatch(r"Expected `(\w+)` (>=|>|<=|<) (\S+)", msg):
        return f"must be {m.group(2)} {m.group(3)}{_got(value)}", None
    if m := re.fullmatch(r"Expected `array` of length (\d+), got (\d+)", msg):
        return (
            f"expected a list of {m.group(1)} items, got {m.group(2)}",
            "give a list of two numbers, e.g. [0.9, 0.95]" if m.group(1) == "2" else None,
        )
    if m := re.fullmatch(r"Expected `(str|array|object)` of length (<=|>=) (\d+)", msg):
        n = len(value) if isinstance(value, (str, list, dict)) else None
        what = {"str": "characters", "array": "items", "object": "entries"}[m.group(1)]
        most = "at most" if m.group(2) == "<=" else "at least"
        return f"{most} {int(m.group(3)):,} {what}" + (f", got {n:,}" if n is not None else ""), None
    if m := re.fullmatch(r"Expected `str` matching regex '(.*)'", msg, re.S):
        if m.group(1) in (ONE_LINE, repr(ONE_LINE)[1:-1]):  # msgspec prints the pattern as its repr
            return (
                "must be a single line (no line break or NUL): it goes into an #SBATCH line of the job script",
                "write it on one line",
            )
        return f"should match pattern {m.group(1)!r}{_got(value)}", None
    return msg, None


def _problem(
    path: Path_, msg: str, fix: str | None, source: str, lines: dict[Path_, int], overrides: list[tuple[Path_, str]]
) -> Problem:
    field = dotted(path)
    if fix is None:
        fix = f"see the `{path[-1] if path else 'recipe'}` entry of `dtlaunch schema` for what this field accepts"
    # An error inside a value that --set gave belongs to that --set item, not to a line of the file.
    for opath, item in reversed(overrides):
        if path[: len(opath)] == opath:
            return Problem(f"--set {item[:200]}", field, msg, fix)
    touched = [item for opath, item in overrides if opath[: len(path)] == path and path]
    if touched:
        msg += f" (after --set {', --set '.join(t[:80] for t in touched)})"
    line = None
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            line = lines[path[:n]]
            break
    return Problem(source, field, msg, fix, line)


def _unshared(v: Any, depth: int = 0) -> Any:
    """A copy in which no two places share a mapping or list (a YAML alias shares one): taking a mistake out
    of one place must leave the others as written. The loader has bounded the document's size; a `--set`
    value that refers to itself stays shared below the recipe's depth bound."""
    if depth > 2 * MAX_DEPTH:
        return v
    if isinstance(v, dict):
        return {k: _unshared(x, depth + 1) for k, x in v.items()}
    if isinstance(v, list):
        return [_unshared(x, depth + 1) for x in v]
    return v


def _take_out(work: Any, path: Path_, removed: set[Path_], original: Path_) -> bool:
    """Delete the value at `path` (its field falls back to its default); False if there is none to delete.
    `removed` records it at its `original` place (the document's, before any list item was taken out)."""
    parent = _value_at(work, path[:-1]) if path else _MISSING
    if not path or not isinstance(parent, dict) or path[-1] not in parent:
        return False
    del parent[path[-1]]
    removed.add(original)
    return True


def _original(path: Path_, kept: dict[Path_, list[int]]) -> Path_:
    """A path in the working copy as a path in the document: a list some items were taken out of has its
    remaining items' original indices in `kept` (keyed by the list's own original path)."""
    out: Path_ = ()
    for part in path:
        if isinstance(part, int) and out in kept and part < len(kept[out]):
            part = kept[out][part]
        out = (*out, part)
    return out


def _take_out_item(work: Any, path: Path_, kept: dict[Path_, list[int]]) -> bool:
    """Take one bad item out of its list, so that the list's other items are still checked; False when it is
    the last item (an empty list may break the list's own rules: the list goes instead)."""
    items = _value_at(work, path[:-1])
    i = path[-1]
    if not isinstance(items, list) or not 0 <= i < len(items) or len(items) < 2:
        return False
    where = _original(path[:-1], kept)
    del items[i]
    del kept.setdefault(where, list(range(len(items) + 1)))[i]
    return True


def _take_out_mistake(work: Any, wpath: Path_, kept: dict[Path_, list[int]], removed: set[Path_], alone: bool) -> bool:
    """Take out a refused value: a list item alone if it can go alone, else its field (the whole list)."""
    if alone and wpath and isinstance(wpath[-1], int) and _take_out_item(work, wpath, kept):
        return True
    cut = wpath
    while cut and not isinstance(cut[-1], str):
        cut = cut[:-1]
    return _take_out(work, cut, removed, _original(cut, kept))


def collect(
    data: Any, first: msgspec.ValidationError, source: str, lines: dict[Path_, int], overrides: list[tuple[Path_, str]]
) -> tuple[list[Problem], int]:
    """Every mistake in the document: report one, take its value out of a copy, convert again. A bad list
    item goes alone, so the next bad item of the same list is reported too; paths in the copy are mapped
    back to the document's (its lines, its indices) before they are reported."""
    work = _unshared(data)
    out: list[Problem] = []
    seen: set[Path_] = set()
    removed: set[Path_] = set()  # original paths
    standins: set[Path_] = set()  # required sections the search took out and put back empty (original paths)
    kept: dict[Path_, list[int]] = {}
    err = first
    for _ in range(MAX_ROUNDS):
        wpath, msg, fix, kind = _message(err, work)
        path = _original(wpath, kept)
        if any(path[: len(s)] == s for s in standins):
            break  # an empty stand-in is not valid either: nothing more can be learned
        if kind == "missing":
            parent = _value_at(work, wpath[:-1])
            if path in removed and isinstance(parent, dict):
                # The search took out a required section after a check across its fields failed; an empty
                # one (its defaults) lets it go on to the other sections.
                parent[wpath[-1]] = {}
                standins.add(path)
            else:
                # Every required field of that section that is missing; then the section goes, unless it is
                # the recipe itself: nothing can stand in for what the recipe lacks.
                for key in _missing_keys(work, wpath[:-1]) or [path[-1]]:
                    where = path[:-1] + (key,)
                    if where not in removed and where not in seen:
                        seen.add(where)
                        out.append(_problem(where, msg, f"add `{key}:`", source, lines, overrides))
                if not _take_out(work, wpath[:-1], removed, path[:-1]):
                    break
        else:
            # A section's check that names a field taken out of it failed because of that: nothing new.
            consequence = kind == "section" and any(
                r[: len(path)] == path and len(r) == len(path) + 1 and re.search(rf"\b{re.escape(str(r[-1]))}\b", msg)
                for r in removed
            )
            # So did a list's own rule (its length) once items were taken out of it.
            consequence = consequence or path in kept
            if path not in seen and not consequence:
                seen.add(path)
                out.append(_problem(path, msg, fix, source, lines, overrides))
            if not _take_out_mistake(work, wpath, kept, removed, alone=not consequence):
                break
        try:
            parse(work)
            break
        except msgspec.ValidationError as e:
            err = e
    return out[:MAX_PROBLEMS], len(out[MAX_PROBLEMS:])
