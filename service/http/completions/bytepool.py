"""Byte strings copied into a JSON buffer by numpy, many at once: the completions answer's assembly.

A Pool holds byte strings end to end (`data`, with SLACK bytes after the last) and each one's
`start` and `length`. A copy moves the strings numbered `which` to the byte offsets `at` of a
destination buffer with one numpy assignment per width: `windows(buf, w)` sees a buffer as
overlapping w-byte items, item i starting at byte i, so `windows(dst, w)[at] = windows(src, w)[start]`
copies len(at) strings of w bytes each at C speed, where a Python loop would build one object per
string.

- copy_over writes a fixed width: each string, then up to width - 1 bytes of whatever follows it in
  the pool. The caller writes the bytes after each string later, over that spill (jsonwriter.py
  orders its copies so), and keeps the spill inside what it writes later.
- copy_exact writes each string's own length: one assignment per distinct length, order-free.

Every destination buffer has room past its last real byte (`room`): spills and the copies of
entries left out (sent to the buffer's end) land there and are cut off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

SLACK = 64  # bytes after a pool's last string and a buffer's last real byte: the widest fixed copy

Bytes = NDArray[np.uint8]
Ints = NDArray[np.int64]


def windows(buf: Bytes, width: int) -> NDArray[np.void]:
    """Every `width`-byte window of `buf` as one item of a view: item i is buf[i : i + width]."""
    return np.ndarray(
        shape=(buf.size - width + 1,), dtype=np.dtype((np.void, width)), buffer=buf, strides=(1,)
    )


@dataclass(frozen=True, slots=True)
class Pool:
    """Byte strings end to end: data [total + SLACK] uint8, start [n] and length [n] int64."""

    data: Bytes
    start: Ints
    length: Ints
    head: NDArray[np.void] | None = None  # [n] each string's first bytes, one item each: copy_over's

    @classmethod
    def of(cls, strings: Sequence[bytes], head: int = 0) -> Pool:
        """The strings; with `head` > 0 also their first `head` bytes as a table, copied faster (as
        many as the longest string has, if fewer: "null}" copies 5 bytes, not 32)."""
        length = np.fromiter(map(len, strings), dtype=np.int64, count=len(strings))
        start = np.cumsum(length) - length
        data = np.frombuffer(b"".join(strings) + bytes(SLACK), dtype=np.uint8)
        head = min(head, int(length.max(initial=1)))
        heads = np.ascontiguousarray(windows(data, head)[start]) if head else None
        return cls(data=data, start=start, length=length, head=heads)

    @classmethod
    def of_json_array(cls, text: bytes) -> Pool:
        """The items of a flat JSON array of numbers or nulls (orjson's "[a,b,c]": no spaces, no
        commas inside an item); an empty array gives an empty pool."""
        data = np.frombuffer(text + bytes(SLACK), dtype=np.uint8)
        commas = np.flatnonzero(data[: len(text)] == ord(","))
        start = np.concatenate([[1], commas + 1]).astype(np.int64)
        end = np.concatenate([commas, [len(text) - 1]]).astype(np.int64)
        if len(text) == 2:  # "[]"
            start, end = start[:0], end[:0]
        return cls(data=data, start=start, length=end - start)

    @property
    def longest(self) -> int:
        return int(self.length.max(initial=0))


def room(total: int, *pools: Pool) -> Bytes:
    """A destination buffer for `total` real bytes, with room after them for any copy sent past."""
    return np.empty(total + 2 * SLACK + sum(p.longest for p in pools), dtype=np.uint8)


def copy_over(buf: Bytes, at: Ints, pool: Pool, which: Ints, width: int) -> None:
    """buf[at[i]:] = pool string which[i], written `width` bytes at a time (strings longer than width
    in several): each copy spills up to width - 1 bytes past its string, for a later copy to cover.
    A pool with a table of heads is copied at the table's width (`width` at most)."""
    assert width <= SLACK
    if pool.head is not None:
        assert pool.head.dtype.itemsize <= width
        width = pool.head.dtype.itemsize
    dst, src = windows(buf, width), windows(pool.data, width)
    if pool.head is not None:
        dst[at] = np.take(pool.head, which)
    else:
        dst[at] = src[pool.start[which]]
    if pool.longest <= width:
        return
    start, length = pool.start[which], pool.length[which]
    for done in range(width, pool.longest, width):
        longer = np.flatnonzero(length > done)  # the strings not yet whole
        if longer.size == 0:
            return
        at, start, length = at[longer], start[longer], length[longer]
        dst[at + done] = src[start + done]


def copy_exact(buf: Bytes, at: Ints, data: Bytes, start: Ints, length: Ints) -> None:
    """buf[at[i] : at[i] + length[i]] = data[start[i] : start[i] + length[i]]; length 0 copies nothing."""
    small = length.astype(np.uint16) if length.size and length.max() < 1 << 16 else length
    order = np.argsort(small, kind="stable")  # a radix sort on 16-bit keys
    cuts = np.flatnonzero(np.diff(small[order])) + 1
    for group in np.split(order, cuts):
        if group.size == 0:
            continue
        width = int(length[group[0]])
        if width:
            windows(buf, width)[at[group]] = windows(data, width)[start[group]]
