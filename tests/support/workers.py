"""`make pytest`'s two pytest-xdist workers, each running a fixed half of the suite in collection order.

xdist's own schedulers hand tests (or files) to whichever worker is free, so the order a worker runs
its tests in changes from run to run: a test that leaves state behind (a module in sys.modules, a
patched global) then fails some runs and passes others. Here the suite is cut once, by the folder
under tests/ a test lives in (HALVES, balanced on measured durations), and each worker runs one half
in collection order: the same order, run after run, as a one-process run of that half.

A folder not named in HALVES runs in the second half. Run on one folder, the suite is one half, and
xdist shuts the idle worker down. The halves are work units of xdist's own scope scheduler (a
crashed worker's unfinished tests are handed out again); node ids must be unique in the
suite (tests/e2e/test_schemathesis.py gives its cases a parameter for that).
"""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

FIRST, SECOND = "first half", "second half"
# the folders under tests/ whose tests the first worker runs: about half the suite's time (two cores,
# 2026-12-01, `pytest -n 2 --durations=0` summed by half: these 531 s of tests, the rest 481 s)
HALVES = frozenset({"benchmarks", "client", "docs", "e2e", "weights"})


def half(nodeid: str) -> str:
    """The half of the suite a test's node id (`tests/<folder>/.../test_x.py::test_y[...]`) is in."""
    parts = nodeid.split("::", 1)[0].split("/")
    folder = parts[1] if len(parts) > 1 else parts[0]
    return FIRST if folder in HALVES else SECOND


class Halves(LoadScopeScheduling):  # type: ignore[misc]  # xdist ships no type information
    """xdist's scope scheduler with two scopes, the halves: a worker is given one whole half."""

    def _split_scope(self, nodeid: str) -> str:
        return half(nodeid)
