"""The training loop's garbage-collection policy: no automatic collection inside the loop, a full one on the
same steps on every rank, and the interpreter's own settings back afterwards (even when the loop raises)."""

from __future__ import annotations

import gc
import weakref

import pytest

from launcher.runtime.stepgc import StepGC


class _Node:
    def __init__(self):
        self.me = self  # a reference cycle: only the collector frees it


def _cycle() -> weakref.ref:
    return weakref.ref(_Node())


def test_cycles_live_until_a_collection_step():
    gc.enable()
    with StepGC(every=3) as collector:
        assert not gc.isenabled()
        assert gc.get_freeze_count() > 0  # the start-up's objects are out of the periodic collections' way
        ref = _cycle()
        for _ in range(2000):  # enough allocations to trigger the automatic collector many times over
            _cycle()
        collector.step(1)
        collector.step(2)
        assert ref() is not None  # no collection between the steps it is told about
        collector.step(3)
        assert ref() is None
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0


def test_settings_restored_after_an_exception_and_when_disabled_before():
    gc.enable()
    with pytest.raises(RuntimeError), StepGC():
        raise RuntimeError("a preemption or a hang leaves the loop by an exception")
    assert gc.isenabled() and gc.get_freeze_count() == 0
    gc.disable()
    try:
        with StepGC():
            pass
        assert not gc.isenabled()  # a process that had turned the collector off keeps it off
    finally:
        gc.enable()
