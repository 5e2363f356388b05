"""Weight push in SGLang's protocol against a checkpoint reload: how soon a trainer's new weights
answer scores, how long scoring pauses, and how much device memory each mode takes.

    python -m benchmarks.push --model qwen2.5-7b                # a host of 2 GPUs: trainer 0, server 1
    python -m benchmarks.push --model qwen3-30b-a3b --no-reload-baseline --save-dir DISK
                                                                # the push alone (61 GB: one checkpoint)
    python -m benchmarks.push --model tiny --device cpu --dtype float32 --backend gloo --bucket-mib 1
                                                                # CPU smoke test (tests/benchmarks runs it)

This process is the trainer (rank 0, on --trainer-gpu): it holds the model (random weights with the
real shapes, transformers' Qwen2 or Qwen3-MoE), joins a real `python -m service serve` (on
--server-gpu) to its group as SGLang's trainers do, then for each of --modes (swap, copy) and load
format (one broadcast per tensor, flattened) perturbs its weights and pushes them as slime does:
/pause_generation, buckets of --bucket-mib with one weight_version, /continue_generation. Then the
same weights reach the server as a trainer without the protocol sends them: save_pretrained to
--save-dir, POST /admin/weights (left out with --no-reload-baseline). --model is a dense or a
mixture-of-experts shape (shapes.py).
benchmarks/push_soak.py pushes under concurrent scoring with this module's server and helpers.

Reported per run: seconds from the trainer's first call to the first scores answered on the new
version (`push_s`; for the reload, from save_pretrained's start), the scoring pause of the apply
(the server's logprobd_weights_pause_seconds), and the server GPU's peak memory in use during the
push above what it used before (nvidia-smi, polled; the caching allocator's reserve included).
The scores after a push equal, bit for bit, those after reloading the same weights. Last, a trainer
that stalls mid-bucket: the server answers 400 once --push-timeout-s passes (under NCCL: the group's
communicator aborted, never the server), keeps serving, and takes a new group that pushes again.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from benchmarks.harness import RESULTS, build_model, provenance, write_result
from benchmarks.server import free_port, serve_process
from benchmarks.shapes import MOE_SHAPES, SHAPES, shape_of
from service.engine.contract import WeightGroup
from service.engine.transfer import group as groups

ADMIN = "benchmark-admin"
HEADERS = {"Authorization": f"Bearer {ADMIN}"}
GIB = 2**30


@contextmanager
def server(
    checkpoint: Path, args: argparse.Namespace, version: str = "v0", extra: Sequence[str] = ()
) -> Iterator[str]:
    """`python -m service serve` on --server-gpu serving `checkpoint` as `version` (with `extra`
    arguments), with the admin key, once ready: its URL."""
    argv = ["--model", str(checkpoint), "--device", args.device, "--dtype", args.dtype,
            "--weights-version", version, "--weight-push-timeout-s", str(args.push_timeout_s),
            "--batch-wait-ms", "0", *extra]  # fmt: skip
    env = {"LOGPROBD_ADMIN_API_KEYS": ADMIN}
    if args.device == "cuda":
        env["CUDA_VISIBLE_DEVICES"] = str(args.server_gpu)
    with serve_process(argv, start_timeout=args.start_timeout, env=env, verbose=args.verbose) as url:
        yield url


class DeviceMemory:
    """The server GPU's memory in use (MiB), polled with nvidia-smi while `watching`; None on CPU."""

    def __init__(self, gpu: int | None) -> None:
        self.gpu = gpu
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def now(self) -> float | None:
        if self.gpu is None:
            return None
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", str(self.gpu)],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        return float(out.strip())

    @contextmanager
    def watching(self) -> Iterator[None]:
        self.peak = self.now() or 0.0
        self._stop.clear()

        def poll() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, self.now() or 0.0)
                time.sleep(0.05)

        self._thread = threading.Thread(target=poll, daemon=True)
        self._thread.start()
        try:
            yield
        finally:
            self._stop.set()
            self._thread.join()


