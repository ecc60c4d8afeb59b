"""Reading a recipe: bounded in size, depth and expansion, strict about YAML's surprises, every error located.

The loader is the first thing hostile or mistyped input meets, so every step has a fixed bound: a regular
file of at most MAX_BYTES, at most MAX_DEPTH levels of nesting (libyaml's composer recurses in C and
crashed this process at ~100,000 levels), at most MAX_VALUES values after YAML aliases are expanded (a
300-byte "billion laughs" document expands to 9^9 values), duplicate keys refused rather than silently
overwritten, and at most MAX_PROBLEMS problems listed. Each problem names the file (or the `--set` item),
the line, the field, what is wrong and a fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any, NoReturn

import msgspec
import yaml

from ..errors import Problem, RecipeError
from .limits import MAX_BYTES, MAX_DEPTH, MAX_OVERRIDE_BYTES, MAX_VALUES, Path_, dotted
from .schema import Recipe, ResourcesSpec, parse

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml when present: much faster
_OPEN = ("BlockMappingStartToken", "BlockSequenceStartToken", "FlowMappingStartToken", "FlowSequenceStartToken")
_CLOSE = ("BlockEndToken", "FlowMappingEndToken", "FlowSequenceEndToken")


class SourceMap(msgspec.Struct, frozen=True):
    """Where each field of a loaded recipe came from, so findings made later (validate) name file and line,
    or the `--set` item that gave the value."""

    file: str
    lines: dict
    overrides: tuple = ()  # ((path, "KEY=VALUE"), ...)
    base_dir: str | None = None  # the recipe file's directory: relative paths in it (entrypoint.workdir) start here

    def locate(self, field: str) -> tuple[str, int | None]:
        path = tuple(int(p) if p.isdigit() else p for p in field.split(".")) if field else ()
        for opath, item in reversed(self.overrides):
            if path[: len(opath)] == opath:
                return f"--set {item[:200]}", None
        for n in range(len(path), -1, -1):
            if path[:n] in self.lines:
                return self.file, self.lines[path[:n]]
        return self.file, None


def _fail(
    source: str, message: str, line: int | None = None, fix: str | None = None, field: str = "(file)"
) -> NoReturn:
    raise RecipeError([Problem(source, field, message, fix, line)])


# ----------------------------------------------------------------------------- YAML, bounded


def _check_depth(text: str, source: str) -> None:
    """Scan the tokens (libyaml's scanner is iterative) and stop at the first level past MAX_DEPTH."""
    too_deep = f"the YAML is nested more than {MAX_DEPTH} levels deep"
    fix = "a recipe is a few sections of key: value lines; flatten it"
    loader = _Loader(text)
    try:
        depth = 0
        while loader.check_token():
            tok = loader.get_token()
            name = type(tok).__name__
            if name in _OPEN:
                depth += 1
                if depth > MAX_DEPTH:
                    _fail(source, too_deep, tok.start_mark.line + 1, fix)
            elif name in _CLOSE:
                depth -= 1
    except yaml.YAMLError as e:
        # libyaml >= the one in PyYAML 6.0.4 stops at 1,000 levels itself, while scanning ahead of the token
        # we asked for (so before the count above reaches MAX_DEPTH): the same mistake, not a syntax error,
        # or `--set` would take the text for a plain string.
        if "nesting depth" not in str(getattr(e, "problem", "")):
            raise
        mark = getattr(e, "problem_mark", None)
        _fail(source, too_deep, mark.line + 1 if mark else None, fix)
    finally:
        loader.dispose()


def parse_yaml(text: str, source: str) -> tuple[Any, yaml.Node | None]:
    """(data, node) of one YAML document, within the depth bound; YAML errors become located Problems."""
    if "\x00" in text:
        _fail(
            source, "this is not a text YAML file (it contains NUL bytes)", fix="point dtlaunch at a recipe .yaml file"
        )
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
        _fail(
            source,
            f"YAML syntax error: {problem}",
            mark.line + 1 if mark else None,
            "check indentation, colons and quotes on that line",
        )
    except RecursionError:
        _fail(
            source,
            "the YAML refers to itself (a recursive alias)",
            fix="remove the alias (*name) that points at its own parent",
        )
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
            _fail(
                source,
                f"the recipe nests more than {MAX_DEPTH} levels deep through YAML aliases",
                node.start_mark.line + 1,
                "remove the alias (*name) that refers to its own parent",
            )
        if budget < 0:
            _fail(
                source,
                f"the recipe expands to more than {MAX_VALUES:,} values (YAML aliases expand each time they are used)",
                node.start_mark.line + 1,
                "write the values out, or use fewer aliases (*name)",
            )
        lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen: dict[str, int] = {}
            for k, v in node.value:
                line = k.start_mark.line + 1
                if not isinstance(k, yaml.ScalarNode):
                    _fail(source, "a key must be plain text, not a list or mapping", line, field=dotted(path))
                key = k.value
                if key in seen and k.tag != "tag:yaml.org,2002:merge":
                    _fail(
                        source,
                        f"duplicate key {key!r} (first given at line {seen[key]}); YAML would silently keep "
                        "only the last one",
                        line,
                        "keep one of them",
                        field=dotted(path + (key,)),
                    )
                seen[key] = line
                lines[path + (key,)] = line
                stack.append((v, path + (key,)))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                stack.append((v, path + (i,)))
    return lines


# ----------------------------------------------------------------------------- overrides


def parse_override(item: str) -> tuple[Path_, Any]:
    """`training.steps=10` -> (("training", "steps"), 10); the value is read as YAML, with the same bounds."""
    source = f"--set {item[:200]}"
    key, sep, raw = item.partition("=")
    parts = tuple(p.strip() for p in key.split("."))
    if not sep or not key.strip() or any(not p for p in parts):
        _fail(
            source,
            "expected KEY=VALUE with a dotted KEY, e.g. --set training.steps=100",
            field=key.strip() or "(key)",
            fix="write --set SECTION.FIELD=VALUE",
        )
    if len(raw.encode()) > MAX_OVERRIDE_BYTES:
        _fail(
            source,
            f"the value is longer than {MAX_OVERRIDE_BYTES:,} bytes",
            field=key.strip(),
            fix="put a value this long in the recipe file, or in a file it names",
        )
    if raw.strip() == "":
        _fail(
            source,
            "the value is empty",
            field=key.strip(),
            fix=f"give a value, e.g. --set {key.strip()}=VALUE, or --set {key.strip()}=null to unset it",
        )
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
            _fail(
                f"--set {item[:200]}",
                f"{dotted(path[: i + 1])} is a value, not a section: it has no field {path[i + 1]!r}",
                field=dotted(path),
                fix="check the key against `dtlaunch schema`",
            )
        cur = nxt
    cur[path[-1]] = value


# ----------------------------------------------------------------------------- entry points


def load_text(
    text: str, source: str = "<recipe>", overrides: list[str] | None = None, base_dir: str | None = None
) -> Recipe:
    """Parse and validate a recipe, raising RecipeError (never a traceback) on any problem."""
    if len(text) > MAX_BYTES:
        _fail(
            source,
            f"the recipe is {len(text):,} characters long; a recipe is at most {MAX_BYTES:,} bytes",
            fix="point dtlaunch at a recipe .yaml file",
        )
    data, node = parse_yaml(text, source)
    if data is None:
        _fail(source, "the recipe is empty", 1, "start from recipes/tiny.yaml")
    if not isinstance(data, dict):
        _fail(
            source,
            f"the recipe must be a mapping of sections (name, model, ...), got a {type(data).__name__}",
            1,
            "start from recipes/tiny.yaml",
        )
    lines = _line_map(node, source) if node is not None else {}
    return load_data(data, source, overrides, base_dir, lines)


def load_data(
    data: dict,
    source: str = "<recipe>",
    overrides: list[str] | None = None,
    base_dir: str | None = None,
    lines: dict | None = None,
) -> Recipe:
    """A recipe from plain data (what the YAML held), with `--set` overrides applied: load_text's second half, and
    the way in for a recipe that is already data (launcher.submit of a Recipe: no YAML round trip)."""
    lines = lines or {}
    for k in data:
        if not isinstance(k, str):
            _fail(
                source,
                f"keys must be text, got {k!r}",
                lines.get((str(k),)),
                fix=f"quote the key ('{k}':) or use a section's field name; `dtlaunch schema` lists them",
                field=str(k),
            )
    applied: list[tuple[Path_, str]] = []
    for item in overrides or []:
        path, value = parse_override(item)
        _apply(data, path, value, item)
        applied.append((path, item))
    _read_hf_config(data, source, lines, base_dir)
    _read_calibration(data, source, lines, base_dir)
    try:
        recipe = parse(data)
        recipe.set_source(SourceMap(source, lines, tuple(applied), base_dir))
        return recipe
    except msgspec.ValidationError as e:
        from .problems import collect

        problems, more = collect(data, e, source, lines, applied)
        raise RecipeError(problems, more) from None
    except RecursionError:
        _fail(
            source,
            "the recipe refers to itself (a recursive alias)",
            fix="remove the alias (*name) that points at its own parent",
        )


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
        _fail(
            source,
            str(e),
            lines.get(("model", "hf")),
            "point model.hf at a Llama, Mistral or Qwen2 model "
            "directory (config.json, optionally *.safetensors); relative paths start at the recipe file",
            field="model.hf",
        )
    model["hf"] = str(d)
    model["hf_config"] = cfg
    if model.get("hf_weights") is None and weight_files(d):
        model["hf_weights"] = str(d)


def _read_calibration(data: dict, source: str, lines: dict, base_dir: str | None) -> None:
    """resources.calibration: read the file now (relative to the recipe file) and put its measured MFU and
    checkpoint write rate in the recipe's place of the assumed ones; the path is kept, made absolute."""
    from .. import catalog
    from .calibration import CalibrationError, calibrated_values, read_calibration, resolve

    res = data.get("resources")
    if not isinstance(res, dict) or not isinstance(res.get("calibration"), str):
        return
    path = resolve(res["calibration"], base_dir)
    try:
        accel = catalog.parse_accelerator(str(res.get("accelerator", ResourcesSpec.accelerator)))[0]
    except ValueError:
        return  # the schema says what is wrong with the accelerator
    try:
        res.update(calibrated_values(read_calibration(path), accel, str(path)))
    except CalibrationError as e:
        _fail(source, e.message, lines.get(("resources", "calibration")), e.fix, field="resources.calibration")
    res["calibration"] = str(path)


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
