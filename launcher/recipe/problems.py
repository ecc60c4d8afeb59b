"""A recipe's schema errors as Problems: every mistake at once, each located (file or `--set` item, line,
field) and said in the recipe's words with a fix.

msgspec converts the recipe on every command and stops at its first mistake. When there is one, pydantic
checks the document once more against the same schema and reports every mistake with a structured location,
kind and bounds: a pydantic model is derived from each section's struct (msgspec.inspect), its values coerced
by msgspec's own rules. The sections' own checks (their `__post_init__`: a known accelerator, a SLURM time)
then run on what the types let through. Imported only when a recipe has a mistake, so a recipe without one
pays for neither pydantic's import nor the models' build.
"""

from __future__ import annotations

import functools
import math
import re
import types
from typing import Annotated, Any, Literal, Union

import msgspec
import msgspec.inspect as mi
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, Strict, ValidationError, create_model

from ..errors import Problem
from .fields import ONE_LINE, suggest
from .limits import MAX_PROBLEMS, Path_, dotted
from .schema import Recipe

_KINDS: dict[type, tuple[str, str | None]] = {  # a schema type: (in words, the fix for another type)
    mi.IntType: ("a whole number", "give a whole number, e.g. 8"),
    mi.FloatType: ("a number", "give a number, e.g. 0.4"),
    mi.BoolType: ("true/false", "give true or false"),
    mi.StrType: ("text", "give a text value (quote it if it looks like a number)"),
    mi.StructType: ("a mapping", "give a mapping of key: value lines"),
    mi.DictType: ("a mapping", "give a mapping of key: value lines"),
    mi.ListType: ("a list", "give a list, e.g. [A, B]"),
    mi.VarTupleType: ("a list", "give a list, e.g. [A, B]"),
    mi.TupleType: ("a list", "give a list, e.g. [A, B]"),
    mi.NoneType: ("null (nothing)", None),
}
_VALUE_WORDS = {bool: "true/false", int: "a whole number", float: "a number", str: "text", dict: "a mapping"}
_VALUE_WORDS |= {list: "a list", tuple: "a list", type(None): "null (nothing)"}
_MISSING = object()
UNSURE = "see `dtlaunch schema` for what each field accepts"  # the fix of a mistake only msgspec found


# ----------------------------------------------------------------------------- the schema, for pydantic


class _Section(BaseModel):
    # Python's re: the schema's patterns end with \Z, which pydantic's default (Rust) engine does not know.
    model_config = ConfigDict(extra="forbid", regex_engine="python-re")


def _coerced(kind: type) -> BeforeValidator:
    """What msgspec converts to `kind` (strict=False: numbers and booleans YAML left as text, 1.0 as 1, 1 as
    true), converted the same way; anything else is left for the strict check to name its type."""

    def coerce(v: Any) -> Any:
        try:
            return msgspec.convert(v, kind, strict=False)
        except msgspec.ValidationError:
            return v

    return BeforeValidator(coerce)


def _annotation(t: Any) -> Any:
    """The pydantic annotation of a msgspec.inspect type: the same types, bounds and patterns."""
    if isinstance(t, mi.Metadata):
        return _annotation(t.type)
    if isinstance(t, (mi.IntType, mi.FloatType)):
        kind = int if isinstance(t, mi.IntType) else float
        bounds = Field(ge=t.ge, gt=t.gt, le=t.le, lt=t.lt, multiple_of=t.multiple_of)
        return Annotated[kind, _coerced(kind), Strict(), bounds]
    if isinstance(t, mi.BoolType):
        return Annotated[bool, _coerced(bool), Strict()]
    if isinstance(t, mi.StrType):
        return Annotated[str, Strict(), Field(min_length=t.min_length, max_length=t.max_length, pattern=t.pattern)]
    if isinstance(t, mi.NoneType):
        return None
    if isinstance(t, mi.LiteralType):
        return Literal.__getitem__(tuple(t.values))
    if isinstance(t, mi.UnionType):
        return Union.__getitem__(tuple(_annotation(x) for x in t.types))
    if isinstance(t, (mi.ListType, mi.VarTupleType)):
        sized = Field(min_length=t.min_length, max_length=t.max_length)
        return Annotated[list[_annotation(t.item_type)], sized]  # type: ignore[misc]
    if isinstance(t, mi.TupleType):
        return tuple.__class_getitem__(tuple(_annotation(x) for x in t.item_types))
    if isinstance(t, mi.DictType):
        sized = Field(min_length=t.min_length, max_length=t.max_length)
        return Annotated[dict[_annotation(t.key_type), _annotation(t.value_type)], sized]  # type: ignore[misc]
    if isinstance(t, mi.StructType):
        return _model(t.cls)
    return Any


