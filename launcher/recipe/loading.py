"""Reading a recipe: bounded in size, depth and expansion, strict about YAML's surprises, every error located.

The loader is the first thing hostile or mistyped input meets, so every step has a fixed bound: a regular
file of at most MAX_BYTES, at most MAX_DEPTH levels of nesting (libyaml's composer recurses in C and
crashed this process at ~100,000 levels), at most MAX_VALUES values after YAML aliases are expanded (a
300-byte "billion laughs" document expands to 9^9 values), duplicate keys refused rather than silently
overwritten, and at most MAX_PROBLEMS problems listed. Each problem names the file (or the `--set` item),
the line, the field, what is wrong and a fix.
"""
from __future__ import annotations

import copy
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import yaml

from ..errors import Problem, RecipeError
from .fields import ONE_LINE, suggest
from .schema import Recipe, parse

MAX_BYTES = 1 << 20  # a recipe is a page of YAML; 1 MiB leaves room for long env or setup lists
MAX_DEPTH = 32
MAX_VALUES = 20_000
MAX_PROBLEMS = 20
MAX_OVERRIDE_BYTES = 64 * 1024

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: 5-10x faster
_OPEN = ("BlockMappingStartToken", "BlockSequenceStartToken", "FlowMappingStartToken", "FlowSequenceStartToken")
_CLOSE = ("BlockEndToken", "FlowMappingEndToken", "FlowSequenceEndToken")

Path_ = tuple  # a field path, e.g. ("training", "steps") or ("env", "X") or ("secrets", 0)


@dataclass(frozen=True)
class SourceMap:
    """Where each field of a loaded recipe came from, so findings made later (validate) name file and line,
    or the `--set` item that gave the value."""

    file: str
    lines: dict
    overrides: tuple = ()  # ((path, "KEY=VALUE"), ...)
    base_dir: str | None = None  # the recipe file's directory: relative paths in it (entrypoint.workdir) start here

    def locate(self, field: str) -> tuple[str, int | None]:
        path = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        for opath, item in reversed(self.overrides):
            if path[:len(opath)] == opath:
                return f"--set {item[:200]}", None
        for n in range(len(path), -1, -1):
            if path[:n] in self.lines:
                return self.file, self.lines[path[:n]]
        return self.file, None


def _fail(source: str, message: str, line: int | None = None, fix: str | None = None, field: str = "(file)"):
    raise RecipeError([Problem(source, field, message, fix, line)])


# ----------------------------------------------------------------------------- YAML, bounded


