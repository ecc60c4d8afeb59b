"""Compile the shell templates (launcher/render/templates/*.j2) into plain Python: launcher/render/compiled_templates.py.

Why: importing Jinja2 took ~20 ms, a fifth of every `dtlaunch render`, for templates that only change with
the code. The .j2 files stay the source, read as shell; Jinja's own parser reads them here, with the
options `render` used to run them with, so whitespace control and expressions mean what Jinja means. The
handful of node types the templates use become Python statements; any other construct is refused with
its template and line, so a template that outgrows this compiler fails here, not in a rendered script.

    python scripts/compile_templates.py           # rewrite the compiled module
    python scripts/compile_templates.py --check   # exit 1 when it is out of date (tests run this)

Semantics kept from Jinja with StrictUndefined: a value the renderer did not pass is an error, `x is
defined` tests for it; `a.b` is the attribute, else the item; `~` joins as text; output is `str(value)`;
an include sees the context plus the variables of the enclosing `with` and `for` blocks.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jinja2
from jinja2 import nodes

from launcher.render.template_filters import FILTERS  # the installed checkout's (`make templates` installs it)

ROOT = Path(__file__).resolve().parent.parent
TEMPLATES = ROOT / "launcher" / "render" / "templates"
OUTPUT = ROOT / "launcher" / "render" / "compiled_templates.py"



def environment() -> jinja2.Environment:
    """The options the templates are written for: shell, not HTML (no autoescape); a block tag's own line
    leaves no trace in the output; the file's last line break is kept."""
    return jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                              autoescape=False, keep_trailing_newline=True, trim_blocks=True, lstrip_blocks=True)


def function_name(template: str) -> str:
    return "t_" + template.removesuffix(".j2").replace(".", "_").lstrip("_")


class Unsupported(Exception):
    pass


