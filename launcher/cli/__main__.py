"""`python -m launcher.cli ...`, the same as the `dtlaunch` script."""

from . import main

main()
