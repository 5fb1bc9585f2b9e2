"""Serve the Prometheus metrics over HTTP, for a scraper or ``curl``.

A thin wrapper over `prometheus_client.start_http_server()`: the server runs
in a daemon thread and answers ``GET /metrics`` (any path, in fact) with the
text exposition format of one registry. The only differences are the defaults:
it listens on ``127.0.0.1`` rather than on every interface (metrics tell a lot
about a system; expose them on purpose), and it serves the registry you passed
to your publishers and consumers:

```python
registry = CollectorRegistry()
server, thread = start_metrics_server(9464, registry=registry)
async with ReliablePublisher(url, registry=registry) as publisher:
    ...
stop_metrics_server(server, thread)
```

Pass ``port=0`` to get a free port; read it back from ``server.server_port``.
Applications that already run an HTTP server (aiohttp, FastAPI...) should
mount `prometheus_client.make_asgi_app()` / ``make_wsgi_app`` there instead.
"""

from __future__ import annotations

import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server

__all__ = ("start_metrics_server", "stop_metrics_server")


def start_metrics_server(
    port: int,
    *,
    addr: str = "127.0.0.1",
    registry: CollectorRegistry | None = None,
) -> tuple[WSGIServer, threading.Thread]:
    """Serve ``registry`` on ``http://{addr}:{port}/metrics`` from a daemon thread.

    Args:
        port: the TCP port; ``0`` picks a free one (see ``server.server_port``).
        addr: the address to listen on; ``"0.0.0.0"`` for every IPv4 interface.
        registry: the registry to expose (default: prometheus_client's global one,
            which is also the publisher's and consumer's default).

    Returns:
        The running server and its thread; pass both to `stop_metrics_server()`.

    Raises:
        OSError: the address cannot be bound (port in use, bad address).
    """
    if not 0 <= port <= 65535:
        raise ValueError(f"port must be 0 to 65535, not {port}")
    return start_http_server(port, addr=addr, registry=REGISTRY if registry is None else registry)


def stop_metrics_server(
    server: WSGIServer, thread: threading.Thread, timeout: float | None = 5.0
) -> None:
    """Stop a server started by `start_metrics_server()` and free its port."""
    server.shutdown()
    server.server_close()
    thread.join(timeout)
