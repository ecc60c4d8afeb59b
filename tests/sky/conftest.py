"""Fixtures shared by the SkyPilot tests: the simulated VMs of sky_nodes.py (sky_image, sky_nodes) and the real
SkyPilot library (sky_lib)."""

from sky_helpers import sky_lib  # noqa: F401 - re-exported as fixtures
from sky_nodes import sky_image, sky_nodes  # noqa: F401 - re-exported as fixtures
