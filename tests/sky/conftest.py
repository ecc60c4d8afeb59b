"""Fixtures shared by the SkyPilot tests: the simulated VMs of sky_nodes.py (sky_image, sky_nodes)."""
from sky_nodes import sky_image, sky_nodes  # noqa: F401 - re-exported as fixtures
