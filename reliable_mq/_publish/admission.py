"""Admission: a message waits, until its deadline, for its id, its exchange and a window slot.

Admitted, it holds one window slot and owns its ``message_id`` until its
outcome is final and no channel has it in flight. Two publishes of one id
never overlap (returns are matched by id); the first publish to an exchange
waits for the exchange's probe; the window is the backpressure.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from ..errors import ClosedError
from .errors import exchange_error
from .outgoing import Outgoing

if TYPE_CHECKING:
    from .engine import Engine

__all__ = ("Aborted", "Unavailable", "wait_for_admission")


class Aborted(Exception):
    """Internal: close() gave up; window waiters turn it into PublishAborted."""


class Unavailable(Exception):
    """Internal: no connection for unavailable_timeout; waiters turn it into PublishUnavailable."""


async def wait_for_admission(engine: Engine, out: Outgoing) -> None:
    """Return once ``out`` holds a slot and owns its id (the caller then admits it).

    Raises:
        PublishError: the deadline passed, the exchange is missing or refused,
            the broker is unavailable, or the publisher is closing.
    """
    window = engine.window
    while True:
        _check_open(engine, out)
        previous = engine.by_id.get(out.message_id)
        if previous is not None:
            await _wait_release(engine, previous, out)
            continue
        if out.exchange not in engine.exchanges.known:
            await _check_exchange(engine, out)
            continue
        if window.try_acquire():
            break
        try:
            await window.acquire(out.deadline)
        except TimeoutError:
            raise engine.timeout_error(out) from None
        except Aborted:
            raise engine.aborted_error(out) from None
        except Unavailable:
            raise engine.unavailable_error(out) from None
        if out.message_id in engine.by_id or engine.unavailable or engine.aborting:
            window.release()  # someone else's turn first: wait again
            continue
        break
    if asyncio.get_running_loop().time() >= out.deadline:
        window.release()
        raise engine.timeout_error(out)


def _check_open(engine: Engine, out: Outgoing) -> None:
    if engine.aborting:
        raise engine.aborted_error(out)
    if engine.unavailable:
        raise engine.unavailable_error(out)


async def _wait_release(engine: Engine, previous: Outgoing, out: Outgoing) -> None:
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    if previous.followers is None:
        previous.followers = []
    previous.followers.append(waiter)
    try:
        async with asyncio.timeout_at(out.deadline):
            await waiter
    except TimeoutError:
        raise engine.timeout_error(out) from None


async def _check_exchange(engine: Engine, out: Outgoing) -> None:
    try:
        async with asyncio.timeout_at(out.deadline):
            fault = await engine.exchanges.check(out.exchange)
    except TimeoutError:
        raise engine.timeout_error(out) from None
    except ClosedError:
        raise engine.aborted_error(out) from None
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise  # the caller itself is cancelled
        raise engine.aborted_error(out) from None  # the shared probe was: we are closing
    if fault is not None and fault.refusal:
        raise exchange_error(out, out.exchange, fault)
