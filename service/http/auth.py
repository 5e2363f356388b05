"""Optional bearer API keys: from LOGPROBD_API_KEYS and/or a file, compared in constant time.

Keys are never logged or echoed. With no API key configured, the scoring routes are open; the admin
routes (weight reload, weight push) need an admin key, and are off (403) when none is configured.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import SecretStr

from service.core.errors import Forbidden, Unauthorized
from service.settings import Settings


def _read(inline: SecretStr | None, file: Path | None) -> tuple[bytes, ...]:
    keys: list[str] = []
    if inline is not None:
        keys += inline.get_secret_value().split(",")
    if file is not None:
        keys += file.read_text().splitlines()
    return tuple(k.strip().encode() for k in keys if k.strip())


@dataclass(frozen=True, slots=True)
class ApiKeys:
    keys: tuple[bytes, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        """The keys of the scoring routes: the API keys, plus the admin keys when there are API keys."""
        keys = _read(settings.api_keys, settings.api_keys_file)
        return cls(keys + _read(settings.admin_api_keys, settings.admin_api_keys_file) if keys else ())

    @classmethod
    def admin(cls, settings: Settings) -> ApiKeys:
        """The keys of /admin/*: admin keys only. None configured: the admin routes are off."""
        return cls(_read(settings.admin_api_keys, settings.admin_api_keys_file))

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def check(self, authorization: str | None) -> None:
        """Raise Unauthorized unless `authorization` is "Bearer <a configured key>"."""
        if not self.enabled:
            return
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode()
        # compare with every key, whatever matched: the time does not depend on which key, or where
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(given, key)
        if scheme.lower() != "bearer" or not matched:
            raise Unauthorized("a valid API key is required: send `Authorization: Bearer <key>`")


def admin_only(settings: Settings, bearer: HTTPBearer, what: str) -> Callable[..., Coroutine[Any, Any, None]]:
    """A route dependency: 403 when the server has no admin key (`what` is off), 401 without one."""
    keys = ApiKeys.admin(settings)

    async def admin(
        http: Request,
        _: HTTPAuthorizationCredentials | None = Depends(bearer),  # noqa: B008 (documents the scheme)
    ) -> None:
        if not keys.enabled:
            raise Forbidden(
                f"{what} is off: start the server with an admin key (LOGPROBD_ADMIN_API_KEYS or "
                "--admin-api-keys-file)"
            )
        keys.check(http.headers.get("authorization"))

    return admin
