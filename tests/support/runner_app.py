"""Targets for tests/cli/test_runner.py, configured by environment variables.

``RUNNER_TEST_QUEUE``: the queue; ``RUNNER_TEST_OUT``: a folder where each
handled message id is appended to ``<pid>.log`` before the handler returns
(so before its ack); ``RUNNER_TEST_SLEEP``: seconds each handler takes.

``stubborn`` is a consumer whose handler ignores the graceful stop (it
swallows cancellation and sleeps on); it notes each id in ``RUNNER_TEST_OUT``
as it starts handling it. ``exits`` ends its event loop with a ``SystemExit``
while a retry copy is in flight; ``wedged`` holds the GIL for ever.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys

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

# -- hostile lifecycles (issue 19, defect 7) ---------------------------------------

GO = os.environ.get("RUNNER_TEST_GO", "")
"""A file path: ``exits`` waits for it to exist before it fails its first delivery."""

exits_router = Router()


@exits_router.handler(QUEUE)
async def fail_then_exit(body: bytes, delivery: Delivery) -> None:
    """First delivery: wait for GO, raise (a retry copy goes to the internal publisher),
    and have the event loop end with SystemExit(3) 0.3 s later, from outside any
    handler, as a ``sys.exit()`` in application code does. Later ones: handled."""
    _note(delivery.message_id)
    if delivery.attempt > 1 or delivery.redelivered:
        return
    while not await asyncio.to_thread(os.path.exists, GO):
        await asyncio.sleep(0.02)
    asyncio.get_running_loop().call_later(0.3, sys.exit, 3)
    raise RuntimeError("fails, so that a retry copy is in flight when the loop ends")


exits = ReliableConsumer(settings=ConsumerSettings(prefetch=1, concurrency=1), dedup=None)
exits.include_router(exits_router)

wedged_router = Router()


@wedged_router.handler(QUEUE)
def hold_the_gil(body: bytes, delivery: Delivery) -> None:
    """A plain def handler stuck in C code that never releases the GIL (a regular
    expression backtracking for ever): no Python code of the process runs again,
    not even a signal handler or a thread. Only SIGKILL ends it."""
    _note(delivery.message_id)
    re.fullmatch(r"(a|aa)+b", "a" * 80)


wedged = ReliableConsumer(settings=ConsumerSettings(prefetch=1, concurrency=1), dedup=None)
wedged.include_router(wedged_router)

sys_exit_router = Router()


@sys_exit_router.handler(QUEUE)
async def exit_first_time(body: bytes, delivery: Delivery) -> None:
    """``sys.exit(3)`` in the handler on the first attempt; handled on a later one."""
    _note(delivery.message_id)
    if delivery.attempt == 1 and not delivery.redelivered:
        sys.exit(3)


sys_exit = ReliableConsumer(
    settings=ConsumerSettings(prefetch=4, concurrency=4, retry_delays=(1.0,)), dedup=None
)
sys_exit.include_router(sys_exit_router)
