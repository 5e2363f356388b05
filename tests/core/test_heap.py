"""heap.freeze / thaw: what is alive at the freeze leaves the collections; what comes later does not."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from service.core import heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def _cycle() -> Node:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a


def _tracked(obj: object) -> bool:
    return any(o is obj for o in gc.get_objects())


@pytest.fixture
def thawed() -> Iterator[None]:
    yield
    heap.thaw()


@pytest.mark.usefixtures("thawed")
def test_what_is_alive_at_the_freeze_leaves_the_collections_until_thawed() -> None:
    alive = _cycle()
    dead = weakref.ref(_cycle())  # garbage before the freeze: collected by it, never frozen
    frozen = heap.freeze()
    assert dead() is None
    assert 0 < gc.get_freeze_count() <= frozen.objects  # frozen objects freed since leave the count
    assert frozen.seconds >= 0
    assert not _tracked(alive)
    heap.thaw()
    assert gc.get_freeze_count() == 0
    assert _tracked(alive)


@pytest.mark.usefixtures("thawed")
def test_garbage_made_after_the_freeze_is_still_collected() -> None:
    heap.freeze()
    later = weakref.ref(_cycle())
    assert later() is not None  # a cycle: only the collector frees it
    gc.collect()
    assert later() is None
