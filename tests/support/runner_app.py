"""Targets for tests/test_runner.py, configured by environment variables.

``RUNNER_TEST_QUEUE``: the queue; ``RUNNER_TEST_OUT``: a folder where each
handled message id is appended to ``<pid>.log`` before the handler returns
(so before its ack); ``RUNNER_TEST_SLEEP``: seconds each handler takes.

``stubborn`` is a consumer whose handler ignores the graceful stop (it
swallows cancellation and sleeps on), so only SIGKILL ends its worker; it
notes each id in ``RUNNER_TEST_OUT`` as it starts handling it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os

from reliable_mq import ConsumerSettings, Delivery, ReliableConsumer, Router

QUEUE = os.environ.get("RUNNER_TEST_QUEUE", "runner-test")
OUT = os.environ.get("RUNNER_TEST_OUT", "")
SLEEP = float(os.environ.get("RUNNER_TEST_SLEEP", "0"))

router = Router()


def _note(message_id: str) -> None:
    """Append ``message_id`` to ``<OUT>/<pid>.log`` (if OUT is set)."""
    if not OUT:
        return
    fd = os.open(os.path.join(OUT, f"{os.getpid()}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        os.write(fd, f"{message_id}\n".encode())
    finally:
        os.close(fd)


@router.handler(QUEUE)
async def handle(body: bytes, delivery: Delivery) -> None:
    await asyncio.sleep(SLEEP)
    _note(delivery.message_id)


consumer = ReliableConsumer(
    settings=ConsumerSettings(prefetch=20, concurrency=4, shutdown_grace=20),
    dedup=None,
)
consumer.include_router(router)

not_a_consumer = 42
empty_router = Router()

stubborn_router = Router()


@stubborn_router.handler(QUEUE)
async def ignore_the_drain(body: bytes, delivery: Delivery) -> None:
    _note(delivery.message_id)  # the handler holds it (a test waits for this)
    while True:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(3600)


stubborn = ReliableConsumer(
    settings=ConsumerSettings(prefetch=1, concurrency=1, shutdown_grace=600), dedup=None
)
stubborn.include_router(stubborn_router)
