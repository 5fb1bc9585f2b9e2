"""Serve reliable_mq's Prometheus metrics over HTTP and scrape them.

Publishes a few hundred messages with confirms, serves the metrics registry on
an HTTP port, fetches its own ``/metrics`` endpoint like Prometheus would and
prints the ``reliable_mq_`` lines.

    python examples/metrics_scrape.py [--port 9464] [--serve 60] [--url amqp://...]

``--port 0`` (the default) picks a free port. With ``--serve N`` the endpoint
stays up N more seconds, so you can ``curl http://127.0.0.1:PORT/metrics`` or
point a Prometheus server at it.
"""

from __future__ import annotations

import argparse
import asyncio
import urllib.request
import uuid

import aio_pika
from prometheus_client import CollectorRegistry

from reliable_mq import ReliablePublisher
from reliable_mq.metrics_server import start_metrics_server, stop_metrics_server


def scrape(url: str) -> list[str]:
    """GET ``url`` and return the ``reliable_mq_`` samples (not HELP/TYPE or ``_created``)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text: str = response.read().decode()
    return [
        line
        for line in text.splitlines()
        if line.startswith("reliable_mq_") and "_created{" not in line
    ]


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="amqp://guest:guest@127.0.0.1:5672/")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--messages", type=int, default=500)
    parser.add_argument("--serve", type=float, default=0, help="keep serving N seconds")
    args = parser.parse_args()

    registry = CollectorRegistry()  # or leave it out: the global registry is the default
    server, thread = start_metrics_server(args.port, registry=registry)
    endpoint = f"http://127.0.0.1:{server.server_port}/metrics"
    print(f"serving metrics on {endpoint}")

    queue = f"metrics-example-{uuid.uuid4().hex[:8]}"
    connection = await aio_pika.connect(args.url)
    try:
        async with connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, durable=True)
            try:
                async with ReliablePublisher(args.url, registry=registry) as publisher:
                    await asyncio.gather(
                        *(
                            publisher.publish({"n": n}, routing_key=queue)
                            for n in range(args.messages)
                        )
                    )
                    lines = await asyncio.to_thread(scrape, endpoint)
                    print(f"published and confirmed {args.messages} messages; scraped:")
                    for line in lines:
                        print("  " + line)
                    if args.serve > 0:
                        print(f"serving for {args.serve:g} s more: curl {endpoint}")
                        await asyncio.sleep(args.serve)
            finally:
                await declared.delete(if_unused=False, if_empty=False)
    finally:
        stop_metrics_server(server, thread)


if __name__ == "__main__":
    asyncio.run(main())