def _check_depth(text: str, source: str) -> None:
    """Scan the tokens (libyaml's scanner is iterative) and stop at the first level past MAX_DEPTH."""
    loader = _Loader(text)
    try:
        depth = 0
        while loader.check_token():
            tok = loader.get_token()
            name = type(tok).__name__
            if name in _OPEN:
                depth += 1
                if depth > MAX_DEPTH:
                    _fail(source, f"the YAML is nested more than {MAX_DEPTH} levels deep",
                          tok.start_mark.line + 1, "a recipe is a few sections of key: value lines; flatten it")
            elif name in _CLOSE:
                depth -= 1
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, node) of one YAML document, within the depth bound; YAML errors become located Problems."""
    if "\x00" in text:
        _fail(source, "this is not a text YAML file (it contains NUL bytes)", fix="point dtlaunch at a recipe .yaml file")
    try:
        _check_depth(text, source)
        loader = _Loader(text)
        try:
            node = loader.get_single_node()
            data = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
        problem = getattr(e, "problem", None) or str(e)
        _fail(source, f"YAML syntax error: {problem}", mark.line + 1 if mark else None,
              "check indentation, colons and quotes on that line")
    except RecursionError:
        _fail(source, "the YAML refers to itself (a recursive alias)", fix="remove the alias (*name) that points at its own parent")
    return data, node


def _line_map(root: yaml.Node, source: str) -> dict[Path_, int]:
    """The YAML line of every field path, walking aliases as the data will be read, within MAX_VALUES.

    Also refuses duplicate keys (YAML would silently keep the last) and non-text keys.
    """
    lines: dict[Path_, int] = {}
    budget = MAX_VALUES
    stack: list[tuple[yaml.Node, Path_]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        budget -= 1
        if len(path) > MAX_DEPTH:  # only aliases can nest this deep now: the text itself was checked
            _fail(source, f"the recipe nests more than {MAX_DEPTH} levels deep through YAML aliases",
                  node.start_mark.line + 1, "remove the alias (*name) that refers to its own parent")
        if budget < 0:
            _fail(source, f"the recipe expands to more than {MAX_VALUES:,} values (YAML aliases expand each time "
                          "they are used)", node.start_mark.line + 1, "write the values out, or use fewer aliases (*name)")
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                line = k.start_mark.line + 1
                if not isinstance(k, yaml.ScalarNode):
                    _fail(source, "a key must be plain text, not a list or mapping", line, field=_dotted(path))
                key = k.value
                if key in seen and k.tag != "tag:yaml.org,2002:merge":
                    _fail(source, f"duplicate key {key!r} (first given at line {seen[key]}); YAML would silently keep "
                                  "only the last one", line, "keep one of them", field=_dotted(path + (key,)))
                seen[key] = line
                lines[path + (key,)] = line
                stack.append((v, path + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                stack.append((v, path + (i,)))
    return lines


def _dotted(path: Path_) -> str:
    return ".".join(str(p) for p in path) or "(top level)"


# ----------------------------------------------------------------------------- overrides


def parse_override(item: str) -> tuple[Path_, Any]:
    """`training.steps=10` -> (("training", "steps"), 10); the value is read as YAML, with the same bounds."""
    source = f"--set {item[:200]}"
    key, sep, raw = item.partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not sep or not key.strip() or any(not p for p in parts):
        _fail(source, "expected KEY=VALUE with a dotted KEY, e.g. --set training.steps=100", field=key.strip() or "(key)",
              fix="write --set SECTION.FIELD=VALUE")
    if len(raw.encode()) > MAX_OVERRIDE_BYTES:
        _fail(source, f"the value is longer than {MAX_OVERRIDE_BYTES:,} bytes", field=key.strip())
    if raw.strip() == "":
        _fail(source, "the value is empty", field=key.strip(),
              fix=f"give a value, e.g. --set {key.strip()}=VALUE, or --set {key.strip()}=null to unset it")
    try:
        value, _ = parse_yaml(raw, source)
    except RecipeError as e:
        if not e.problems[0].message.startswith("YAML syntax error"):
            raise
        value = raw  # not YAML (e.g. an unbalanced quote): the text as it is
    return parts, value


def _apply(data: dict, path: Path_, value: Any, item: str) -> None:
    cur = data
    for i, k in enumerate(path[:-1]):
        nxt = cur.get(k)
        if nxt is None:
            nxt = cur[k] = {}
        elif not isinstance(nxt, dict):
            _fail(f"--set {item[:200]}", f"{_dotted(path[:i + 1])} is a value, not a section: it has no field "
                                         f"{path[i + 1]!r}", field=_dotted(path), fix="check the key against `dtlaunch schema`")
        cur = nxt
    cur[path[-1]] = value


# ----------------------------------------------------------------------------- schema errors -> Problems

# msgspec stops at the first mistake. To list every mistake at once, the loader takes the mistake's value out
# of a copy of the document (its field falls back to its default) and converts again, up to this many times.
MAX_ROUNDS = 200
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
_TYPE_WORDS = {"int": "a whole number", "float": "a number", "str": "text", "bool": "true/false",
               "object": "a mapping", "array": "a list", "null": "null (nothing)"}


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
        msg, rest = str(cause), text[len(str(cause)):]
        loc = rest[len(" - at `"):-1] if rest.startswith(" - at `") else ""
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


def _type_at(path: Path_) -> Any:
    """The schema's type (msgspec.inspect) at a field path, or None."""
    import msgspec.inspect as mi

    t: Any = mi.type_info(Recipe)
    for part in path:
        while isinstance(t, (mi.Metadata, mi.UnionType)):
            if isinstance(t, mi.Metadata):
                t = t.type
            else:
                inner = [x for x in t.types if isinstance(x, (mi.StructType, mi.ListType, mi.Metadata))]
                if not inner:
                    return None
                t = inner[0]
        if isinstance(part, int) and isinstance(t, (mi.ListType, mi.TupleType)):
            t = t.item_type if isinstance(t, mi.ListType) else (t.item_types[part] if part < len(t.item_types)
                                                                else None)
        elif isinstance(t, mi.StructType):
            t = next((f.type for f in t.fields if f.encode_name == part), None)
        else:
            return None
    return t


