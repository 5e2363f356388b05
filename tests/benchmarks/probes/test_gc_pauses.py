"""benchmarks.probes.gc_pauses: the wrapped module runs with its arguments, and its collections are
printed."""

from __future__ import annotations

import gc
import threading
from pathlib import Path

import pytest

from benchmarks.probes import gc_pauses

MODULE = """
import gc


def main(argv):
    print("args", argv)
    for _ in range(3):
        a, b = [], []
        a.append(b)
        b.append(a)
        del a, b
        gc.collect()
    return 7
"""


def test_the_module_runs_and_each_collection_over_the_threshold_is_printed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "garbage_maker.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    callbacks = list(gc.callbacks)
    assert gc_pauses.main(["--over-ms", "0", "garbage_maker", "--x", "1"]) == 7
    out = capsys.readouterr().out
    assert "args ['--x', '1']" in out
    lines = [line for line in out.splitlines() if line.startswith("GC gen2 ")]
    assert len(lines) >= 3
    assert all(int(line.rsplit(" ", 1)[1]) >= 0 for line in lines)
    assert gc.callbacks == callbacks  # removed again
    assert gc_pauses.main(["--over-ms", "1e9", "garbage_maker"]) == 7
    assert "GC gen" not in capsys.readouterr().out


def test_forced_collections_run_until_the_module_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # the module runs until it has seen two full collections (each takes as long as the test process's
    # heap makes it: over 0.5 s in a full suite), 30 s at most
    sleeper = (
        "import gc, time\n\n\ndef main(argv):\n"
        "    seen = []\n"
        "    def count(phase, info):\n"
        "        if phase == 'stop' and info['generation'] == 2:\n"
        "            seen.append(1)\n"
        "    gc.callbacks.append(count)\n"
        "    deadline = time.monotonic() + 30\n"
        "    while len(seen) < 2 and time.monotonic() < deadline:\n"
        "        time.sleep(0.02)\n"
        "    gc.callbacks.remove(count)\n"
        "    return 0 if len(seen) >= 2 else 1\n"
    )
    (tmp_path / "sleeper.py").write_text(sleeper)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert gc_pauses.main(["--collect-every", "0.1", "sleeper"]) == 0
    forced = [line for line in capsys.readouterr().out.splitlines() if line.startswith("GC forced ")]
    assert len(forced) >= 2
    assert "gc-pauses-forced" not in [t.name for t in threading.enumerate()]  # joined
