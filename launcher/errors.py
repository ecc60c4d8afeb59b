"""Errors a user can act on. The CLI prints them; nothing here ever becomes a traceback."""
from __future__ import annotations


class DtlaunchError(Exception):
    """Base for every error the CLI turns into a message and a non-zero exit code."""

    exit_code = 2


class RecipeError(DtlaunchError):
    """One or more problems in a recipe: each names file, line, field, what is wrong and a fix."""

    def __init__(self, problems: list[dict]):
        self.problems = problems
        super().__init__(self.render())

    def render(self) -> str:
        out = []
        for p in self.problems:
            where = p["file"] + (f":{p['line']}" if p.get("line") else "")
            s = f"{where}: {p['field']}: {p['message']}"
            if p.get("fix"):
                s += f"\n    fix: {p['fix']}"
            out.append(s)
        return "\n".join(out)


class BackendError(DtlaunchError):
    """A target could not do what was asked (submit, status, cancel); the message says why and what to do."""

    exit_code = 3
