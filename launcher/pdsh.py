"""What DeepSpeed's head-only launch (targets.sky.deepspeed_ssh) may carry to the other nodes: the one rule.

DeepSpeed's PDSHRunner (deepspeed/launcher/multinode_runner.py, 0.19) builds one command line that pdsh runs
through each node's shell, escaping nothing:

    export K=V; ...  cd CWD; PYTHON -u -m deepspeed.launcher.launch ... MODULE ARGS...

* V: each line of .deepspeed_env (runner.py splits the file into lines, then at the first '='), bare when
  it is a plain word, else in double quotes, where $, `, \\ and " still act; a line break splits the value.
* ARGS (the module's arguments, MODULE too): bare, or in double quotes (only " escaped) when it holds a space.
* CWD and PYTHON: always bare.

validate refuses recipe values that break this (targets/sky/rules.py); the job script runs this module
(`python -m launcher.pdsh`) on the values it computes at run time, before it writes .deepspeed_env.
"""

from __future__ import annotations

import string
import sys

QUOTED_UNSAFE = '$`"\\\n\r'  # what still acts inside double quotes, and the line breaks .deepspeed_env splits on
BARE_SAFE = frozenset(string.ascii_letters + string.digits + "_@%+=:,./-")  # a word no shell changes


def unsafe(value: str, kind: str = "env") -> str:
    """The characters of `value` that a node's shell would act on ('' when none). kind: "env" (a .deepspeed_env
    value), "arg" (the module or one of its arguments) or "bare" (the working directory, the interpreter)."""
    if kind == "bare" or (kind == "arg" and " " not in value):
        bad = {c for c in value if c not in BARE_SAFE}
    else:
        bad = set(value) & set(QUOTED_UNSAFE)
    return "".join(sorted(bad))


def describe(chars: str) -> str:
    return " ".join(repr(c) for c in chars)


KINDS = {"--bare": "bare", "--env": "env", "--args": "arg"}


def main(argv: list[str]) -> int:
    """`python -m launcher.pdsh [--bare V...] [--env NAME=V...] [--args V...]`: exit 2, naming each value the
    launch would run as shell code. --args comes last: an argument may itself read --env."""
    kind, bad = "env", []
    for word in argv:
        if kind != "arg" and word in KINDS:
            kind = KINDS[word]
            continue
        chars = unsafe(word.partition("=")[2] if kind == "env" else word, kind)
        if chars:
            bad.append(f"{word!r} holds {describe(chars)}")
    for b in bad:
        print(
            f"dtlaunch: error: {b}: DeepSpeed's head-only launch (targets.sky.deepspeed_ssh) would pass it to every "
            "node's shell unescaped, where it runs as shell code or breaks the launch",
            file=sys.stderr,
        )
    if bad:
        print(
            "dtlaunch: fix: use paths and values without those characters (DTLAUNCH_RUN_ID, DTLAUNCH_RUN_DIR and "
            "the task's directory included), or leave targets.sky.deepspeed_ssh off",
            file=sys.stderr,
        )
    return 2 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
