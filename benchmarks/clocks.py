"""The GPU's clock and power while a benchmark runs: whether a round ran at the clock its floor's
matmul rate was measured at.

    with ClockTrace.start(device) as trace:
        with window("matmul"):       # the innermost open trace's window (a no-op where none is)
            ...                      # what runs here is sampled
    trace.summary()                  # {"matmul": {...}, ...}, or {} where nothing could sample

`nvidia-smi` samples the device every SAMPLE_MS in a process of its own (query fields below); each
sample carries nvidia-smi's own timestamp, so a window takes the samples stamped between its start
and its end, whatever the pipe's buffering. A window's summary: its samples, the SM clock's median,
10th percentile and maximum (MHz), the median power (W) against the enforced limit, the hottest
temperature, and the share of the samples in which the driver held the clock down for power
(`sw_power_cap`) or heat (`sw_thermal_slowdown`, `hw_slowdown`). Only samples of a busy GPU
(utilisation ≥ BUSY_PERCENT) count, so a window's idle gaps do not pull its clock up. Off a GPU, or
without nvidia-smi, nothing is sampled and summary() is empty.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import shutil
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

SAMPLE_MS = 20
_OPEN: list[ClockTrace] = []  # the traces entered and not yet left, innermost last (window())
BUSY_PERCENT = 50
FIELDS = (
    "timestamp",
    "clocks.sm",
    "power.draw",
    "enforced.power.limit",
    "temperature.gpu",
    "utilization.gpu",
    "clocks_event_reasons.sw_power_cap",
    "clocks_event_reasons.sw_thermal_slowdown",
    "clocks_event_reasons.hw_slowdown",
)


@dataclass(frozen=True, slots=True)
class Sample:
    """One nvidia-smi line: when (epoch seconds), SM clock MHz, power W, its limit W, °C, utilisation
    %, and whether power, software thermal or hardware slowdown held the clock."""

    at: float
    sm_mhz: float
    power_w: float
    limit_w: float
    celsius: float
    busy_percent: float
    power_capped: bool
    thermal: bool


def parse(line: str) -> Sample | None:
    """A CSV line (noheader, nounits) of FIELDS, or None where it is not one (a warning, a blank)."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return None
    try:
        at = dt.datetime.strptime(parts[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        sm, power, limit, celsius, busy = (float(p) for p in parts[1:6])
    except ValueError:
        return None
    capped, thermal, slowdown = (p.lower() == "active" for p in parts[6:])
    return Sample(at, sm, power, limit, celsius, busy, power_capped=capped, thermal=thermal or slowdown)


def summarise(samples: list[Sample]) -> dict[str, Any]:
    """A window's figures (see the module) over its busy samples; {"samples": 0} where none was busy."""
    busy = [s for s in samples if s.busy_percent >= BUSY_PERCENT]
    if not busy:
        return {"samples": 0}
    clocks = sorted(s.sm_mhz for s in busy)
    return {
        "samples": len(busy),
        "sm_mhz_median": statistics.median(clocks),
        "sm_mhz_p10": clocks[len(clocks) // 10],
        "sm_mhz_max": clocks[-1],
        "power_w_median": statistics.median(s.power_w for s in busy),
        "power_limit_w": busy[0].limit_w,
        "celsius_max": max(s.celsius for s in busy),
        "power_capped_share": sum(s.power_capped for s in busy) / len(busy),
        "thermal_share": sum(s.thermal for s in busy) / len(busy),
    }


@dataclass
class ClockTrace:
    """nvidia-smi sampling one device in the background; windows name spans of the run."""

    process: subprocess.Popen[str] | None
    samples: list[Sample] = field(default_factory=list)
    windows: dict[str, tuple[float, float]] = field(default_factory=dict)
    reader: threading.Thread | None = None

    @classmethod
    def start(cls, device: torch.device) -> ClockTrace:
        """Sampling `device` (by its UUID) where it is a GPU and nvidia-smi is on the PATH; else idle."""
        tool = shutil.which("nvidia-smi")
        if device.type != "cuda" or tool is None:
            return cls(None)
        return cls.sampling(tool, f"GPU-{torch.cuda.get_device_properties(device).uuid}")

    @classmethod
    def sampling(cls, tool: str, gpu: str) -> ClockTrace:
        """`tool` (nvidia-smi's path) sampling the GPU `gpu` (an index or a UUID) from now on."""
        query = ",".join(FIELDS)
        cmd = [tool, "-i", gpu, f"--query-gpu={query}", "--format=csv,noheader,nounits", f"-lms={SAMPLE_MS}"]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        trace = cls(process)
        trace.reader = threading.Thread(target=trace._read, name="clock-trace", daemon=True)
        trace.reader.start()
        return trace

    def _read(self) -> None:
        assert self.process is not None
        assert self.process.stdout is not None
        for line in self.process.stdout:
            sample = parse(line)
            if sample is not None:
                self.samples.append(sample)

    @contextlib.contextmanager
    def window(self, name: str) -> Iterator[None]:
        """Marks what runs inside as `name` (wall clock, as nvidia-smi stamps its samples)."""
        began = time.time()
        try:
            yield
        finally:
            self.windows[name] = (began, time.time())

    def stop(self) -> None:
        """Ends the sampling, after the samples of the last window are in."""
        if self.process is None:
            return
        time.sleep(3 * SAMPLE_MS / 1e3)
        self.process.terminate()
        self.process.wait(timeout=10)
        if self.reader is not None:
            self.reader.join(timeout=10)
        if self.process.stdout is not None:
            self.process.stdout.close()

    def summary(self) -> dict[str, dict[str, Any]]:
        """Each window's figures (summarise) over the samples stamped inside it."""
        if self.process is None:
            return {}
        return {
            name: summarise([s for s in self.samples if began <= s.at <= ended])
            for name, (began, ended) in self.windows.items()
        }

    def __enter__(self) -> ClockTrace:
        _OPEN.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _OPEN.remove(self)
        self.stop()


@contextlib.contextmanager
def window(name: str) -> Iterator[None]:
    """The innermost open trace's window `name`; nothing where no trace is open."""
    if not _OPEN:
        yield
        return
    with _OPEN[-1].window(name):
        yield
