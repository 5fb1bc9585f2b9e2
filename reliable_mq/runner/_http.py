"""A minimal HTTP/1.1 server for probes and scrapes: GET a path, get a body, close.

Enough for ``/livez``, ``/readyz`` and ``/metrics``, with no dependency. Every
request is bounded: the request head must arrive within a few seconds and in
at most 8 KiB, and only a few connections are served at once; anything else
gets a 4xx or a closed socket, never a stuck server.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from typing import NamedTuple

__all__ = ("HttpServer", "Response")

_HEAD_LIMIT = 8192
_HEAD_TIMEOUT = 5.0
_MAX_CONNECTIONS = 32
_REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class Response(NamedTuple):
    """What a route returns."""

    status: int
    body: bytes
    content_type: str = "application/json"


Route = Callable[[], Awaitable[Response]]


class HttpServer:
    """Serves ``routes`` (path -> coroutine function) on ``host:port``.

    Args:
        host: the address to listen on ("0.0.0.0" for every IPv4 interface).
        port: the TCP port; 0 picks a free one (see `port`).
        routes: exact paths; a query string is ignored.
    """

    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        self._host = host
        self._port = port
        self._routes = dict(routes)
        self._server: asyncio.Server | None = None
        self._slots = asyncio.Semaphore(_MAX_CONNECTIONS)

    @property
    def port(self) -> int:
        """The bound port (known once started)."""
        if self._server is None:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        """Listen.

        Raises:
            OSError: the address cannot be bound.
        """
        self._server = await asyncio.start_server(
            self._serve, self._host, self._port, limit=_HEAD_LIMIT, reuse_address=True
        )

    async def close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(2):
                    await server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._slots.locked():
            writer.close()
            return
        async with self._slots:
            try:
                response, head_only = await self._respond(reader)
                writer.write(_encode(response, head_only))
                async with asyncio.timeout(_HEAD_TIMEOUT):
                    await writer.drain()
            except (OSError, TimeoutError):
                pass
            finally:
                writer.close()

    async def _respond(self, reader: asyncio.StreamReader) -> tuple[Response, bool]:
        try:
            async with asyncio.timeout(_HEAD_TIMEOUT):
                head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, ValueError):
            return _text(400, "bad request"), False
        request_line = head.split(b"\r\n", 1)[0].decode("latin-1")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/"):
            return _text(400, "bad request"), False
        method, target, _ = parts
        if method not in ("GET", "HEAD"):
            return _text(405, "method not allowed"), False
        route = self._routes.get(target.split("?", 1)[0])
        if route is None:
            return _text(404, "not found"), method == "HEAD"
        try:
            return await route(), method == "HEAD"
        except Exception:
            return _text(500, "internal error"), method == "HEAD"


def _text(status: int, text: str) -> Response:
    return Response(status, text.encode() + b"\n", "text/plain; charset=utf-8")


def _encode(response: Response, head_only: bool) -> bytes:
    reason = _REASONS.get(response.status, "Unknown")
    head = (
        f"HTTP/1.1 {response.status} {reason}\r\n"
        f"Content-Type: {response.content_type}\r\n"
        f"Content-Length: {len(response.body)}\r\n"
        "Cache-Control: no-store\r\n"
        "Connection: close\r\n\r\n"
    ).encode("latin-1")
    return head if head_only else head + response.body
