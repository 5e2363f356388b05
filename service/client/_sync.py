"""`Client`: the blocking client. Chunks of one call go out concurrently on a thread pool."""

from __future__ import annotations

import random
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from types import TracebackType
from typing import Any

import httpx

from service.client._common import (
    ClientConfig,
    Timeout,
    encode,
    finish,
    give_up_unless_retryable,
    reload_failures,
    reply_body,
    response_failure,
    serving_version,
    transport_failure,
    weights_request,
)
from service.client.errors import LogprobdError
from service.client.fanout import Chunk
from service.client.replicas import ReplicaPool
from service.client.retry import RetryPolicy
from service.client.wire import Distribution, IntRows, Scores, ToList, build_body


class Client:
    """A logprobd client for one server or a set of replicas serving the same model.

    `score` splits a batch into chunks of whole rows (at most `max_chunk_rows` rows and
    `max_chunk_tokens` real tokens each, and at least one chunk per replica), sends up to
    `max_concurrency` at once to the least loaded replicas, retries what may pass (`retry`), and
    returns the rows in the caller's order. Any other error raises `LogprobdError`. Thread-safe;
    close it (or use `with`) to free its connections and threads. Bodies travel as compact frames
    (`application/vnd.logprobd.arrays`: the rows as binary arrays, no decimal numbers to write or
    read); `frames=False` sends and accepts JSON.

    Rows that share a prompt (a GRPO group) go to the same replica, so that its prefix cache computes
    the prompt once (group_keys.py: a row's group key hashes its prompt, or its first `group_key_tokens`
    tokens); every request names its first row's key in the X-Logprobd-Group header, and
    `split_groups=True` sends each group as a request of its own, for a load balancer that hashes
    on that header (docs/deploying.md).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        *,
        api_key: str | None = None,
        timeout: Timeout = 300.0,
        max_chunk_tokens: int = 16384,
        max_chunk_rows: int = 512,
        max_concurrency: int = 8,
        retry: RetryPolicy | None = None,
        transport: httpx.BaseTransport | None = None,
        frames: bool = True,
        group_key_tokens: int | None = None,
        split_groups: bool = False,
    ) -> None:
        self.config = ClientConfig.create(
            base_url,
            api_key=api_key,
            timeout=timeout,
            max_chunk_tokens=max_chunk_tokens,
            max_chunk_rows=max_chunk_rows,
            max_concurrency=max_concurrency,
            retry=retry,
            frames=frames,
            group_key_tokens=group_key_tokens,
            split_groups=split_groups,
        )
        self._pool = ReplicaPool(self.config.urls)
        self._rng = random.Random()
        self._http = httpx.Client(
            headers=self.config.headers, timeout=self.config.timeout, transport=transport
        )
        self._threads = ThreadPoolExecutor(max_concurrency, thread_name_prefix="logprobd-client")

    def score(
        self,
        input_ids: IntRows,
        *,
        attention_mask: IntRows | None = None,
        num_actions: int | Sequence[int] | ToList | None = None,
        action_mask: IntRows | None = None,
        response_length: int | None = None,
        temperature: float = 1.0,
        eos_token_id: int | Sequence[int] | ToList | None = None,
        return_entropy: bool = False,
        prompt_ids: IntRows | None = None,
        prompt_index: Sequence[int] | ToList | None = None,
        top_logprobs: int | None = None,
        candidate_ids: Any = None,
        sampling: Mapping[str, Any] | None = None,
        **options: Any,
    ) -> Scores:
        """Score a batch in any of the four layouts of docs/semantics.md, or grouped: each prompt once in
        `prompt_ids`, `input_ids` rows the responses, `prompt_index[i]` row i's prompt (docs/api.md,
        'Grouped requests'; `group_prompts` builds both from per-row prompts). `top_logprobs`,
        `candidate_ids` and `sampling` ask for more of each action's distribution (docs/api.md, 'Beyond
        the log-prob'): Scores.top_ids, top_logprobs, ranks, candidate_logprobs, processed_logprobs.
        `options` are sent as they are."""
        body = build_body(
            input_ids,
            attention_mask=attention_mask,
            num_actions=num_actions,
            action_mask=action_mask,
            response_length=response_length,
            temperature=temperature,
            eos_token_id=eos_token_id,
            return_entropy=return_entropy,
            options=options,
            prompt_ids=prompt_ids,
            prompt_index=prompt_index,
            distribution=Distribution(top_logprobs, candidate_ids, sampling),
        )
        return self.score_request(body)

    def score_request(self, body: Mapping[str, Any]) -> Scores:
        """Score a ready-made request body (JSON-able, as `POST /logprobs` takes it)."""
        chunks = self.config.chunks(body)
        if len(chunks) == 1:
            return finish(chunks, [self._send(chunks[0])])
        futures = [self._threads.submit(self._send, chunk) for chunk in chunks]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for future in pending:
                future.cancel()
            raise _first_error(failed)
        return finish(chunks, [f.result() for f in futures])

    def info(self) -> dict[str, Any]:
        """`GET /info` of the first replica that answers."""
        last: Exception | None = None
        for url in self.config.urls:
            try:
                response = self._http.get(f"{url}/info")
            except httpx.TransportError as exc:
                last = exc
                continue
            if response.status_code == 200:
                info: dict[str, Any] = response.json()
                return info
            last = LogprobdError(response.text, status=response.status_code, error_type="http_error", url=url)
        raise LogprobdError(
            f"no replica answered /info ({last})", status=None, error_type="connection_error"
        ) from last

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> None:
        """Block until every replica's `/health/ready` is 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        waiting = list(self.config.urls)
        while waiting:
            waiting = [url for url in waiting if not self._is_ready(url)]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout} s: {', '.join(waiting)}")
            if waiting:
                time.sleep(interval)

    def update_weights(
        self,
        path: str,
        version: str,
        *,
        target: str = "policy",
        mode: str | None = None,
        admin_key: str | None = None,
        timeout: float = 600.0,
    ) -> dict[str, dict[str, Any]]:
        """Reload `target` from `path` (as every replica sees it) on every replica at once, and
        return once all serve `version`: {replica URL: its reload status}. Raises LogprobdError
        naming each replica that refused or failed (the others then serve `version`; calling again
        is safe: a replica already serving it answers "unchanged")."""
        body, headers = weights_request(path, version, target, mode, admin_key)

        def post(url: str) -> httpx.Response | httpx.TransportError:
            try:
                return self._http.post(f"{url}/admin/weights", json=body, headers=headers, timeout=timeout)
            except httpx.TransportError as exc:
                return exc

        outcomes = dict(zip(self.config.urls, self._threads.map(post, self.config.urls), strict=True))
        failure = reload_failures(outcomes)
        if failure is not None:
            raise failure
        self.wait_for_version(version, target=target, timeout=timeout)
        return {
            url: reply_body(response)
            for url, response in outcomes.items()
            if isinstance(response, httpx.Response)
        }

    def wait_for_version(
        self, version: str, *, target: str = "policy", timeout: float = 600.0, interval: float = 0.5
    ) -> None:
        """Block until every replica's `/info` says `target` serves `version` (replicas that follow a
        version file, or reloads started elsewhere); TimeoutError naming the laggards."""
        deadline = time.monotonic() + timeout
        waiting = list(self.config.urls)
        while waiting:
            waiting = [url for url in waiting if self._version_of(url, target) != version]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"not serving {target} {version!r} after {timeout} s: {', '.join(waiting)}"
                )
            if waiting:
                time.sleep(interval)

    def close(self) -> None:
        self._threads.shutdown(wait=True, cancel_futures=True)
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _version_of(self, url: str, target: str) -> str | None:
        try:
            response = self._http.get(f"{url}/info")
        except httpx.TransportError:
            return None
        return serving_version(response.json(), target) if response.status_code == 200 else None

    def _is_ready(self, url: str) -> bool:
        try:
            return self._http.get(f"{url}/health/ready").status_code == 200
        except httpx.TransportError:
            return False

    def _send(self, chunk: Chunk) -> dict[str, Any]:
        encoded = encode(chunk, self.config.frames)
        policy = self.config.retry
        for attempt in range(policy.max_attempts):
            lease = self._pool.acquire(chunk.replica)
            try:
                if lease.wait:
                    time.sleep(lease.wait)
                try:
                    response = self._http.post(
                        f"{lease.replica.url}/logprobs", content=encoded.content, headers=encoded.headers
                    )
                except httpx.TransportError as exc:
                    failure = transport_failure(exc, lease.replica.url)
                else:
                    if response.status_code == 200:
                        return reply_body(response)
                    failure = response_failure(response, chunk, policy)
            finally:
                self._pool.release(lease.replica)
            give_up_unless_retryable(failure, attempt, policy)
            self._pool.back_off(lease.replica, policy.delay(attempt, failure.retry_after, self._rng))
        raise AssertionError("unreachable: the last attempt raises")


def _first_error(failed: list[Future[dict[str, Any]]]) -> BaseException:
    """The error of the earliest failed chunk (futures are in chunk order)."""
    error = failed[0].exception()
    assert error is not None
    return error
