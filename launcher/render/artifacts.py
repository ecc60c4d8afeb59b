"""What `render` produces: files a user can run by hand, and the exact command that submits them.

Like TorchX's dry-run request: rendering never submits. A target's `submit` takes these as they are.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Artifacts:
    target: str
    job_name: str
    files: dict[str, str]  # relative path -> content
    entrypoint: str  # the file a user runs or submits
    submit_command: list[str]  # the command that submits it, run in the output directory
    executable: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)

    def write(self, out_dir: str | Path) -> Path:
        """Write all files into out_dir atomically: a reader sees the old set or the new one, never half."""
        out = Path(out_dir)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
        try:
            for rel, content in self.files.items():
                p = tmp / rel
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(content)
                if rel in self.executable:
                    p.chmod(0o755)
            out.mkdir(parents=True, exist_ok=True)
            for rel in self.files:
                dst = out / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                os.replace(tmp / rel, dst)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return out
