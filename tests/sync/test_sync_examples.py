"""The Flask and Django examples, driven by their own test clients against the real broker."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from reliable_mq import ConnectionSettings
from reliable_mq.sync import BlockingPublisher
from tests.support.amqp import drain_queue_sync
from tests.sync.test_sync_publisher import _declare

pytestmark = pytest.mark.rabbitmq


@pytest.fixture
def squeue(broker_url: str) -> Iterator[str]:
    name = f"test-sync-web-{uuid.uuid4().hex[:12]}"
    _declare(broker_url, name)
    yield name
    _declare(broker_url, name, delete=True)


def _bodies(url: str, queue: str) -> dict[str | None, bytes]:
    # Settled: each request answered after its publish was confirmed (or refused).
    return {m.message_id: m.body for m in drain_queue_sync(url, queue, settled=True)}


def test_flask_app_answers_after_the_confirm(broker_url: str, squeue: str) -> None:
    from examples.flask_orders import create_app

    name = f"test-flask-{uuid.uuid4().hex[:6]}"
    with BlockingPublisher(ConnectionSettings(url=broker_url, connection_name=name)) as publisher:  # type: ignore[arg-type]
        client = create_app(publisher, squeue).test_client()
        answer = client.post("/orders", json={"order_id": 7, "total": 3.5})
        assert answer.status_code == 202
        assert answer.get_json() == {"message_id": "order-7", "attempts": 1}
        assert client.post("/orders", data="nope").status_code == 400
        lost = create_app(publisher, f"nowhere-{uuid.uuid4().hex}").test_client()
        refused = lost.post("/orders", json={"order_id": 8})
        assert refused.status_code == 502
        assert refused.get_json()["error"] == "PublishUnroutable"
    assert _bodies(broker_url, squeue) == {"order-7": b'{"order_id":7,"total":3.5}'}


@pytest.fixture
def django_orders(broker_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.setenv("RELIABLE_MQ_URL", broker_url)
    from examples import django_orders

    yield django_orders
    django_orders.publisher.close()


def test_django_view_answers_after_the_confirm(
    django_orders: object, broker_url: str, squeue: str
) -> None:
    from django.test import Client
    from django.test.utils import override_settings

    client = Client()
    with override_settings(ORDERS_QUEUE=squeue):
        answer = client.post("/orders", {"order_id": 5}, content_type="application/json")
        assert answer.status_code == 202, answer.content
        assert answer.json() == {"message_id": "order-5", "attempts": 1}
        assert client.get("/orders").status_code == 405
        bad = client.post("/orders", "{", content_type="application/json")
        assert bad.status_code == 400
    with override_settings(ORDERS_QUEUE=f"nowhere-{uuid.uuid4().hex}"):
        refused = client.post("/orders", {"order_id": 6}, content_type="application/json")
        assert refused.status_code == 502
        assert refused.json()["error"] == "PublishUnroutable"
    assert _bodies(broker_url, squeue) == {"order-5": b'{"order_id":5}'}
