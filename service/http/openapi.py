"""The OpenAPI document of the app, as committed in openapi.yaml."""

from __future__ import annotations

import yaml

from service.http.app import create_app
from service.settings import Settings


def render_openapi() -> str:
    document = create_app(Settings()).openapi()
    return yaml.safe_dump(document, sort_keys=False, allow_unicode=True, width=100)
