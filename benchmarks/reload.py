"""Hot weight reload on the GPU, per mode: how long staging takes, how long scoring pauses, and how
much GPU memory the reload needs beyond the served model.

    python -m benchmarks.reload --model qwen2.5-1.5b --model qwen2.5-7b    # results/reload-latest.json

Per model: random bf16 weights with the real shapes serve as v0; a second random checkpoint (v1) is
written with save_pretrained, then reloaded with mode copy, back to v0... and with mode swap. After
each reload every served tensor is compared with the checkpoint's (exactly) and a scored batch
must change. Peak memory is torch's allocator peak during stage + apply, minus what was allocated
before it.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from benchmarks.harness import RESULTS, build_model, provenance, write_result
from benchmarks.shapes import SHAPES
from benchmarks.workload import jobs, workload
from service.engine.contract import ReloadOrder
from service.engine.loading.pretrained import LoadedModel
from service.engine.ops.attention import choose_backend, register
from service.engine.scorer.engine import PackedScorer
from service.settings import Settings

GIB = 2**30


def save_checkpoint(name: str, directory: Path, device: torch.device, attn: str) -> None:
    model = build_model(dict(SHAPES[name]), torch.bfloat16, device, attn)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # other values than the served model's
    model.save_pretrained(directory)
    del model
    torch.cuda.empty_cache()


def served_equals(engine: PackedScorer, directory: Path) -> bool:
    served = dict(engine.served.policy.model.named_parameters())
    with safe_open(str(directory / "model.safetensors"), framework="pt", device="cpu") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
            if name in served and not torch.equal(
                served[name].cpu(), f.get_tensor(name).to(served[name].dtype)
            ):
                return False
    return True


def measure(
    engine: PackedScorer, directory: Path, version: str, mode: str, device: torch.device
) -> dict[str, Any]:
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    started = time.perf_counter()
    staged = engine.stage(ReloadOrder("policy", directory, version, mode))  # type: ignore[arg-type]
    staged_at = time.perf_counter()
    nbytes = staged.nbytes
    engine.apply(staged)
    torch.cuda.synchronize()
    done = time.perf_counter()
    peak = torch.cuda.max_memory_allocated(device) - before
    del staged
    return {
        "mode": mode,
        "bytes": nbytes,
        "stage_s": staged_at - started,
        "pause_ms": (done - staged_at) * 1e3,
        "extra_peak_gib": peak / GIB,
    }


def run_model(name: str, root: Path, device: torch.device) -> list[dict[str, Any]]:
    backend = choose_backend("auto", device)
    attn = register(backend)
    new = root / f"{name}-v1"
    save_checkpoint(name, new, device, attn)
    old = root / f"{name}-v0"
    model = build_model(dict(SHAPES[name]), torch.bfloat16, device, attn)
    model.save_pretrained(old)
    settings = Settings(device="cuda", dtype="bfloat16")
    engine = PackedScorer(LoadedModel(model, name, demo=False), device, backend, settings.engine_config())
    sample = jobs(workload(int(SHAPES[name]["vocab_size"])))[:8]
    baseline = [s.logprobs for s in engine.score(sample)]
    auto = engine.stage(ReloadOrder("policy", new, "probe")).mode
    rows = []
    for mode in ("copy", "swap"):
        row = measure(engine, new, "v1", mode, device)
        moved = [s.logprobs for s in engine.score(sample)]
        row.update(
            model=name,
            correct=served_equals(engine, new),
            scores_changed=not all(np.array_equal(a, b) for a, b in zip(baseline, moved, strict=True)),
            auto_would_pick=auto,
        )
        rows.append(row)
        measure(engine, old, "v0", mode, device)  # back, for the next mode
        back = [s.logprobs for s in engine.score(sample)]
        row["back_exact"] = all(np.array_equal(a, b) for a, b in zip(baseline, back, strict=True))
    del engine, model
    torch.cuda.empty_cache()
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line (tests/benchmarks/test_page.py parses each cited command with it)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reload", description=__doc__.splitlines()[0])
    parser.add_argument("--model", action="append", choices=sorted(SHAPES))
    parser.add_argument("--output", type=Path, default=RESULTS / "reload-latest.json")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device = torch.device("cuda")
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.model or ["qwen2.5-1.5b"]:
            rows += run_model(name, Path(tmp), device)
    print(
        "| model | mode | GiB | stage s | pause ms | extra GPU peak GiB | served = checkpoint | auto picks |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        ok = r["correct"] and r["scores_changed"] and r["back_exact"]
        print(
            f"| {r['model']} | {r['mode']} | {r['bytes'] / GIB:.2f} | {r['stage_s']:.2f} | "
            f"{r['pause_ms']:.1f} | {r['extra_peak_gib']:.2f} | {ok} | "
            f"{r['auto_would_pick']} |"
        )
    write_result(args.output, {**provenance("reload", device, argv), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