def _keys_at(path: Path_) -> list[str]:
    import msgspec.inspect as mi

    t = _type_at(path)
    while isinstance(t, (mi.Metadata, mi.UnionType)):
        t = t.type if isinstance(t, mi.Metadata) else next(
            (x for x in t.types if isinstance(x, mi.StructType)), None)
    return [f.encode_name for f in t.fields] if isinstance(t, mi.StructType) else []


def _missing_keys(data: Any, path: Path_) -> list[str]:
    import msgspec.inspect as mi

    t, have = _type_at(path), _value_at(data, path)
    while isinstance(t, (mi.Metadata, mi.UnionType)):
        t = t.type if isinstance(t, mi.Metadata) else next((x for x in t.types if isinstance(x, mi.StructType)), None)
    if not isinstance(t, mi.StructType) or not isinstance(have, dict):
        return []
    return [f.encode_name for f in t.fields if f.required and f.encode_name not in have]


def _choices_at(path: Path_) -> tuple:
    import msgspec.inspect as mi

    found: list = []
    todo = [_type_at(path)]
    while todo:
        t = todo.pop()
        if isinstance(t, mi.Metadata):
            todo.append(t.type)
        elif isinstance(t, mi.UnionType):
            todo.extend(t.types)
        elif isinstance(t, mi.LiteralType):
            found.extend(t.values)
    return tuple(found)


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
    fix = None
    if cause is not None:
        field = getattr(cause, "field", None)
        return (path + (field,) if field else path), msg, getattr(cause, "fix", None), "field" if field else "section"
    value = _value_at(data, path)
    if m := re.fullmatch(r"Object contains unknown field `(.*)`", msg, re.S):
        key = m.group(1)
        names = _keys_at(path)
        return (path + (key,), f"unknown key {key!r}{suggest(key, names)}",
                "allowed keys here: " + ", ".join(names) if names else "remove it", "field")
    if m := re.fullmatch(r"Object missing required field `(.*)`", msg, re.S):
        return path + (m.group(1),), "required field is missing", f"add `{m.group(1)}:`", "missing"
    if m := re.fullmatch(r"Invalid enum value (.*)", msg, re.S):
        choices = _choices_at(path)
        v = value if value is not _MISSING else m.group(1)
        msg = f"{str(v)[:80]!r} is not one of {', '.join(map(repr, choices))}{suggest(v, choices)}" if choices else msg
        return path, msg, "use one of the listed values", "field"
    if isinstance(value, float) and not math.isfinite(value):
        return path, f"must be a finite number{_got(value)}", _TYPE_FIX["finite"], "field"
    if m := re.fullmatch(r"Expected `([^`]*)`, got `([^`]*)`", msg):
        want = m.group(1)
        return path, f"expected {_words(want)}, not {_words(m.group(2))}{_got(value)}", \
            _TYPE_FIX.get(want.split(" | ")[0]), "field"
    if m := re.fullmatch(r"Expected `(\w+)` (>=|>|<=|<) (\S+)", msg):
        return path, f"must be {m.group(2)} {m.group(3)}{_got(value)}", None, "field"
    if m := re.fullmatch(r"Expected `(str|array|object)` of length (<=|>=) (\d+)", msg):
        n = len(value) if isinstance(value, (str, list, dict)) else None
        what = {"str": "characters", "array": "items", "object": "entries"}[m.group(1)]
        most = "at most" if m.group(2) == "<=" else "at least"
        return path, f"{most} {int(m.group(3)):,} {what}" + (f", got {n:,}" if n is not None else ""), None, "field"
    if m := re.fullmatch(r"Expected `str` matching regex '(.*)'", msg, re.S):
        if m.group(1) == ONE_LINE:
            return path, ("must be a single line (no line break or NUL): it goes into an #SBATCH line of the job "
                          "script"), "write it on one line", "field"
        return path, f"should match pattern {m.group(1)!r}{_got(value)}", None, "field"
    return path, msg, fix, "field"


