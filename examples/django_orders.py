"""A Django view that answers only once the broker has confirmed the order.

A single-file Django project, to keep the example whole; in a real project
``publisher`` lives in a module of your app (``myapp/messaging.py``) and the
settings in ``settings.py``. The publisher is created at import and connects
on first use, so it is safe under gunicorn ``--preload``: each worker process
opens its own connection.

Serve it (any WSGI server)::

    RELIABLE_MQ_URL=amqp://guest:guest@127.0.0.1:5672/ gunicorn --chdir examples django_orders

As a script, it declares a throwaway queue, posts three orders through
Django's test client, prints the answers and exits.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import aio_pika
import django
from django.conf import settings

if not settings.configured:
    settings.configure(
        DEBUG=False,
        SECRET_KEY="example-only-not-secret",
        ROOT_URLCONF=__name__,
        ALLOWED_HOSTS=["*"],
        MIDDLEWARE=[],
        INSTALLED_APPS=[],
        ORDERS_QUEUE=os.environ.get("ORDERS_QUEUE", "orders"),
    )
    django.setup()

from django.core.handlers.wsgi import WSGIHandler
from django.http import HttpRequest, JsonResponse
from django.urls import path

from reliable_mq import BlockingPublisher, PublishError, PublishOutcomeUnknown

publisher = BlockingPublisher()  # from RELIABLE_MQ_* variables; connects on first use


def create_order(request: HttpRequest) -> JsonResponse:
    if request.method != "POST":
        return JsonResponse({"error": "POST only"}, status=405)
    try:
        order = json.loads(request.body)
    except ValueError:
        order = None
    if not isinstance(order, dict) or not isinstance(order.get("order_id"), int):
        return JsonResponse(
            {"error": "expected a JSON object with an integer order_id"}, status=400
        )
    try:
        result = publisher.publish(
            order,
            routing_key=settings.ORDERS_QUEUE,
            message_id=f"order-{order['order_id']}",
            timeout=5,
        )
    except PublishOutcomeUnknown as exc:  # timeout or abort: the broker may have it
        body: dict[str, Any] = {
            "error": "not confirmed in time; retry",
            "message_id": exc.message_id,
        }
        return JsonResponse(body, status=503)
    except PublishError as exc:  # unroutable, refused, gave up, broker unavailable
        return JsonResponse({"error": type(exc).__name__, "message_id": exc.message_id}, status=502)
    return JsonResponse({"message_id": result.message_id, "attempts": result.attempts}, status=202)


urlpatterns = [path("orders", create_order)]
application = WSGIHandler()


async def _queue(url: str, name: str, *, delete: bool = False) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        channel = await connection.channel()
        if delete:
            await channel.queue_delete(name)
        else:
            await channel.declare_queue(name, durable=True)


def main() -> None:
    from django.test import Client  # noqa: PLC0415 - the demo only, not the app
    from django.test.utils import override_settings  # noqa: PLC0415

    url = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue = f"example-django-{uuid.uuid4().hex[:8]}"
    asyncio.run(_queue(url, queue))
    try:
        with override_settings(ORDERS_QUEUE=queue):
            client = Client()
            for order_id in (1, 2, 3):
                answer = client.post(
                    "/orders", {"order_id": order_id}, content_type="application/json"
                )
                print(answer.status_code, answer.json())
                assert answer.status_code == 202
            bad = client.post("/orders", "not json", content_type="application/json")
            print(bad.status_code, bad.json())
            assert bad.status_code == 400
    finally:
        publisher.close()
        asyncio.run(_queue(url, queue, delete=True))


if __name__ == "__main__":
    main()
