"""The objects a server holds from ready to exit, kept out of Python's full collections.

By the time it is ready a server process holds hundreds of thousands of objects (about 750,000 with
a mixture-of-experts model on a GPU) that live as long as it does: the modules of torch,
transformers, Triton and the CuTe DSL, the model's modules, the compiled kernels' launchers. A full
(generation 2) collection walks every one, holding the GIL, so neither the event loop nor the thread
that launches the micro-batches moves meanwhile; it comes whenever enough new objects have survived,
so now and then a round of requests waits for it (hundreds of milliseconds with a mixture-of-experts
model's stack loaded on a GPU). `freeze` moves what is alive at ready into the permanent generation,
which collections skip; what serving allocates is collected as before. `thaw` hands those objects
back to the collector at shutdown, for a process that hosts one app after another (tests,
benchmarks). `exiting` freezes everything once more as the process ends, so that the interpreter's
final collection does not walk it (5 s of a Ctrl-C's 5.4 s, serving the demo model on 2 CPU cores).
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Frozen:
    """What `freeze` did: `objects` now in the permanent generation, in `seconds` (a collection first)."""

    objects: int
    seconds: float


def freeze() -> Frozen:
    """Collect what is garbage now, then move every object still alive out of later collections."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    return Frozen(objects=gc.get_freeze_count(), seconds=time.perf_counter() - started)


def thaw() -> None:
    """Give the frozen objects back to the collector (the next full collection frees the garbage)."""
    gc.unfreeze()


def exiting() -> None:
    """The process exits next: keep every object out of the interpreter's last full collection (its
    memory goes back with the process; finalizers of objects not in cycles still run)."""
    gc.freeze()
