"""`dtlaunch`: thin click commands over recipe -> plan -> render -> backend.

Importing this package must stay cheap: no torch, deepspeed, sky, submitit or paramiko here, and rich is
imported only by the commands that draw tables. Every user mistake ends in one located message and an exit
code; only a bug of ours says "internal error".
"""

from __future__ import annotations

import os
import sys

import click

from ..errors import DtlaunchError
from ..version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="dtlaunch")
def cli():
    """Plan, validate, render and launch distributed training from one recipe YAML."""


from . import calibrate, jobs, planning, rehearse, rendering  # noqa: E402 - the commands register themselves on `cli`

planning.register(cli)
rendering.register(cli)
jobs.register(cli)
calibrate.register(cli)
rehearse.register(cli)


def main() -> None:
    try:
        cli.main(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except DtlaunchError as e:
        click.secho(f"error: {e}", fg="red", err=True)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # a bug of ours: one line, and the traceback only on request
        if os.environ.get("DTLAUNCH_DEBUG"):
            raise
        click.secho(
            f"internal error: {type(e).__name__}: {e} (set DTLAUNCH_DEBUG=1 for the traceback, and please report it)",
            fg="red",
            err=True,
        )
        sys.exit(70)


if __name__ == "__main__":
    main()
