"""The local target: the rendered launch.sh runs torchrun on this machine, detached, with restarts."""

# The recipe schema imports this package's section (spec.py): importing the schema first keeps that order
# whichever module of the package is imported first (spec.py itself imports from launcher.recipe).
from ... import recipe as _recipe  # noqa: F401
