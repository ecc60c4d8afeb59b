"""Python's garbage collector at step boundaries, not in the middle of a rank's step.

Left automatic, the collector runs whenever enough container objects have been allocated, which in a
training step (autograd nodes, hooks, DTensor wrappers, FSDP2's per-unit bookkeeping) is at some point
inside the forward or backward of a different step on each rank; a full collection walks every object the
process holds (torch's and the launcher's modules included). The other ranks wait for the collecting rank
at their next collective, so each rank's pauses add up across the world. torchtitan does the same for the
same reason (`training.gc_freq`, default 50): collect once at start-up, then only every N steps, on every
rank at the same step.

After the start-up collection, everything alive is frozen (`gc.freeze`: moved to a generation the
collector never scans), so the periodic full collections only walk what the run itself created since. The
cost: memory held only by a reference cycle made during training (the loop's own step makes none) is
freed at the next collection, at most `every` steps later, rather than whenever the collector happens to
run. Only dtlaunch's own loop (`launcher.runtime.train`) does this; a user's script that imports the library keeps
its interpreter's settings.
"""

from __future__ import annotations

import gc

EVERY = 50  # steps between collections (torchtitan's default gc_freq)


class StepGC:
    """`with StepGC() as gc_: ... gc_.step(n)`: automatic collection off inside, restored on exit."""

    def __init__(self, every: int = EVERY):
        self.every = every
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> StepGC:
        self._was_enabled = gc.isenabled()
        gc.disable()
        gc.collect()
        gc.freeze()
        return self

    def step(self, step: int) -> None:
        """Called by every rank after the same step: collect on the same steps everywhere."""
        if step % self.every == 0:
            gc.collect()

    def __exit__(self, *exc) -> None:
        gc.unfreeze()
        if self._was_enabled:
            gc.enable()
