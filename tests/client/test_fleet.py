"""The weight push's HTTP side (service/client/_fleet.py) against a real uvicorn on loopback: an idle
connection is reused within the client's keep-alive expiry and dropped after it, before the server's
own keep-alive could close it under a call."""

from __future__ import annotations

import time

from fastapi import FastAPI, Request

from service.client._fleet import KEEPALIVE_EXPIRY_S, Fleet
from service.http.server import KEEP_ALIVE_S
from tests.support.servers import loopback


def client_port_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health/ready")
    async def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.get("/port")
    async def port(request: Request) -> dict[str, int]:
        assert request.client is not None
        return {"port": request.client.port}

    return app


def test_the_client_drops_an_idle_connection_before_the_server_does() -> None:
    assert KEEPALIVE_EXPIRY_S < KEEP_ALIVE_S  # the service's uvicorn keeps an idle connection this long
    with loopback(client_port_app()) as url:  # uvicorn's default keep-alive: the service's
        fleet = Fleet([url], admin_key=None, timeout_s=10)
        try:
            ports = [fleet.call("GET", "/port")[0].body["port"]]
            time.sleep(KEEPALIVE_EXPIRY_S / 4)
            ports.append(fleet.call("GET", "/port")[0].body["port"])
            time.sleep(KEEPALIVE_EXPIRY_S + 0.5)  # past the client's expiry, within the server's
            ports.append(fleet.call("GET", "/port")[0].body["port"])
        finally:
            fleet.close()
    assert ports[0] == ports[1]  # kept alive and reused
    assert ports[2] != ports[1]  # a new connection: the idle one was dropped by the client