def buckets(named: list[tuple[str, torch.Tensor]], limit: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors up to `limit` bytes each (a bigger tensor alone), in order (slime's)."""
    out: list[list[tuple[str, torch.Tensor]]] = [[]]
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if out[-1] and size + nbytes > limit:
            out.append([])
            size = 0
        out[-1].append((name, tensor))
        size += nbytes
    return out


def push(
    http: httpx.Client, url: str, pg: Any, named: list[tuple[str, torch.Tensor]], run: dict[str, Any]
) -> None:
    """slime's push: pause, each bucket (an HTTP call in a thread, its broadcasts here), continue."""
    assert http.post(f"{url}/pause_generation", json={}).status_code == 200
    for bucket in buckets(named, run["bucket_bytes"]):
        body: dict[str, Any] = {
            "names": [n for n, _ in bucket],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
            "shapes": [list(t.shape) for _, t in bucket],
            "group_name": run.get("group", "benchmark"),
            "flush_cache": False,
            "weight_version": run["version"],
            "mode": run["mode"],
        }
        if run["flattened"]:
            body["load_format"] = "flattened_bucket"
        reply: list[httpx.Response] = []
        call = threading.Thread(
            target=lambda b=body, into=reply: into.append(
                http.post(f"{url}/update_weights_from_distributed", json=b)
            )
        )
        call.start()
        if run["flattened"]:
            dist.broadcast(torch.cat([t.flatten().view(torch.uint8) for _, t in bucket]), src=0, group=pg)
        else:
            for _, tensor in bucket:
                dist.broadcast(tensor, src=0, group=pg)
        call.join()
        assert reply[0].status_code == 200, reply[0].text
    assert http.post(f"{url}/continue_generation", json={}).status_code == 200


def pauses(http: httpx.Client, url: str) -> tuple[float, int]:
    """The server's scoring pauses so far (logprobd_weights_pause_seconds: the engine's apply of each
    new version, between micro-batches): their sum in seconds and their count."""
    text = http.get(f"{url}/metrics").text
    found = [
        re.search(rf"^logprobd_weights_pause_seconds_{part} ([0-9.e+-]+)$", text, re.MULTILINE)
        for part in ("sum", "count")
    ]
    total, count = (float(m.group(1)) if m else 0.0 for m in found)
    return total, int(count)


def scores(http: httpx.Client, url: str, vocab: int, version: str) -> list[list[float]]:
    """A batch of 8 sequences of 256 tokens; asserts it was scored on `version`."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randint(0, vocab, (8, 256), generator=gen).tolist()
    reply = http.post(f"{url}/logprobs", json={"input_ids": rows, "num_actions": 128}).json()
    assert reply["weights_version"] == version, reply
    return list(reply["logprobs"])


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator(model.device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * 0.01)


def measured(
    http: httpx.Client, url: str, memory: DeviceMemory, *, vocab: int, version: str, deliver: Any
) -> dict[str, Any]:
    """Run `deliver()` (a push or a save + reload); time it to the first scores on `version`."""
    before = memory.now()
    paused, _ = pauses(http, url)
    with memory.watching():
        started = time.perf_counter()
        deliver()
        got = scores(http, url, vocab, version)
        seconds = time.perf_counter() - started
    return {
        "version": version,
        "push_s": seconds,
        "pause_ms": (pauses(http, url)[0] - paused) * 1e3,
        "extra_peak_gib": None if before is None else (memory.peak - before) / 1024,
        "scores": got,
    }


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.push", description=__doc__.split("\n")[0])
    common_arguments(parser, model="qwen2.5-7b", output="push-latest.json")
    parser.add_argument("--modes", nargs="+", default=["swap", "copy"], choices=["swap", "copy"])
    parser.add_argument(
        "--no-reload-baseline",
        dest="reload_baseline",
        action="store_false",
        help="push only: no save_pretrained + POST /admin/weights per mode (Qwen3-30B-A3B: 61 GB each)",
    )
    return parser


def common_arguments(parser: argparse.ArgumentParser, *, model: str, output: str) -> None:
    """What the push benchmarks share: the model, the trainer's and the server's devices, the group."""
    parser.add_argument("--model", default=model, choices=sorted(SHAPES | MOE_SHAPES))
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--trainer-gpu", type=int, default=0)
    parser.add_argument("--server-gpu", type=int, default=1)
    parser.add_argument("--bucket-mib", type=float, default=1024, help="slime's --update-weight-buffer-size")
    parser.add_argument("--output", type=Path, default=RESULTS / output)
    parser.add_argument(
        "--save-dir", type=Path, default=None, help="where save_pretrained writes (a tempdir)"
    )
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument(
        "--push-timeout-s", type=float, default=120, help="the server's (and this trainer's) group timeout"
    )
    parser.add_argument("--verbose", action="store_true", help="echo the server's log")


def trainer(args: argparse.Namespace) -> tuple[torch.device, Any]:
    """This process's device (--trainer-gpu, made current) and the model it trains: random weights of
    --model's shape in --dtype, built there."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", args.trainer_gpu) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    return device, build_model(shape_of(args.model), getattr(torch, args.dtype), device, "sdpa")


def gpus(args: argparse.Namespace) -> int:
    """The GPUs a run holds: the trainer's and the server's, one where they are the same."""
    return len({args.trainer_gpu, args.server_gpu})


def join(http: httpx.Client, url: str, args: argparse.Namespace, device: torch.device, name: str) -> Any:
    """The server joined to a new group of this trainer (rank 0, the store's host): the group, and
    seconds from the call to both joined."""
    port = free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2,
            "group_name": name, "backend": args.backend}  # fmt: skip
    replies: list[httpx.Response] = []
    call = threading.Thread(
        target=lambda: replies.append(http.post(f"{url}/init_weights_update_group", json=init))
    )
    started = time.perf_counter()
    call.start()
    spec = WeightGroup(name, "127.0.0.1", port, 1, 2, args.backend, args.push_timeout_s)
    joined = groups.join(spec, 0, device)
    call.join()
    assert replies[0].status_code == 200, replies[0].text
    return joined, time.perf_counter() - started


def stall(http: httpx.Client, url: str, joined: Any, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """A bucket of two tensors of which the trainer broadcasts one, then nothing: the server gives the
    push up once its group's timeout passes (NCCL: the communicator aborted, the server alive)."""
    body = {
        "names": [n for n, _ in named[:2]],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named[:2]],
        "shapes": [list(t.shape) for _, t in named[:2]],
        "group_name": joined.spec.name,
        "weight_version": "stalled",
    }
    reply: list[httpx.Response] = []
    call = threading.Thread(
        target=lambda: reply.append(http.post(f"{url}/update_weights_from_distributed", json=body))
    )
    call.start()
    dist.broadcast(named[0][1], src=0, group=joined.pg)
    started = time.perf_counter()
    call.join()
    groups.abort(joined)
    return {
        "status": reply[0].status_code,
        "given_up_s": time.perf_counter() - started,
        "body": reply[0].json(),
    }


def push_again(
    http: httpx.Client, url: str, args: argparse.Namespace, device: torch.device, *, model: Any, vocab: int
) -> bool:
    """After a stall: a new group is taken, and a version pushed over it serves."""
    again, _ = join(http, url, args, device, "after-stall")
    perturb(model, 99)
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    run = {
        "mode": "swap",
        "flattened": False,
        "bucket_bytes": int(args.bucket_mib * 2**20),
        "version": "again",
        "group": "after-stall",
    }
    push(http, url, again.pg, named, run)
    served = bool(scores(http, url, vocab, "again"))
    http.post(f"{url}/destroy_weights_update_group", json={"group_name": "after-stall"})
    dist.destroy_process_group(again.pg)
    return served


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    device, model = trainer(args)
    vocab = int(model.config.vocab_size)
    named = [(n, p.detach()) for n, p in model.state_dict(keep_vars=True).items()]
    named = [(n, t) for n, t in named if not (n == "lm_head.weight" and model.config.tie_word_embeddings)]
    memory = DeviceMemory(args.server_gpu if device.type == "cuda" else None)
    runs: list[dict[str, Any]] = []
    bucket_bytes = int(args.bucket_mib * 2**20)
    with tempfile.TemporaryDirectory(dir=args.save_dir) as tmp:
        root = Path(tmp)
        model.save_pretrained(root / "v0")
        with server(root / "v0", args) as url, httpx.Client(headers=HEADERS, timeout=3600) as http:
            joined, join_s = join(http, url, args, device, "benchmark")
            step = 0
            for mode in args.modes:
                for flattened in (False, True):
                    step += 1
                    perturb(model, step)
                    run = {
                        "mode": mode,
                        "flattened": flattened,
                        "bucket_bytes": bucket_bytes,
                        "version": f"push-{step}",
                    }
                    deliver = lambda r=run: push(http, url, joined.pg, named, r)  # noqa: E731
                    row = measured(
                        http, url, memory, vocab=vocab, version=str(run["version"]), deliver=deliver
                    )
                    runs.append({"how": "push", **run, **row})
            last = runs[-1]["scores"]
            bitwise: bool | None = None  # no reload to compare with
            if args.reload_baseline:
                runs += reloads(http, url, memory, args, model=model, root=root, vocab=vocab)
                bitwise = runs[-1]["scores"] == last  # the last push's weights, reloaded from disk
            stalled = stall(http, url, joined, named)
            stalled["still_served"] = scores(http, url, vocab, runs[-1]["version"]) == runs[-1]["scores"]
            stalled["pushed_after"] = push_again(http, url, args, device, model=model, vocab=vocab)
    report(args, runs, join_s, bitwise, stalled)
    rows = [{k: v for k, v in r.items() if k != "scores"} for r in runs]
    settings = {
        "model": args.model,
        "dtype": args.dtype,
        "backend": args.backend,
        "bucket_mib": args.bucket_mib,
        "push_timeout_s": args.push_timeout_s,
        "modes": args.modes,
        "reload_baseline": args.reload_baseline,
    }
    result = {**provenance("push", device, argv, gpus=gpus(args)), "settings": settings, "join_s": join_s}
    result.update(push_equals_reload_bitwise=bitwise, stall=stalled, runs=rows)
    write_result(args.output, result)
    survived = stalled["status"] == 400 and stalled["still_served"] and stalled["pushed_after"]
    return 0 if bitwise is not False and survived else 1


def reloads(
    http: httpx.Client,
    url: str,
    memory: DeviceMemory,
    args: argparse.Namespace,
    *,
    model: Any,
    root: Path,
    vocab: int,
) -> list[dict[str, Any]]:
    """The baseline, per mode: the trainer's weights as they stand saved (save_pretrained) and
    reloaded (POST /admin/weights), timed to the first scores on them."""
    runs = []
    for mode in args.modes:
        path = root / f"reload-{mode}"

        def reload(path: Path = path, mode: str = mode) -> None:
            model.save_pretrained(path)
            body = {"path": str(path), "version": f"reload-{mode}", "mode": mode}
            answer = http.post(f"{url}/admin/weights", json=body)
            assert answer.status_code == 200, answer.text

        row = measured(http, url, memory, vocab=vocab, version=f"reload-{mode}", deliver=reload)
        runs.append({"how": "save_pretrained + reload", "mode": mode, **row})
    return runs


def report(
    args: argparse.Namespace,
    runs: list[dict[str, Any]],
    join_s: float,
    bitwise: bool | None,
    stalled: dict[str, Any],
) -> None:
    print(
        f"{args.model} {args.dtype} over {args.backend}: group joined in {join_s:.2f} s; push == reload "
        f"bitwise: {'not measured' if bitwise is None else bitwise}; "
        f"a stalled trainer given up after {stalled['given_up_s']:.1f} s "
        f"(timeout {args.push_timeout_s:g} s), answered {stalled['status']}, the last version still served: "
        f"{stalled['still_served']}, a new group pushed: {stalled['pushed_after']}"
    )
    print("| how | mode | format | first call to scores, s | pause ms | server GPU peak beyond, GiB |")
    print("| --- | --- | --- | ---: | ---: | ---: |")
    for r in runs:
        fmt = ("flattened" if r.get("flattened") else "per tensor") if r["how"] == "push" else "-"
        peak = "-" if r["extra_peak_gib"] is None else f"{r['extra_peak_gib']:.2f}"
        print(f"| {r['how']} | {r['mode']} | {fmt} | {r['push_s']:.2f} | {r['pause_ms']:.2f} | {peak} |")


if __name__ == "__main__":
    raise SystemExit(main())
