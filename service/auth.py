"""Optional bearer API keys: from LOGPROBD_API_KEYS and/or a file, compared in constant time.

Keys are never logged or echoed. With no key configured, every route is open.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from service.errors import Unauthorized
from service.settings import Settings


@dataclass(frozen=True, slots=True)
class ApiKeys:
    keys: tuple[bytes, ...]

    @classmethod
    def from_settings(cls, settings: Settings) -> ApiKeys:
        keys: list[str] = []
        if settings.api_keys is not None:
            keys += settings.api_keys.get_secret_value().split(",")
        if settings.api_keys_file is not None:
            keys += settings.api_keys_file.read_text().splitlines()
        return cls(tuple(k.strip().encode() for k in keys if k.strip()))

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