class TemplateCompiler:
    """One template's nodes -> one Python function `t_<name>(c, w)`: `c` is the context, `w` appends text."""

    def __init__(self, template: str, filters_used: set[str]):
        self.template = template
        self.filters_used = filters_used
        self.lines: list[str] = []
        self.scopes: list[dict[str, str]] = []  # template variable -> Python local, innermost last
        self.locals = 0

    def compile(self, tree: nodes.Template) -> list[str]:
        self.lines.append(f"def {function_name(self.template)}(c, w):")
        self.block(tree.body, 1)
        return self.lines

    def fail(self, node: nodes.Node, what: str):
        raise Unsupported(f"{self.template}:{node.lineno}: {what} is not supported by scripts/compile_templates.py")

    def emit(self, depth: int, text: str) -> None:
        self.lines.append("    " * depth + text)

    def block(self, body: list[nodes.Node], depth: int) -> None:
        before = len(self.lines)
        for node in body:
            self.statement(node, depth)
        if len(self.lines) == before:
            self.emit(depth, "pass")

    def bind(self, names: list[str]) -> dict[str, str]:
        scope = {}
        for name in names:
            self.locals += 1
            scope[name] = f"l{self.locals}_{name}"
        return scope

    def lookup(self, name: str) -> str | None:
        for scope in reversed(self.scopes):
            if name in scope:
                return scope[name]
        return None

    def statement(self, node: nodes.Node, depth: int) -> None:  # noqa: C901 - one branch per node type
        if isinstance(node, nodes.Output):
            for part in node.nodes:
                if isinstance(part, nodes.TemplateData):
                    if part.data:
                        self.emit(depth, f"w({part.data!r})")
                else:
                    self.emit(depth, f"w(str({self.expr(part)}))")
        elif isinstance(node, nodes.If):
            self.emit(depth, f"if {self.expr(node.test)}:")
            self.block(node.body, depth + 1)
            for alt in node.elif_:
                self.emit(depth, f"elif {self.expr(alt.test)}:")
                self.block(alt.body, depth + 1)
            if node.else_:
                self.emit(depth, "else:")
                self.block(node.else_, depth + 1)
        elif isinstance(node, nodes.For):
            if node.else_ or node.test is not None or node.recursive:
                self.fail(node, "for ... else, a loop filter or a recursive loop")
            targets = node.target.items if isinstance(node.target, nodes.Tuple) else [node.target]
            if not all(isinstance(t, nodes.Name) for t in targets):
                self.fail(node, "a loop target other than names")
            iterable = self.expr(node.iter)
            scope = self.bind([t.name for t in targets])
            self.emit(depth, f"for {', '.join(scope.values())} in {iterable}:")
            self.scopes.append(scope)
            self.block(node.body, depth + 1)
            self.scopes.pop()
        elif isinstance(node, nodes.With):
            if not all(isinstance(t, nodes.Name) for t in node.targets):
                self.fail(node, "a with target other than a name")
            values = [self.expr(v) for v in node.values]  # evaluated outside the block's own names
            scope = self.bind([t.name for t in node.targets])
            for local, value in zip(scope.values(), values, strict=True):
                self.emit(depth, f"{local} = {value}")
            self.scopes.append(scope)
            for inner in node.body:  # no Python block of its own: the names are locals of the function
                self.statement(inner, depth)
            self.scopes.pop()
        elif isinstance(node, nodes.Include):
            if not isinstance(node.template, nodes.Const) or node.ignore_missing or not node.with_context:
                self.fail(node, "an include of anything but one named template, with its context")
            visible = {name: local for scope in self.scopes for name, local in scope.items()}
            context = "c" if not visible else "{**c, " + ", ".join(f"{n!r}: {v}" for n, v in visible.items()) + "}"
            self.emit(depth, f"{function_name(node.template.value)}({context}, w)")
        else:
            self.fail(node, f"the {type(node).__name__} tag")

    def expr(self, node: nodes.Node) -> str:  # noqa: C901 - one branch per node type
        if isinstance(node, nodes.Name):
            local = self.lookup(node.name)
            return local or f"need(c, {node.name!r}, {self.template!r})"
        if isinstance(node, nodes.Const):
            return repr(node.value)
        if isinstance(node, nodes.Getattr):
            return f"attr({self.expr(node.node)}, {node.attr!r})"
        if isinstance(node, nodes.Filter):
            if node.kwargs or node.dyn_args or node.dyn_kwargs or node.name not in FILTERS:
                self.fail(node, f"the filter {node.name!r} (or its keyword arguments)")
            self.filters_used.add(node.name)
            args = [self.expr(node.node), *(self.expr(a) for a in node.args)]
            return f"f_{node.name}({', '.join(args)})"
        if isinstance(node, nodes.Concat):
            return "(" + " + ".join(f"str({self.expr(n)})" for n in node.nodes) + ")"
        if isinstance(node, nodes.Add):
            return f"({self.expr(node.left)} + {self.expr(node.right)})"
        if isinstance(node, nodes.CondExpr):
            if node.expr2 is None:
                self.fail(node, "an if-expression without else")
            return f"({self.expr(node.expr1)} if {self.expr(node.test)} else {self.expr(node.expr2)})"
        if isinstance(node, nodes.Test):
            if node.name == "defined" and isinstance(node.node, nodes.Name) and not node.args:
                return "True" if self.lookup(node.node.name) else f"({node.node.name!r} in c)"
            if node.name == "none" and not node.args:
                return f"({self.expr(node.node)} is None)"
            self.fail(node, f"the test {node.name!r}")
        if isinstance(node, nodes.Not):
            return f"(not {self.expr(node.node)})"
        if isinstance(node, nodes.Or):
            return f"({self.expr(node.left)} or {self.expr(node.right)})"
        if isinstance(node, nodes.List):
            return "[" + ", ".join(self.expr(n) for n in node.items) + "]"
        if isinstance(node, nodes.Call):
            if node.kwargs or node.dyn_args or node.dyn_kwargs:
                self.fail(node, "a call with keyword arguments")
            return f"{self.expr(node.node)}({', '.join(self.expr(a) for a in node.args)})"
        self.fail(node, f"the expression {type(node).__name__}")


def compile_all() -> str:
    env = environment()
    filters_used: set[str] = set()
    paths = sorted(TEMPLATES.glob("*.j2"))
    functions = []
    for path in paths:
        tree = env.parse(path.read_text(), path.name, str(path))
        functions.append("\n".join(TemplateCompiler(path.name, filters_used).compile(tree)))
    names = [p.name for p in paths]
    if len({function_name(n) for n in names}) != len(names):
        raise Unsupported(f"two templates compile to the same function name: {names}")
    header = [
        '"""The shell templates (launcher/render/templates/*.j2) as Python functions: `render` needs no template',
        "engine at run time. Generated by scripts/compile_templates.py from the .j2 files; do not edit: change the",
        'template and run `make templates` (tests/test_templates.py fails while this file is out of date)."""',
        "# ruff: noqa",
        "from .template_filters import FILTERS, attr, need",
        "",
        *(f"f_{f} = FILTERS[{f!r}]" for f in sorted(filters_used)),
    ]
    table = ["TEMPLATES = {", *(f"    {n!r}: {function_name(n)}," for n in names), "}"]
    return "\n".join(header) + "\n\n\n" + "\n\n\n".join(functions) + "\n\n\n" + "\n".join(table) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the compiled module is out of date")
    args = parser.parse_args()
    try:
        text = compile_all()
    except (Unsupported, jinja2.TemplateSyntaxError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date with launcher/render/templates: run `make templates`",
                  file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
