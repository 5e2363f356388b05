"""The threads that write a big answer's JSON, a pool per answer: the writers (numpy's copies,
service.wire._jsonrows) let go of the GIL, so its pieces are written in parallel, off the event loop."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

RENDER_THREADS = min(4, os.cpu_count() or 1)  # each holds one piece's text or block's temporaries at a time


def render_pool(name: str) -> ThreadPoolExecutor:
    """A pool of RENDER_THREADS threads named `name`-N; its threads start as work is submitted."""
    return ThreadPoolExecutor(RENDER_THREADS, thread_name_prefix=name)