def _problem(path: Path_, msg: str, fix: str | None, source: str, lines: dict[Path_, int],
             overrides: list[tuple[Path_, str]]) -> Problem:
    dotted = _dotted(path)
    if fix is None:
        fix = f"see the `{path[-1] if path else 'recipe'}` entry of `dtlaunch schema` for what this field accepts"
    # An error inside a value that --set gave belongs to that --set item, not to a line of the file.
    for opath, item in reversed(overrides):
        if path[:len(opath)] == opath:
            return Problem(f"--set {item[:200]}", dotted, msg, fix)
    touched = [item for opath, item in overrides if opath[:len(path)] == path and path]
    if touched:
        msg += f" (after --set {', --set '.join(t[:80] for t in touched)})"
    line = None
    for n in range(len(path), -1, -1):
        if path[:n] in lines:
            line = lines[path[:n]]
            break
    return Problem(source, dotted, msg, fix, line)


def _problems(data: Any, first: msgspec.ValidationError, source: str, lines: dict[Path_, int],
              overrides: list[tuple[Path_, str]]) -> tuple[list[Problem], int]:
    """Every mistake in the document: report one, take its value out of a copy, convert again."""
    work = copy.deepcopy(data)
    out: list[Problem] = []
    seen: set[Path_] = set()
    removed: set[Path_] = set()
    more, err = 0, first
    for _ in range(MAX_ROUNDS):
        path, msg, fix, kind = _message(err, work)
        if kind == "missing":
            # Nothing can stand in for a required field, so the search ends here, with every required field
            # of that section that is missing (unless the loader took the section out itself).
            for key in _missing_keys(work, path[:-1]) or [path[-1]]:
                if path[:-1] + (key,) not in removed and len(out) < MAX_PROBLEMS:
                    out.append(_problem(path[:-1] + (key,), msg, f"add `{key}:`", source, lines, overrides))
            break
        # A section's check that fails once a bad value was taken out of it says nothing new.
        after_removal = kind == "section" and any(r[:len(path)] == path for r in removed)
        if path not in seen and not after_removal:
            seen.add(path)
            if len(out) < MAX_PROBLEMS:
                out.append(_problem(path, msg, fix, source, lines, overrides))
            else:
                more += 1
        cut = path
        while cut and not isinstance(cut[-1], str):
            cut = cut[:-1]  # a list item: the whole list goes
        parent = _value_at(work, cut[:-1]) if cut else _MISSING
        if not cut or not isinstance(parent, dict) or cut[-1] not in parent:
            break
        del parent[cut[-1]]
        removed.add(cut)
        try:
            parse(work)
            break
        except msgspec.ValidationError as e:
            err = e
    return out, more


# ----------------------------------------------------------------------------- entry points


