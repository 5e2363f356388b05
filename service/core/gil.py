"""How long a server thread may keep the GIL while another waits for it (sys.setswitchinterval).

A server process runs several Python threads at once: the event loop (reading request bodies and
handing answers to uvicorn, a read or write of at most a few hundred KiB at a time), the engine
thread (packing and launching micro-batches), and the pool threads that parse bodies and render
answers. A thread that lets the GIL go for a socket read or a native pass must take it back before
its next Python line, and when another thread holds it CPython makes the returning thread wait up to
the switch interval before asking the holder to let go. Python's default, 5 ms, is paid at every one
of those returns, so an event loop reading eight 16 MB bodies while the engine launches can wait
tens of milliseconds for its own socket reads. `switching` sets the interval for as long as an app
serves and puts the previous one back after.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

PYTHON_DEFAULT_MS = 5.0


@contextmanager
def switching(interval_ms: float) -> Iterator[None]:
    """Within: the interpreter's switch interval is `interval_ms` (the whole process's)."""
    previous = sys.getswitchinterval()
    sys.setswitchinterval(interval_ms / 1e3)
    try:
        yield
    finally:
        sys.setswitchinterval(previous)
