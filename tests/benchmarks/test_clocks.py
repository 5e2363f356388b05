"""benchmarks.clocks: nvidia-smi's samples read, windowed and summarised (a stand-in nvidia-smi here)."""

from __future__ import annotations

import datetime as dt
import stat
import sys
import time
from pathlib import Path

import pytest
import torch

from benchmarks import clocks

# A stand-in for `nvidia-smi -lms=20 --format=csv,noheader,nounits`: the real tool's line format, with
# its own timestamps; busy at 1,755 MHz with the power cap held until SWITCH, then idle at 1,980 MHz.
STAND_IN = """#!{python}
import datetime, sys, time
switch = float(open({switch!r}).read())
print("nvidia-smi warming up", flush=True)  # not a sample: skipped
while True:
    now = time.time()
    stamp = datetime.datetime.fromtimestamp(now).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
    if now < switch:
        row = [stamp, "1755", "698.41", "700.00", "61", "100", "Active", "Not Active", "Not Active"]
    else:
        row = [stamp, "1980", "121.02", "700.00", "55", "0", "Not Active", "Not Active", "Not Active"]
    print(", ".join(row), flush=True)
    time.sleep(0.02)
"""


def test_a_line_reads_as_a_sample() -> None:
    line = "2026/11/30 18:20:01.250, 1755, 698.41, 700.00, 61, 100, Active, Not Active, Active\n"
    sample = clocks.parse(line)
    assert sample is not None
    assert sample.at == pytest.approx(dt.datetime(2026, 11, 30, 18, 20, 1, 250000).timestamp())
    assert (sample.sm_mhz, sample.power_w, sample.limit_w, sample.celsius, sample.busy_percent) == (
        1755.0,
        698.41,
        700.0,
        61.0,
        100.0,
    )
    assert sample.power_capped
    assert sample.thermal
    assert clocks.parse("Failed to initialize NVML") is None
    assert clocks.parse("2026/11/30 18:20:01.250, [N/A], 1, 2, 3, 4, Active, Active, Active") is None


def test_a_window_counts_its_busy_samples_only() -> None:
    busy = [clocks.Sample(i, 1700.0 + i, 690.0, 700.0, 60.0 + i, 100.0, i < 3, False) for i in range(10)]
    idle = [clocks.Sample(20, 1980.0, 100.0, 700.0, 40.0, 0.0, False, False)]
    got = clocks.summarise(busy + idle)
    assert got == {
        "samples": 10,
        "sm_mhz_median": 1704.5,
        "sm_mhz_p10": 1701.0,
        "sm_mhz_max": 1709.0,
        "power_w_median": 690.0,
        "power_limit_w": 700.0,
        "celsius_max": 69.0,
        "power_capped_share": 0.3,
        "thermal_share": 0.0,
    }
    assert clocks.summarise(idle) == {"samples": 0}


def test_windows_take_the_samples_stamped_inside_them(tmp_path: Path) -> None:
    switch = tmp_path / "switch"
    switch.write_text(str(time.time() + 0.6))
    tool = tmp_path / "nvidia-smi"
    tool.write_text(STAND_IN.format(python=sys.executable, switch=str(switch)))
    tool.chmod(tool.stat().st_mode | stat.S_IEXEC)
    with clocks.ClockTrace.sampling(str(tool), "0") as trace:
        with clocks.window("capped"):
            time.sleep(0.4)
        time.sleep(0.4)
        with clocks.window("idle"):
            time.sleep(0.3)
    got = trace.summary()
    assert got["capped"]["samples"] >= 5
    assert (got["capped"]["sm_mhz_median"], got["capped"]["power_capped_share"]) == (1755.0, 1.0)
    assert got["capped"]["power_limit_w"] == 700.0
    assert got["idle"] == {"samples": 0}  # the GPU idle throughout: no busy sample
    assert trace.process is not None
    assert trace.process.poll() is not None


def test_off_a_gpu_nothing_is_sampled() -> None:
    with clocks.ClockTrace.start(torch.device("cpu")) as trace, clocks.window("anything"):
        pass
    assert trace.summary() == {}
    with clocks.window("no trace open"):  # a no-op, not an error
        pass
