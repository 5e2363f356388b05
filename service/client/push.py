"""Push a trainer's weights to logprobd replicas over NCCL (or gloo), in SGLang's protocol (docs/api.md,
"Weight push"): `WeightPusher` for every step of a training run, `push_weights` for one push.

The trainer is rank 0 of one group with every replica: world size 1 + the sum of the replicas'
tensor-parallel sizes (`GET /server_info`'s `tp_size`), replica i at rank offset 1 + the sizes before
it. A push sends the tensors in buckets of about `bucket_bytes`: per bucket, `POST
/update_weights_from_distributed` to every replica at once (the metadata: names, dtypes, shapes, the
version, the target), then rank 0's broadcasts (one flattened uint8 tensor, or one per tensor), then
the answers. While one bucket's broadcasts run, the next is gathered and packed; no more. At the end
`POST /continue_generation` serves the version on every replica (a version that arrived whole already
serves; one that did not serves as it stands), and each replica's `/info` must report it: `push`
returns once every replica serves the new weights, so that scores pinned to the version are the new
weights' everywhere.

A push that fails (a replica refuses a bucket, one goes away, a broadcast stalls) raises a
LogprobdError naming every replica that failed, and the group is torn down, which drops the version
the replicas held pending: each keeps serving its last version. The next push joins a new group.

torch is imported when a group is made or a push runs (a trainer has it; the plain client does not).
"""

from __future__ import annotations

import itertools
import logging
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any

from service.client._buckets import FLATTENED, named_tensors
from service.client._common import serving_version
from service.client._fleet import Fleet, Reply, failure
from service.client._rank0 import Rank0, reach_address
from service.client._transfer import Push, send
from service.client.errors import LogprobdError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

TARGETS = ("policy", "reference", "critic")
VERSION = re.compile(r"^[A-Za-z0-9._:+/@-]{1,128}$")  # what a replica takes as a version


@dataclass(frozen=True, slots=True)
class PushResult:
    """What one push sent; `seconds` from its first bucket until every replica served it (making the
    group excluded); `serving`: every replica serves it (False only with commit=False when the version
    did not arrive whole)."""

    version: str
    target: str
    replicas: tuple[str, ...]
    buckets: int
    tensors: int
    nbytes: int
    seconds: float
    serving: bool