def load_text(text: str, source: str = "<recipe>", overrides: list[str] | None = None,
              base_dir: str | None = None) -> Recipe:
    """Parse and validate a recipe, raising RecipeError (never a traceback) on any problem."""
    if len(text) > MAX_BYTES:
        _fail(source, f"the recipe is {len(text):,} characters long; a recipe is at most {MAX_BYTES:,} bytes",
              fix="point dtlaunch at a recipe .yaml file")
    data, node = parse_yaml(text, source)
    if data is None:
        _fail(source, "the recipe is empty", 1, "start from recipes/tiny.yaml")
    if not isinstance(data, dict):
        _fail(source, f"the recipe must be a mapping of sections (name, model, ...), got a {type(data).__name__}", 1,
              "start from recipes/tiny.yaml")
    lines = _line_map(node, source) if node is not None else {}
    for k in data:
        if not isinstance(k, str):
            _fail(source, f"keys must be text, got {k!r}", lines.get((str(k),)), field=str(k))
    applied: list[tuple[Path_, str]] = []
    for item in overrides or []:
        path, value = parse_override(item)
        _apply(data, path, value, item)
        applied.append((path, item))
    _read_hf_config(data, source, lines, base_dir)
    try:
        recipe = parse(data)
        recipe.set_source(SourceMap(source, lines, tuple(applied), base_dir))
        return recipe
    except msgspec.ValidationError as e:
        problems, more = _problems(data, e, source, lines, applied)
        raise RecipeError(problems, more) from None
    except RecursionError:
        _fail(source, "the recipe refers to itself (a recursive alias)", fix="remove the alias (*name) that points "
                                                                           "at its own parent")


def _read_hf_config(data: dict, source: str, lines: dict, base_dir: str | None) -> None:
    """model.hf: read its config.json now (relative to the recipe file) and keep it in the recipe, with the
    directory made absolute and, when it holds *.safetensors, hf_weights defaulting to it."""
    from .hf import HFConfigError, read_config, resolve_dir, weight_files

    model = data.get("model")
    if not isinstance(model, dict) or not isinstance(model.get("hf"), str) or model.get("hf_config") is not None:
        return
    d = resolve_dir(model["hf"], base_dir)
    try:
        cfg = read_config(d)
    except HFConfigError as e:
        _fail(source, str(e), lines.get(("model", "hf")), "point model.hf at a Llama, Mistral or Qwen2 model "
              "directory (config.json, optionally *.safetensors); relative paths start at the recipe file",
              field="model.hf")
    model["hf"] = str(d)
    model["hf_config"] = cfg
    if model.get("hf_weights") is None and weight_files(d):
        model["hf_weights"] = str(d)


def read_bounded(path: str | os.PathLike, what: str = "recipe") -> str:
    """The text of a regular file of at most MAX_BYTES, or a located error (never an unbounded read)."""
    p = Path(path)
    src = str(p)
    try:
        st = p.stat()
    except FileNotFoundError:
        _fail(src, "file not found", fix="check the path; shipped recipes live in recipes/")
    except NotADirectoryError:
        _fail(src, "a part of the path is a file, not a directory", fix="check the path")
    except OSError as e:
        _fail(src, f"cannot read: {e.strerror}", fix="check the path and its permissions")
    if stat.S_ISDIR(st.st_mode):
        _fail(src, "is a directory, not a recipe file", fix="name a .yaml file")
    if not stat.S_ISREG(st.st_mode):
        _fail(src, "is not a regular file (a device, pipe or socket)", fix=f"name a {what} .yaml file")
    if st.st_size > MAX_BYTES:
        _fail(src, f"is {st.st_size:,} bytes; a {what} is at most {MAX_BYTES:,}", fix=f"name a {what} .yaml file")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_BYTES + 1)  # the file may have grown since stat
    except OSError as e:
        _fail(src, f"cannot read: {e.strerror}", fix="check the path and its permissions")
    if len(raw) > MAX_BYTES:
        _fail(src, f"is over {MAX_BYTES:,} bytes", fix=f"name a {what} .yaml file")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        _fail(src, "not UTF-8 text (is this a binary file?)", fix=f"point dtlaunch at a {what} .yaml file")


def load(path: str | os.PathLike, overrides: list[str] | None = None) -> Recipe:
    return load_text(read_bounded(path), str(path), overrides, base_dir=str(Path(path).resolve().parent))


def json_schema() -> dict:
    """The recipe's JSON Schema (for editors): the Recipe object at the top, its sections in $defs."""
    doc = msgspec.json.schema(Recipe)
    defs = doc.pop("$defs")
    schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **defs.pop("Recipe"), "$defs": defs}
    return schema
