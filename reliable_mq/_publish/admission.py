"""Admission: a message waits, until its deadline, for its id, its exchange and a window slot.

Admitted, it holds one window slot and owns its ``message_id`` until its
outcome is final and no channel has it in flight. Two publishes of one id
never overlap (returns are matched by id); the first publish to an exchange
waits for the exchange's probe; the window is the backpressure.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from .._amqp.faults import Fault
from ..errors import ClosedError, PublishAborted, PublishError, PublishUnavailable
from .errors import exchange_error
from .outgoing import Outgoing
from .window import Window

__all__ = ("Aborted", "Admitting", "Unavailable", "wait_for_admission")


class Aborted(Exception):
    """Internal: close() gave up; window waiters turn it into PublishAborted."""


class Unavailable(Exception):
    """Internal: no connection for unavailable_timeout; waiters turn it into PublishUnavailable."""


class Admitting(Protocol):
    """What admission asks of the engine (`reliable_mq._publish.engine.Engine`)."""

    @property
    def window(self) -> Window: ...

    @property
    def unavailable(self) -> bool: ...

    @property
    def aborting(self) -> bool: ...

    def holder(self, message_id: str) -> Outgoing | None:
        """The admitted message that owns ``message_id`` now, if any."""
        ...

    def exchange_known(self, exchange: str) -> bool: ...

    async def check_exchange(self, exchange: str) -> Fault | None: ...

    def timeout_error(self, out: Outgoing) -> PublishError: ...

    def aborted_error(self, out: Outgoing) -> PublishAborted: ...

    def unavailable_error(self, out: Outgoing) -> PublishUnavailable: ...


async def wait_for_admission(engine: Admitting, out: Outgoing) -> None:
    """Return once ``out`` holds a slot and owns its id (the caller then admits it).

    Raises:
        PublishError: the deadline passed, the exchange is missing or refused,
            the broker is unavailable, or the publisher is closing.
    """
    window = engine.window
    while True:
        _check_open(engine, out)
        previous = engine.holder(out.message_id)
        if previous is not None:
            await _wait_release(engine, previous, out)
            continue
        if not engine.exchange_known(out.exchange):
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
        if engine.holder(out.message_id) is not None or engine.unavailable or engine.aborting:
            window.release()  # someone else's turn first: wait again
            continue
        break
    if asyncio.get_running_loop().time() >= out.deadline:
        window.release()
        raise engine.timeout_error(out)


def _check_open(engine: Admitting, out: Outgoing) -> None:
    if engine.aborting:
        raise engine.aborted_error(out)
    if engine.unavailable:
        raise engine.unavailable_error(out)


async def _wait_release(engine: Admitting, previous: Outgoing, out: Outgoing) -> None:
    waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    if previous.followers is None:
        previous.followers = []
    previous.followers.append(waiter)
    try:
        async with asyncio.timeout_at(out.deadline):
            await waiter
    except TimeoutError:
        raise engine.timeout_error(out) from None


async def _check_exchange(engine: Admitting, out: Outgoing) -> None:
    try:
        async with asyncio.timeout_at(out.deadline):
            fault = await engine.check_exchange(out.exchange)
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