@functools.cache
def _model(cls: type) -> type[BaseModel]:
    """A pydantic model of a section struct: its fields by the names a recipe spells (aliases, so a field
    named like a BaseModel attribute cannot clash), required where the struct requires them."""
    fields: dict[str, Any] = {}
    info: Any = mi.type_info(cls)
    for i, f in enumerate(info.fields):
        fields[f"f{i}"] = (_annotation(f.type), Field(... if f.required else None, alias=f.encode_name))
    return create_model(cls.__name__, __base__=_Section, **fields)


@functools.cache
def _schema() -> Any:
    return mi.type_info(Recipe)


def _alternatives(t: Any) -> list:
    """The plain types a schema type stands for, in order: descriptions unwrapped, unions flattened."""
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


def _step(t: Any, part: Any) -> Any:
    """The schema type one step below `t` at `part` (a field, an index, a key), or _MISSING when `part` is not
    a step of the document (pydantic's name for a union member it tried)."""
    for x in _alternatives(t):
        if isinstance(x, mi.StructType) and isinstance(part, str):
            for f in x.fields:
                if f.encode_name == part:
                    return f.type
        elif isinstance(x, (mi.ListType, mi.VarTupleType)) and isinstance(part, int):
            return x.item_type
        elif isinstance(x, mi.TupleType) and isinstance(part, int):
            return x.item_types[part] if part < len(x.item_types) else mi.AnyType()
        elif isinstance(x, mi.DictType) and part != "[key]":
            return x.value_type
    return _MISSING


def _place(loc: tuple, unknown_key: bool) -> Path_:
    """The field path in the document of a pydantic location: its steps through the schema, without the names
    of the union members pydantic tried; a mapping's bad key ends in "[key]"; an unknown key is no step."""
    path: list = []
    t: Any = _schema()
    for i, part in enumerate(loc):
        below = _step(t, part)
        if part == "[key]" or unknown_key and i == len(loc) - 1:
            path.append(part)
        elif below is not _MISSING:
            path.append(part)
            t = below
    return tuple(path)


def _type_at(path: Path_) -> Any:
    """The schema's type at a field path (None past the schema)."""
    t: Any = _schema()
    for part in path:
        t = _step(t, part)
        if t is _MISSING:
            return None
    return t


def _value_at(data: Any, path: Path_) -> Any:
    for part in path:
        try:
            data = data[part]
        except (KeyError, IndexError, TypeError):
            return _MISSING
    return data


# ----------------------------------------------------------------------------- errors in the recipe's words


def _got(v: Any) -> str:
    r = repr(v)
    return f" (got {r[:80] + '...' if len(r) > 80 else r})" if v is not _MISSING else ""


_BOUND = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
_SIZE = ("string_too_long", "string_too_short", "too_long", "too_short")


def _say(errors: list[dict], path: Path_, data: Any) -> tuple[Path_, str, str | None]:
    """(where, what is wrong, what to do) of the errors pydantic reported at one place: one error, or one per
    type it tried when the field takes one of several."""
    kinds = {e["type"]: e for e in errors}
    if "extra_forbidden" in kinds:
        names = [
            f.encode_name for x in _alternatives(_type_at(path[:-1])) if isinstance(x, mi.StructType) for f in x.fields
        ]
        allowed = "allowed keys here: " + ", ".join(names) if names else "remove it"
        return path, f"unknown key {path[-1]!r}{suggest(path[-1], names)}", allowed
    if path and path[-1] == "[key]":  # a mapping's key (after the key itself): the mapping is the place
        return path[:-2], f"a key must be text, not {_words(errors[0]['input'])}", "quote the key"
    if "missing" in kinds and path and isinstance(path[-1], int) and _tuple_of(path[:-1]):
        path = path[:-1]  # a missing item of a fixed-length list: the list is what is short
    if n := _tuple_of(path):
        if kinds.keys() & {"missing", "too_long", "too_short"}:
            got = _value_at(data, path)
            got_n = f", got {len(got)}" if isinstance(got, (list, tuple)) else ""
            two = "give a list of two numbers, e.g. [0.9, 0.95]" if n == 2 else None
            return path, f"expected a list of {n} items{got_n}", two
    if "missing" in kinds:
        return path, "required field is missing", f"add `{path[-1]}:`"
    value = _value_at(data, path)
    said = _bad_value(kinds, value) or _bad_type(_alternatives(_type_at(path)), value)
    return (path, *said)


