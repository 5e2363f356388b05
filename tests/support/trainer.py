"""A trainer's side of SGLang's weight push, rank 0, for tests: SGLang's own released helpers make
the group and pack flattened buckets; the HTTP calls are the payloads slime and AReaL send.

SGLang's `init_custom_process_group` (sglang.srt.utils) and `FlattenedTensorBucket`
(sglang.srt.weight_sync.tensor_bucket) come from the sglang 0.5.15.post1 release installed with
`--no-deps` beside the other framework releases (requirements-frameworks.txt; LOGPROBD_SGLANG_PATH
adds folders to look in). Importing sglang patches transformers, so the trainer is a process of its
own (`python -m tests.support.trainer`): `Trainer` starts it and sends it one JSON command a line, and it
answers one JSON line each. It pushes the tensors of a safetensors checkpoint (the Hugging Face
names) or of a model's `named_parameters()` (transformers' own names: experts fused).

Payloads (sglang_engine.py of slime, areal/engine/sglang_remote.py of AReaL, /work/notes/51):
- slime: POST /pause_generation {}, GET /flush_cache, each bucket with flush_cache false and the
  same weight_version, POST /continue_generation {};
- areal: master_port as a string; POST /pause_generation {}, each bucket with abort_all_requests true
  and no weight_version, POST /continue_generation {};
- plain: buckets only (SGLang's own test).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from tests.support import ROOT

FRAMEWORKS = Path(sys.prefix) / "frameworks"


class Trainer:
    """The trainer process; `call(op, **args)` sends it a command and returns its answer."""

    def __init__(self, log: Path) -> None:
        self._sink = log.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.trainer"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._sink,
            text=True,
        )
        self.log = log
        assert self.read(timeout=180)["ready"], "the trainer did not start"

    def call(self, op: str, timeout: float = 120.0, **args: Any) -> dict[str, Any]:
        self.send(op, **args)
        return self.read(timeout)

    def send(self, op: str, **args: Any) -> None:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.process.stdin.flush()

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.process.stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(self.process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            hint = (
                ""
                if self.process.poll() is None
                else " (it exited: are the releases installed? make install)"
            )
            raise RuntimeError(
                f"the trainer did not answer in {timeout} s{hint}\n{self.log.read_text()[-4000:]}"
            )
        answer: dict[str, Any] = json.loads(box[0])
        if "error" in answer:
            raise RuntimeError(f"trainer: {answer['error']}\n{self.log.read_text()[-4000:]}")
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=30)
        for pipe in (self.process.stdin, self.process.stdout):
            if pipe is not None:
                pipe.close()
        self._sink.close()


@contextmanager
def trainer(log: Path) -> Iterator[Trainer]:
    started = Trainer(log)
    try:
        yield started
    finally:
        started.close()


# ---- the trainer process ---------------------------------------------------------------------


def _import_sglang() -> tuple[Any, Any]:
    """SGLang's init_custom_process_group and FlattenedTensorBucket, from its release: transformers
    first (it caches that torchvision is absent), then stand-ins for the two imports that need what a
    CPU host lacks (torchvision's CUDA build, IPython), which SGLang's helpers never call."""
    import importlib.abc
    import importlib.machinery
    import types

    import transformers  # noqa: F401

    class Module(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return type(name, (), {})

    class StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
            if name.partition(".")[0] not in ("torchvision", "IPython"):
                return None
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec: Any) -> types.ModuleType:
            module = Module(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module: types.ModuleType) -> None:
            pass

    extra = [p for p in os.environ.get("LOGPROBD_SGLANG_PATH", "").split(":") if p]
    sys.path += [*extra, str(FRAMEWORKS)]  # after the environment's own packages: they win
    sys.meta_path.insert(0, StandIn())
    from sglang.srt.utils import init_custom_process_group  # type: ignore[import-not-found]
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket  # type: ignore[import-not-found]

    return init_custom_process_group, FlattenedTensorBucket


class _Process:
    def __init__(self) -> None:
        import httpx

        self.init_group, self.bucket_class = _import_sglang()
        # a connection per call, as slime's and SGLang's `requests.post` make: a kept-alive one may be
        # closed by the server (uvicorn: 5 s idle) as the next call goes out on it
        self.http = httpx.Client(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))
        self.groups: dict[str, Any] = {}

    def post_all(self, urls: list[str], path: str, bodies: list[Any], headers: dict[str, str]) -> list[Any]:
        """POST each body to its url, each from its own thread (the calls block until the broadcasts
        they wait for are done); the threads, to join after broadcasting."""
        replies: list[Any] = [None] * len(urls)

        def post(i: int) -> None:
            try:
                r = self.http.post(f"{urls[i]}{path}", json=bodies[i], headers=headers)
                replies[i] = {"status": r.status_code, "body": _body(r)}
            except Exception as exc:
                replies[i] = {"status": None, "body": f"{type(exc).__name__}: {exc}"}

        threads = [threading.Thread(target=post, args=(i,)) for i in range(len(urls))]
        for thread in threads:
            thread.start()
        return [threads, replies]

    def init(self, a: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        port = a["port"]
        bodies = [
            {
                "master_address": "127.0.0.1",
                "master_port": str(port) if a.get("port_as_string") else port,
                "rank_offset": offset,
                "world_size": a["world_size"],
                "group_name": a["group"],
                "backend": a.get("backend", "gloo"),
                **a.get("extra", {}),
            }
            for offset in a["rank_offsets"]
        ]
        threads, replies = self.post_all(
            a["urls"], "/init_weights_update_group", bodies, a.get("headers", {})
        )
        try:
            pg = self.init_group(
                backend=a.get("backend", "gloo"),
                init_method=f"tcp://127.0.0.1:{port}",
                world_size=a["world_size"],
                rank=0,
                group_name=a["group"],
                timeout=datetime.timedelta(seconds=a.get("timeout_s", 60)),
            )
        except Exception as exc:  # which server did not join, and what it answered
            for thread in threads:
                thread.join(timeout=60)
            raise RuntimeError(f"{type(exc).__name__}: {exc}; the servers answered {replies}") from exc
        for thread in threads:
            thread.join()
        self.groups[a["group"]] = pg
        dist.barrier(group=pg) if a.get("barrier") else None
        return {"replies": replies}

    def push(self, a: dict[str, Any]) -> dict[str, Any]:
        named = _tensors(a)
        urls, headers, style = a["urls"], a.get("headers", {}), a.get("style", "plain")
        calls: list[Any] = []
        if style in ("slime", "areal"):
            calls.append(self._each(urls, "post", "/pause_generation", {}, headers))
        if style == "slime":
            calls.append(self._each(urls, "get", "/flush_cache", None, headers))
        count = a.get("buckets", 1)
        size = -(-len(named) // count)
        for start in range(0, len(named), size):
            bucket = named[start : start + size]
            body: dict[str, Any] = {
                "names": [n for n, _ in bucket],
                "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
                "shapes": [list(t.shape) for _, t in bucket],
                "group_name": a["group"],
                **a.get("extra", {}),
            }
            if style == "slime":
                body.update(flush_cache=False, weight_version=a["version"])
            elif style == "areal":
                body.update(abort_all_requests=True)
            elif a.get("version") is not None:
                body["weight_version"] = a["version"]
            calls.append(self.bucket(urls, body, bucket, a, headers))
            if a.get("stop_after") is not None:
                return {"calls": calls}
        if style in ("slime", "areal"):
            calls.append(self._each(urls, "post", "/continue_generation", {}, headers))
        return {"calls": calls, "names": [n for n, _ in named]}

    def bucket(
        self,
        urls: list[str],
        body: dict[str, Any],
        bucket: list[Any],
        a: dict[str, Any],
        headers: dict[str, str],
    ) -> list[Any]:
        """One /update_weights_from_distributed on every server, and its broadcasts."""
        import torch.distributed as dist

        pg = self.groups[a["group"]]
        if a.get("flattened"):
            body["load_format"] = "flattened_bucket"
        threads, replies = self.post_all(
            urls, "/update_weights_from_distributed", [body] * len(urls), headers
        )
        if a.get("flattened"):
            flat = self.bucket_class(named_tensors=bucket).get_flattened_tensor()
            dist.broadcast(flat, src=0, group=pg)
        else:
            stop = a.get("stop_after")
            for i, (_, tensor) in enumerate(bucket):
                if stop is not None and i == stop:
                    print(json.dumps({"stalled": i}), flush=True)
                    time.sleep(3600)  # a trainer stuck mid-bucket; the test kills it
                dist.broadcast(tensor.contiguous(), src=0, group=pg)
        for thread in threads:
            thread.join()
        return list(replies)

    def raw(self, a: dict[str, Any]) -> dict[str, Any]:
        """A bucket of any metadata, and broadcasts of the tensors `send` describes ([dtype, shape]
        each; flattened: packed by SGLang's FlattenedTensorBucket, however they align)."""
        import torch

        sent = [
            (str(i), torch.full(shape, 0.5, dtype=getattr(torch, dtype)))
            for i, (dtype, shape) in enumerate(a["send"])
        ]
        return {"replies": self.bucket(a["urls"], dict(a["body"]), sent, a, a.get("headers", {}))}

    def destroy(self, a: dict[str, Any]) -> dict[str, Any]:
        import torch.distributed as dist

        bodies = [{"group_name": a["group"]}] * len(a["urls"])
        threads, replies = self.post_all(
            a["urls"], "/destroy_weights_update_group", bodies, a.get("headers", {})
        )
        for thread in threads:
            thread.join()
        pg = self.groups.pop(a["group"], None)
        if pg is not None:
            dist.destroy_process_group(pg)
        return {"replies": replies}

    def _each(self, urls: list[str], method: str, path: str, body: Any, headers: dict[str, str]) -> list[Any]:
        out = []
        for url in urls:
            r = self.http.request(method, f"{url}{path}", json=body, headers=headers)
            out.append({"status": r.status_code, "body": _body(r)})
        return out


def _body(reply: Any) -> Any:
    try:
        return reply.json()
    except ValueError:
        return reply.text


def _tensors(a: dict[str, Any]) -> list[tuple[str, Any]]:
    """The named tensors to push: a checkpoint's (its names, in file order) or a model's
    named_parameters(); cast to `dtype`, less `skip`."""
    import torch
    from safetensors import safe_open

    path = Path(a["checkpoint"])
    named: list[tuple[str, Any]] = []
    if a.get("names") == "module":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        named = [(n, p.detach()) for n, p in model.named_parameters()]
    else:
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                named += [(name, f.get_tensor(name)) for name in f.keys()]  # noqa: SIM118
    for name, (copied, plus) in a.get("add", {}).items():  # e.g. a tied lm_head.weight, sent too
        named.append((name, dict(named)[copied] + plus))
    dtype = getattr(torch, a["dtype"]) if a.get("dtype") else None
    skip, only = set(a.get("skip", [])), a.get("only")
    kept = [(n, t) for n, t in named if n not in skip and (only is None or n in only)]
    return [(n, t.to(dtype) if dtype is not None else t) for n, t in kept]


def main() -> None:
    process = _Process()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        try:
            answer = getattr(process, command.pop("op"))(command)
        except Exception as exc:
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)


if __name__ == "__main__":
    main()
