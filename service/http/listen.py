"""What `serve` checks before it loads anything, so that a mistake ends the start at once, in one line
(exit status 2), rather than after the model has loaded: each model directory given holds a
config.json, and the address is free. The address is bound and listening from then on (connections
wait in its backlog while the model loads) and the socket is the one uvicorn serves on.

No torch, no fastapi: `python -m service serve` runs these before it imports the server's stack.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from pathlib import Path

from service.settings import Settings

BACKLOG = 2048  # uvicorn's default


class Refused(Exception):
    """Why the server cannot start: `setting` (a Settings field) and a one-line reason."""

    def __init__(self, setting: str, reason: str) -> None:
        super().__init__(setting, reason)
        self.setting = setting
        self.reason = reason


@dataclass(frozen=True)
class Listener:
    """The bound, listening socket and the URL a client reaches it at."""

    socket: socket.socket
    url: str


def check_model_directories(settings: Settings) -> None:
    """Each checkpoint directory given (policy, reference, critic) exists and holds a config.json."""
    for name in ("model", "ref_model", "critic"):
        path: Path | None = getattr(settings, name)
        if path is None:
            continue
        if not path.exists():
            raise Refused(name, f"{path} does not exist (a local model directory: nothing is downloaded)")
        if not path.is_dir():
            raise Refused(name, f"{path} is not a directory (a model directory holds config.json)")
        if not (path / "config.json").is_file():
            raise Refused(name, f"{path} is not a model directory: no config.json in it")


def listen(host: str, port: int) -> Listener:
    """A socket bound to host:port and listening, as uvicorn would bind it (SO_REUSEADDR: a port
    left in TIME_WAIT by the last run is free; one another process listens on is not)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        reason = f"cannot listen on {_address(host, port)}: {(exc.strerror or str(exc)).lower()}"
        if exc.errno == errno.EADDRINUSE:
            raise Refused("port", f"{reason} (another server is there; choose a free port)") from exc
        raise Refused("host", reason) from exc
    bound = sock.getsockname()[1]
    return Listener(sock, f"http://{_address(host, bound)}")


def preflight(settings: Settings) -> Listener:
    """The model directories checked, then the address bound: a `Refused` for the first problem."""
    check_model_directories(settings)
    return listen(settings.host, settings.port)


def _address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
