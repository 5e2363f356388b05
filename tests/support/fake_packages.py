"""Fake optional packages on sys.path for one test, and nothing of them left behind.

`fake_site(path, monkeypatch, roots)` puts `path` ahead of site-packages and hides every module of
the top-level packages `roots` that is already imported (monkeypatch puts those back after the
test). When the block ends, every module of `roots` imported inside it (the fakes, or a second copy
of a hidden real package) leaves `sys.modules`, and the service's cached import outcomes
(service.engine.runtime.packages) are forgotten before and after: a later test in the same process
sees the packages as they were.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Set
from contextlib import contextmanager
from pathlib import Path

import pytest

from service.engine.runtime import packages as optional


@contextmanager
def fake_site(path: Path, monkeypatch: pytest.MonkeyPatch, roots: Set[str]) -> Iterator[Path]:
    def imported() -> list[str]:
        return [name for name in sys.modules if name.partition(".")[0] in roots]

    monkeypatch.syspath_prepend(str(path))
    for name in imported():
        monkeypatch.delitem(sys.modules, name)
    optional.forget()
    try:
        yield path
    finally:
        for name in imported():
            del sys.modules[name]
        optional.forget()
