"""A Flask app that answers only once the broker has confirmed the order.

One ``BlockingPublisher`` serves every request thread. It connects on the
first request, and under a pre-forking server (gunicorn ``--preload``) each
worker process opens its own connection. The order id is the message id, so a
client that retries after a timeout cannot make the consumer apply it twice.

Serve it::

    RELIABLE_MQ_URL=amqp://guest:guest@127.0.0.1:5672/ flask --app examples/flask_orders run

As a script, it declares a throwaway queue, posts three orders through
Flask's test client, prints the answers and exits.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import aio_pika
from flask import Flask, request

from reliable_mq import BlockingPublisher, PublishError, PublishOutcomeUnknown


def create_app(publisher: BlockingPublisher | None = None, queue: str = "orders") -> Flask:
    """The app; ``publisher`` defaults to one configured from ``RELIABLE_MQ_*``."""
    app = Flask(__name__)
    mq = publisher if publisher is not None else BlockingPublisher()

    @app.post("/orders")
    def create_order() -> tuple[dict[str, Any], int]:
        order = request.get_json(silent=True)
        if not isinstance(order, dict) or not isinstance(order.get("order_id"), int):
            return {"error": "expected a JSON object with an integer order_id"}, 400
        try:
            result = mq.publish(
                order, routing_key=queue, message_id=f"order-{order['order_id']}", timeout=5
            )
        except PublishOutcomeUnknown as exc:  # timeout or abort: the broker may have it
            return {"error": "not confirmed in time; retry", "message_id": exc.message_id}, 503
        except PublishError as exc:  # unroutable, refused, gave up, broker unavailable
            return {"error": type(exc).__name__, "message_id": exc.message_id}, 502
        return {"message_id": result.message_id, "attempts": result.attempts}, 202

    return app


async def _queue(url: str, name: str, *, delete: bool = False) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        if delete:
            await channel.queue_delete(name)
        else:
            await channel.declare_queue(name, durable=True)


def main() -> None:
    url = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue = f"example-flask-{uuid.uuid4().hex[:8]}"
    asyncio.run(_queue(url, queue))
    try:
        with BlockingPublisher(url) as publisher:
            client = create_app(publisher, queue).test_client()
            for order_id in (1, 2, 3):
                answer = client.post("/orders", json={"order_id": order_id, "total": 9.5})
                print(answer.status_code, answer.get_json())
                assert answer.status_code == 202
            bad = client.post("/orders", json={"total": 1})
            print(bad.status_code, bad.get_json())
            assert bad.status_code == 400
    finally:
        asyncio.run(_queue(url, queue, delete=True))


if __name__ == "__main__":
    main()
