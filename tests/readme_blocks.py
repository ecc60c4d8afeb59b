"""The README's shell blocks, as the README test runs them.

Every fenced ```bash block in README.md carries a marker on the line before it:

    <!-- readme: local -->                 run here, in a scratch directory (the repo's recipes/, examples/
                                           and scripts/ linked in), with the venv's bin first on PATH
    <!-- readme: repo -->                  run in the repository itself (make targets)
    <!-- readme: slurm-local -->           run here; the block starts and stops its own local SLURM cluster
    <!-- readme: needs real-cluster -->    not run: needs a SLURM site (checked for shell syntax only)
    <!-- readme: needs cloud -->           not run: needs cloud credentials (checked for shell syntax only)

A runnable marker may add `expect="TEXT"` (repeatable): the block's output must contain each TEXT, so a
documented output that drifts fails the test like a failing command does.

pytest-codeblocks and similar plugins run each block in the test's own process environment; these blocks
need per-block working directories, a local SLURM cluster and timeouts, hence this small runner.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

MARKER = re.compile(r"^<!--\s*readme:\s*(?P<kind>needs\s+[\w-]+|[\w-]+)(?P<rest>.*?)-->\s*$")
EXPECT = re.compile(r'expect="((?:[^"\\]|\\.)*)"')
RUNNABLE = ("local", "repo", "slurm-local")
NOT_RUN = ("needs real-cluster", "needs cloud")


@dataclass
class Block:
    kind: str
    code: str
    line: int  # the README line of the opening fence
    expect: list[str] = field(default_factory=list)

    @property
    def runnable(self) -> bool:
        return self.kind in RUNNABLE

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.kind.replace(' ', '-')}"


def blocks(text: str) -> tuple[list[Block], list[str]]:
    """(the marked blocks, problems: unmarked shell blocks, unknown markers, unclosed fences)."""
    out: list[Block] = []
    problems: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("```"):
            lang = line[3:].strip()
            start = i
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            if j == len(lines):
                problems.append(f"README.md:{start + 1}: unclosed code fence")
                break
            if lang in ("bash", "sh", "shell", "console"):
                m = MARKER.match(lines[start - 1]) if start else None
                if m is None:
                    problems.append(f"README.md:{start + 1}: a {lang} block without a `<!-- readme: ... -->` marker")
                else:
                    kind = " ".join(m.group("kind").split())
                    if kind not in RUNNABLE + NOT_RUN:
                        problems.append(f"README.md:{start}: unknown marker {kind!r}")
                    expect = [e.replace('\\"', '"') for e in EXPECT.findall(m.group("rest"))]
                    out.append(Block(kind, "\n".join(lines[start + 1 : j]) + "\n", start + 1, expect))
            i = j + 1
            continue
        i += 1
    return out, problems


def readme_blocks(root: Path) -> tuple[list[Block], list[str]]:
    return blocks((root / "README.md").read_text())
