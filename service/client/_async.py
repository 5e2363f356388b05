"""`AsyncClient`: the asyncio twin of `Client`, same arguments and results, awaitable methods."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping, Sequence
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
from service.client.transport import StreamTransport
from service.client.wire import Distribution, IntRows, Scores, ToList, build_body


class AsyncClient:
    """A logprobd client for asyncio; see `Client` for chunking, replicas, retries and errors.

    At most `max_concurrency` chunks of one `score` call are in flight at once. Plain-HTTP requests
    go through `StreamTransport` unless `transport` is given (httpx's default costs about a
    millisecond of the event loop per concurrent request; see transport.py). Close it with
    `await client.aclose()` or `async with`.
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
        transport: httpx.AsyncBaseTransport | None = None,
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
        self._http = httpx.AsyncClient(
            headers=self.config.headers,
            timeout=self.config.timeout,
            transport=transport if transport is not None else StreamTransport(),
        )

    async def score(
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
        return await self.score_request(body)

    async def score_request(self, body: Mapping[str, Any]) -> Scores:
        """Score a ready-made request body (JSON-able, as `POST /logprobs` takes it)."""
        chunks = self.config.chunks(body)
        slots = asyncio.Semaphore(self.config.max_concurrency)

        async def send(chunk: Chunk) -> dict[str, Any]:
            async with slots:
                return await self._send(chunk)

        tasks = [asyncio.create_task(send(chunk)) for chunk in chunks]
        try:
            replies = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return finish(chunks, replies)

    async def info(self) -> dict[str, Any]:
        """`GET /info` of the first replica that answers."""
        last: Exception | None = None
        for url in self.config.urls:
            try:
                response = await self._http.get(f"{url}/info")
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

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> None:
        """Wait until every replica's `/health/ready` is 200; TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        waiting = list(self.config.urls)
        while waiting:
            ready = await asyncio.gather(*(self._is_ready(url) for url in waiting))
            waiting = [url for url, ok in zip(waiting, ready, strict=True) if not ok]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(f"not ready after {timeout} s: {', '.join(waiting)}")
            if waiting:
                await asyncio.sleep(interval)

    async def update_weights(
        self,
        path: str,
        version: str,
        *,
        target: str = "policy",
        mode: str | None = None,
        admin_key: str | None = None,
        timeout: float = 600.0,
    ) -> dict[str, dict[str, Any]]:
        """See `Client.update_weights`."""
        body, headers = weights_request(path, version, target, mode, admin_key)

        async def post(url: str) -> httpx.Response | httpx.TransportError:
            try:
                return await self._http.post(
                    f"{url}/admin/weights", json=body, headers=headers, timeout=timeout
                )
            except httpx.TransportError as exc:
                return exc

        replies = await asyncio.gather(*(post(url) for url in self.config.urls))
        outcomes = dict(zip(self.config.urls, replies, strict=True))
        failure = reload_failures(outcomes)
        if failure is not None:
            raise failure
        await self.wait_for_version(version, target=target, timeout=timeout)
        return {
            url: reply_body(response)
            for url, response in outcomes.items()
            if isinstance(response, httpx.Response)
        }

    async def wait_for_version(
        self, version: str, *, target: str = "policy", timeout: float = 600.0, interval: float = 0.5
    ) -> None:
        """See `Client.wait_for_version`."""
        deadline = time.monotonic() + timeout
        waiting = list(self.config.urls)
        while waiting:
            versions = await asyncio.gather(*(self._version_of(url, target) for url in waiting))
            waiting = [url for url, v in zip(waiting, versions, strict=True) if v != version]
            if waiting and time.monotonic() > deadline:
                raise TimeoutError(
                    f"not serving {target} {version!r} after {timeout} s: {', '.join(waiting)}"
                )
            if waiting:
                await asyncio.sleep(interval)

    async def _version_of(self, url: str, target: str) -> str | None:
        try:
            response = await self._http.get(f"{url}/info")
        except httpx.TransportError:
            return None
        return serving_version(response.json(), target) if response.status_code == 200 else None

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _is_ready(self, url: str) -> bool:
        try:
            return (await self._http.get(f"{url}/health/ready")).status_code == 200
        except httpx.TransportError:
            return False

    async def _send(self, chunk: Chunk) -> dict[str, Any]:
        encoded = encode(chunk, self.config.frames)
        policy = self.config.retry
        for attempt in range(policy.max_attempts):
            lease = self._pool.acquire(chunk.replica)
            try:
                if lease.wait:
                    await asyncio.sleep(lease.wait)
                try:
                    response = await self._http.post(
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