class WeightPusher:
    """Rank 0 of a weight-update group with `urls` (one replica, or a fleet: `resolve_replicas`).

    `backend`: "nccl" (tensors go from this process's current GPU) or "gloo" (from host memory);
    default nccl when CUDA is available. `master_address`: where replicas reach this process (default:
    the address this host uses to reach the first replica); `master_port`: 0 picks a free one. The
    replicas must dial it (their `--weight-push-addresses` allow-list). `load_format`:
    "flattened_bucket" (one broadcast per bucket) or None (one per tensor). `timeout_s` bounds the
    rendezvous, each bucket's broadcasts and each call. Pushes from several threads run one at a time.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        admin_key: str | None = None,
        backend: str | None = None,
        group_name: str = "logprobd-push",
        bucket_bytes: int = 512 << 20,
        load_format: str | None = FLATTENED,
        master_address: str | None = None,
        master_port: int = 0,
        timeout_s: float = 300.0,
    ) -> None:
        if load_format not in (FLATTENED, None):
            raise ValueError(f"load_format is {FLATTENED!r} or None, not {load_format!r}")
        if bucket_bytes < 1 or timeout_s <= 0:
            raise ValueError("bucket_bytes and timeout_s must be positive")
        self._fleet = Fleet([urls] if isinstance(urls, str) else urls, admin_key, timeout_s)
        self.urls = self._fleet.urls
        self.group_name = group_name
        self.bucket_bytes = bucket_bytes
        self.load_format = load_format
        self.timeout_s = timeout_s
        self._backend = backend
        self._address, self._port = master_address, master_port
        self._rank0: Rank0 | None = None
        self._targets: dict[str, set[str]] = {}
        self.rank_offsets: tuple[int, ...] = ()
        self._lock = threading.Lock()

    @property
    def backend(self) -> str:
        if self._backend is None:
            import torch

            self._backend = "nccl" if torch.cuda.is_available() else "gloo"
        return self._backend

    @property
    def connected(self) -> bool:
        return self._rank0 is not None

    def connect(self) -> None:
        """Join the group with every replica (done by the first push; again after a failed one)."""
        if self._rank0 is not None:
            return
        infos = self._fleet.call("GET", "/server_info")
        _raise(failure(infos, "GET /server_info"))
        described = self._fleet.call("GET", "/info")
        _raise(failure(described, "GET /info"))
        self._targets = {r.url: set((r.body or {}).get("weights") or {}) for r in described}
        sizes = [int((r.body or {}).get("tp_size", 1)) for r in infos]
        self.rank_offsets = tuple(1 + sum(sizes[:i]) for i in range(len(sizes)))
        address = self._address or reach_address(self.urls[0])
        rank0 = Rank0(
            self.group_name,
            self.backend,
            1 + sum(sizes),
            address=address,
            port=self._port,
            timeout_s=self.timeout_s,
        )
        bodies = [
            {
                "master_address": address,
                "master_port": rank0.port,
                "rank_offset": offset,
                "world_size": rank0.world_size,
                "group_name": self.group_name,
                "backend": self.backend,
            }
            for offset in self.rank_offsets
        ]
        replies = self._fleet.send("POST", "/init_weights_update_group", bodies)
        rank0.start()
        try:
            self._await_join(rank0, replies)
        except BaseException:
            self._leave(rank0, {f.result().url for f in replies if f.done() and f.result().ok})
            raise
        self._rank0 = rank0
        log.info("joined weight-update group %r of %d ranks", self.group_name, rank0.world_size)

    def push(
        self,
        source: Any,
        *,
        version: str,
        target: str = "policy",
        dtype: torch.dtype | None = None,
        commit: bool = True,
        mode: str | None = None,
    ) -> PushResult:
        """Push `source` (a module, a state dict or an iterable of (name, tensor) pairs, Hugging Face
        names) as `target`'s weights `version`; returns once every replica serves them (commit=False:
        a version that did not arrive whole stays pending on the replicas, for a later push of the
        same version or /continue_generation). `dtype` casts floating-point tensors on the way;
        `mode` is the replicas' staging mode (swap, copy, auto; their --reload-mode by default)."""
        if not VERSION.fullmatch(version):
            raise ValueError(f"version {version!r}: 1-128 of A-Z a-z 0-9 . _ : + / @ -")
        if target not in TARGETS:
            raise ValueError(f"target is one of {', '.join(TARGETS)}, not {target!r}")
        with self._lock:
            self.connect()
            missing = [url for url in self.urls if target not in self._targets.get(url, ())]
            if missing:
                raise LogprobdError(
                    f"no {target} model on {', '.join(missing)}", error_type="invalid_request"
                )
            pairs = named_tensors(source)
            first = next(pairs, None)
            if first is None:
                raise ValueError("the source holds no tensors")
            spec = self._spec(version, target, dtype, mode)
            started = time.perf_counter()
            try:
                assert self._rank0 is not None
                sent = send(self._fleet, self._rank0, itertools.chain([first], pairs), spec)
                if commit:
                    ended = self._fleet.call("POST", "/continue_generation", [{}] * len(self.urls))
                    _raise(failure(ended, "POST /continue_generation"))
            except BaseException:
                self._abandon()
                raise
            serving = self._serving(version, target, required=commit)
        seconds = time.perf_counter() - started
        return PushResult(
            version, target, self.urls, sent.buckets, sent.tensors, sent.nbytes, seconds, serving
        )

    def close(self) -> None:
        """Leave the group on every replica and here; the pusher can connect again after."""
        with self._lock:
            rank0, self._rank0 = self._rank0, None
            if rank0 is not None:
                self._leave(rank0, set(self.urls))
            self._fleet.close()

    def __enter__(self) -> WeightPusher:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # ---- internals --------------------------------------------------------------------------------

    def _spec(self, version: str, target: str, dtype: torch.dtype | None, mode: str | None) -> Push:
        """What each bucket of this push carries besides its tensors."""
        fields: dict[str, Any] = {
            "group_name": self.group_name,
            "weight_version": version,
            "target": target,
            "flush_cache": False,
        }
        if self.load_format is not None:
            fields["load_format"] = self.load_format
        if mode is not None:
            fields["mode"] = mode
        what = f"the {target}'s version {version!r}"
        return Push(fields, self.bucket_bytes, self.load_format is not None, dtype, self.timeout_s, what)

    def _serving(self, version: str, target: str, required: bool) -> bool:
        """Whether every replica's /info says `target` serves `version`; raises when required and not."""
        replies = self._fleet.call("GET", "/info")
        _raise(failure(replies, "GET /info"))
        behind = {r.url: serving_version(r.body or {}, target) for r in replies}
        behind = {url: served for url, served in behind.items() if served != version}
        if behind and required:
            detail = "; ".join(f"{url} serves {served!r}" for url, served in behind.items())
            raise LogprobdError(
                f"the {target}'s version {version!r} was pushed but does not serve: {detail}",
                error_type="not_serving",
                replicas={url: f"serves {served!r}" for url, served in behind.items()},
            )
        return not behind

    def _await_join(self, rank0: Rank0, replies: list[Future[Reply]]) -> None:
        """Wait until this process and every replica joined; raise at the first replica that refused."""
        deadline = time.monotonic() + self.timeout_s + 10
        while True:
            try:
                joined = rank0.joined(0.05)
            except Exception as exc:
                raise LogprobdError(f"making the group failed: {exc}", error_type="group_failed") from exc
            if joined and all(f.done() for f in replies):
                _raise(failure([f.result() for f in replies], "POST /init_weights_update_group"))
                return
            _raise(failure([f.result() for f in replies if f.done()], "POST /init_weights_update_group"))
            if time.monotonic() > deadline:
                raise LogprobdError(
                    f"the group did not form within {self.timeout_s:g} s", error_type="timeout"
                )

    def _abandon(self) -> None:
        """Tear the group down after a failed push, here (no broadcast of it goes on), then on every
        replica, which drops the version it held pending; returns once each has left."""
        rank0, self._rank0 = self._rank0, None
        if rank0 is not None:
            rank0.close()
            self._leave(rank0, set(self.urls), timeout=self.timeout_s + 30)

    def _leave(self, rank0: Rank0, joined: set[str], timeout: float = 30.0) -> None:
        """Destroy the group on the replicas in `joined`, then here; failures are logged only. A
        replica still receiving a bucket answers once its receive ends (at the latest, its
        --weight-push-timeout-s after the broadcasts stopped)."""
        urls = [url for url in self.urls if url in joined]
        body = {"group_name": self.group_name}
        left = self._fleet.send(
            "POST", "/destroy_weights_update_group", [body] * len(urls), urls=urls, timeout=timeout
        )
        for future in left:
            reply = future.result()
            if not reply.ok:
                log.warning("leaving group %r on %s: %s", self.group_name, reply.url, reply.message)
        rank0.close()


def push_weights(
    urls: str | Sequence[str],
    source: Any,
    *,
    version: str,
    admin_key: str | None = None,
    target: str = "policy",
    dtype: torch.dtype | None = None,
    **options: Any,
) -> PushResult:
    """One push with a group made for it and left after: `WeightPusher(urls, admin_key=...,
    **options).push(source, version=..., target=..., dtype=...)`."""
    with WeightPusher(urls, admin_key=admin_key, **options) as pusher:
        return pusher.push(source, version=version, target=target, dtype=dtype)


def _raise(error: LogprobdError | None) -> None:
    if error is not None:
        raise error
