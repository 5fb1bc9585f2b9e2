"""A consumer deployed with the runner, as systemd or Kubernetes would start it.

The module only declares handlers on a ``Router``; ``reliable-mq run`` builds
the consumer from ``RELIABLE_MQ_*`` variables in each worker process::

    reliable-mq run worker_orders:router --app-dir examples --workers 2 --metrics-port 9464

As a script, it does the whole round trip on a throwaway queue: starts the
runner with two workers, waits for ``/readyz``, publishes 50 orders with
confirms, waits until ``/metrics`` (both workers, summed) counts them all
acked, then stops the runner with SIGTERM (a graceful drain) and exits.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid

import aio_pika
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from reliable_mq import BlockingPublisher, Delivery, Message, QueueTopology, Router
from reliable_mq.topology import delete_topology

QUEUE = os.environ.get("ORDERS_QUEUE", "orders")


class Order(BaseModel):
    order_id: int
    total: float


router = Router()


@router.handler(QUEUE)
async def on_order(order: Order, delivery: Delivery) -> None:
    await asyncio.sleep(0.001)  # the real work: write to a database, call a service...


def _get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def _acked(port: int, queue: str) -> float:
    _, text = _get(port, "/metrics")
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if (
                sample.name == "reliable_mq_consumed_messages_total"
                and labels.get("queue") == queue
                and labels.get("outcome") == "acked"
            ):
                return sample.value
    return 0.0


def _wait(what: str, check: object, timeout: float = 60) -> None:
    assert callable(check)
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"gave up waiting for {what}")
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def _delete(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url)
    async with connection:
        await delete_topology(await connection.channel(), QueueTopology(queue))


def main() -> None:
    url = os.environ.get("RELIABLE_MQ_URL", "amqp://guest:guest@127.0.0.1:5672/")
    queue = f"example-worker-{uuid.uuid4().hex[:8]}"
    port = _free_port()
    env = {**os.environ, "ORDERS_QUEUE": queue, "RELIABLE_MQ_URL": url}
    folder = os.path.dirname(os.path.abspath(__file__))
    command = [sys.executable, "-m", "reliable_mq.cli", "run", "worker_orders:router"]
    options = ["--app-dir", folder, "--workers", "2", "--metrics-port", str(port)]
    runner = subprocess.Popen([*command, *options], env=env, stdout=subprocess.DEVNULL)
    try:
        _wait("/readyz", lambda: _get(port, "/readyz")[0] == 200)
        print("runner ready:", _get(port, "/readyz")[1])
        orders = (Message(Order(order_id=n, total=n * 1.5), routing_key=queue) for n in range(50))
        with BlockingPublisher(url) as publisher:
            print("published:", publisher.publish_many(orders).confirmed)
        _wait("50 acked orders", lambda: _acked(port, queue) >= 50)
        print("acked, summed over both workers:", _acked(port, queue))
        runner.send_signal(signal.SIGTERM)
        print("runner exit code after SIGTERM:", runner.wait(timeout=90))
        assert runner.returncode == 0
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        asyncio.run(_delete(url, queue))


if __name__ == "__main__":
    main()
