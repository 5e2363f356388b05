"""Run a benchmark module with every Python garbage collection over a threshold printed as it ends.

    python -m benchmarks.probes.gc_pauses [--over-ms 5] benchmarks.moe --models mixtral-8l --reps 10 \\
        --no-peers

Prints `GC gen<N> <ms> ms collected <objects>` lines among the module's own output, with the
service's INFO log (its start-up phases and `ready`) to place them: a collection between `ready` and
a variant's line happened while that variant's rounds were timed. `--collect-every S` also runs a
full collection every S seconds from a thread of its own (`forced` in its lines): what a full
collection costs at each point of the run, and what it does to the rounds it falls in.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import sys
import threading
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.probes.gc_pauses", description=__doc__)
    parser.add_argument("--over-ms", type=float, default=5.0, help="print collections longer than this")
    parser.add_argument("--collect-every", type=float, help="seconds between forced full collections")
    parser.add_argument("module", help="the benchmark module, e.g. benchmarks.moe")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for quiet in ("httpx", "uvicorn.access"):
        logging.getLogger(quiet).setLevel(logging.WARNING)
    started = [0.0]

    def timed(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        ms = (time.perf_counter() - started[0]) * 1e3
        if ms > args.over_ms:
            print(f"GC gen{info['generation']} {ms:.1f} ms collected {info['collected']}", flush=True)

    def force(every: float) -> None:
        while not done.wait(every):
            start = time.perf_counter()
            gc.collect()
            print(f"GC forced {(time.perf_counter() - start) * 1e3:.1f} ms", flush=True)

    done = threading.Event()
    forcing = None
    if args.collect_every:
        forcing = threading.Thread(
            target=force, args=(args.collect_every,), name="gc-pauses-forced", daemon=True
        )
        forcing.start()
    gc.callbacks.append(timed)
    try:
        code: int = importlib.import_module(args.module).main(args.args)
    finally:
        gc.callbacks.remove(timed)
        done.set()
        if forcing is not None:
            forcing.join()
    return code


if __name__ == "__main__":
    sys.exit(main())