def _tuple_of(path: Path_) -> int:
    """The length of the fixed-length list the schema has at `path`, or 0."""
    return next((len(x.item_types) for x in _alternatives(_type_at(path)) if isinstance(x, mi.TupleType)), 0)


def _bad_value(kinds: dict[str, dict], value: Any) -> tuple[str, str | None] | None:
    """A value of the right type out of its bounds, its pattern or its size."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number{_got(value)}", "give a finite number (not .inf or .nan)"
    for kind, e in kinds.items():
        ctx = e.get("ctx") or {}
        if kind in _BOUND:
            return f"must be {_BOUND[kind]} {next(iter(ctx.values()))}{_got(value)}", None
        if kind == "string_pattern_mismatch" and ctx["pattern"] == ONE_LINE:
            why = "must be a single line (no line break or NUL): it goes into an #SBATCH line of the job script"
            return why, "write it on one line"
        if kind == "string_pattern_mismatch":
            return f"should match pattern {ctx['pattern']!r}{_got(value)}", None
        if kind in _SIZE:
            what = "characters" if isinstance(value, str) else "entries" if isinstance(value, dict) else "items"
            most = "at most" if kind.endswith("long") else "at least"
            n = f", got {len(value):,}" if isinstance(value, (str, list, dict)) else ""
            return f"{most} {ctx.get('max_length', ctx.get('min_length')):,} {what}{n}", None
    return None


def _bad_type(alts: list, value: Any) -> tuple[str, str | None]:
    """A value that is none of the types (or listed values) the field takes."""
    choices = tuple(v for x in alts if isinstance(x, mi.LiteralType) for v in x.values)
    if choices and isinstance(value, str):
        listed = ("one of " if len(choices) > 1 else "") + ", ".join(map(repr, choices))
        if any(isinstance(x, mi.IntType) for x in alts):  # e.g. grad_accum: a number or 'auto'
            listed = "a whole number or " + listed
        return f"{value[:80]!r} is not {listed}{suggest(value, choices)}", "use one of the listed values"
    words = [repr(v) for x in alts if isinstance(x, mi.LiteralType) for v in x.values]
    words += [_KINDS.get(type(x), ("a value", None))[0] for x in alts if not isinstance(x, mi.LiteralType)]
    fix = next((_KINDS[type(x)][1] for x in alts if type(x) in _KINDS), "use one of the listed values")
    return f"expected {' or '.join(dict.fromkeys(words))}, not {_words(value)}{_got(value)}", fix


def _words(value: Any) -> str:
    return _VALUE_WORDS.get(type(value), type(value).__name__)


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
    line = next((lines[path[:n]] for n in range(len(path), -1, -1) if path[:n] in lines), None)
    return Problem(source, field, msg, fix, line)


# ----------------------------------------------------------------------------- the mistakes, all of them


def _type_errors(data: Any) -> list[tuple[Path_, str, str | None]]:
    """(where, what is wrong, what to do) of every value of a wrong type, out of bounds or unknown, in order."""
    try:
        _model(Recipe).model_validate(data)
        return []
    except ValidationError as e:
        errors = e.errors(include_url=False)
    places: dict[Path_, list] = {}
    for err in errors:
        places.setdefault(_place(err["loc"], err["type"] == "extra_forbidden"), []).append(err)
    return [_say(errs, path, data) for path, errs in places.items()]


def _section_checks(node: Any, cls: type, path: Path_, found: list) -> Any:
    """The section at `path` built from `node`, its own check and its sections' checks run. A value of a wrong
    type (reported already) falls back to its default; each check that fails is added to `found` as (path,
    exception, the fields that fell back). Returns the section, a stand-in with its fields when its check
    failed (so the enclosing section's check runs too), or _MISSING when a required field has no usable value."""
    if not isinstance(node, dict):
        return _MISSING
    values: dict[str, Any] = {}
    fields = _fields(cls)
    fell_back: list[str] = []
    for name, (f, inner, items) in fields.items():
        v = _field_value(node.get(name, _MISSING), f, inner, items, (*path, name), found)
        if v is _MISSING:
            if f.required:
                return _MISSING
            v = _default(f)
            if name in node:
                fell_back.append(name)
        values[f.name] = v
    # A check stops at its first complaint: the field it names falls back to its default and the check runs
    # again, so that the section's other complaints are reported too.
    for _ in range(len(fields) + 1):
        try:
            return cls(**values)
        except ValueError as e:
            found.append((path, e, tuple(fell_back)))
            named = getattr(e, "field", None)
            f = fields.get(named[0] if isinstance(named, tuple) else named, (None,))[0]  # type: ignore[arg-type]
            if f is None or f.required or values[f.name] == _default(f):
                break
            values[f.name] = _default(f)
            fell_back.append(f.encode_name)
        except Exception:  # a check reading a section that is only a stand-in: that section's error is reported
            break
    return types.SimpleNamespace(**values)


@functools.cache
def _fields(cls: type) -> dict[str, tuple[Any, type | None, type | None]]:
    """A section's fields by the names a recipe spells: (the field, its section's struct if it is one, its items'
    struct if it is a list of sections)."""
    out = {}
    for f in msgspec.structs.fields(cls):
        t = mi.type_info(f.type)
        out[f.encode_name] = (f, _struct_of(t), _struct_of(_item_type(t)))
    return out


def _field_value(v: Any, f: Any, inner: type | None, items: type | None, path: Path_, found: list) -> Any:
    """A field's value as its section holds it (sections built and checked), or _MISSING."""
    if inner is not None and isinstance(v, dict):
        return _section_checks(v, inner, path, found)
    if items is not None and isinstance(v, list):
        built = [_section_checks(x, items, (*path, i), found) for i, x in enumerate(v)]
        return _MISSING if _MISSING in built else built
    try:
        return v if v is _MISSING else msgspec.convert(v, f.type, strict=False)
    except msgspec.ValidationError:
        return _MISSING


def _default(f: Any) -> Any:
    return f.default if f.default is not msgspec.NODEFAULT else f.default_factory()


def _struct_of(t: Any) -> type | None:
    return next((x.cls for x in _alternatives(t) if isinstance(x, mi.StructType)), None)


def _item_type(t: Any) -> Any:
    return next((x.item_type for x in _alternatives(t) if isinstance(x, (mi.ListType, mi.VarTupleType))), None)


def collect(
    data: Any, first: msgspec.ValidationError, source: str, lines: dict[Path_, int], overrides: list[tuple[Path_, str]]
) -> tuple[list[Problem], int]:
    """Every mistake in the document: the values pydantic refuses, then the sections' checks."""
    found = _type_errors(data)
    checks: list = []
    _section_checks(data, Recipe, (), checks)
    for path, e, fell_back in checks:
        if field := getattr(e, "field", None):
            found.append(((*path, *(field if isinstance(field, tuple) else (field,))), str(e), e.fix))
        # A section's check that names a field which fell back to its default failed because of that.
        elif not any(re.search(rf"\b{re.escape(name)}\b", str(e)) for name in fell_back):
            found.append((path, str(e), getattr(e, "fix", None)))
    if not found:  # the two disagree on what is wrong: msgspec's own words, at the top
        found.append(((), str(first), UNSURE))
    out: dict[Path_, Problem] = {}
    for path, msg, fix in found:
        out.setdefault(path, _problem(path, msg, fix, source, lines, overrides))
    # in the file's order (pydantic reports in the schema's), the --set items' after it
    problems = sorted(out.values(), key=lambda p: (p.line is None, p.line or 0))
    return problems[:MAX_PROBLEMS], len(problems[MAX_PROBLEMS:])
