"""`Eager`: deliveries run at once in a worker task, with a task of their own only when they wait.

Pure asyncio (no broker): what a delivery's coroutine sees of its task and its
context must be what a Task of its own would give it.
"""

from __future__ import annotations

import asyncio
import contextvars
from types import SimpleNamespace
from typing import Any

import pytest

from reliable_mq._consume.eager import Eager

pytestmark = pytest.mark.unit

VAR: contextvars.ContextVar[str] = contextvars.ContextVar("VAR", default="unset")


def _ticket() -> Any:
    return SimpleNamespace(task=None)


async def _settled(*events: asyncio.Event) -> None:
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 5)


async def test_deliveries_that_do_not_wait_share_one_task_in_order() -> None:
    eager = Eager(asyncio.get_running_loop())
    seen: list[tuple[int, asyncio.Task[Any] | None]] = []
    done = asyncio.Event()

    async def run(n: int) -> None:
        seen.append((n, asyncio.current_task()))
        if n == 99:
            done.set()

    tickets = [_ticket() for _ in range(100)]
    for n, ticket in enumerate(tickets):
        eager.submit(ticket, run(n))
    await _settled(done)
    assert [n for n, _ in seen] == list(range(100))
    tasks = {task for _, task in seen}
    assert len(tasks) == 1  # one worker for the whole burst
    assert tasks != {asyncio.current_task()}
    assert all(ticket.task is seen[0][1] for ticket in tickets)  # each ticket knows its task


async def test_one_that_waits_keeps_its_task_and_does_not_hold_up_the_rest() -> None:
    eager = Eager(asyncio.get_running_loop())
    release, later_done, slow_done = asyncio.Event(), asyncio.Event(), asyncio.Event()
    tasks: dict[str, list[asyncio.Task[Any] | None]] = {"slow": [], "later": []}

    async def slow() -> None:
        tasks["slow"].append(asyncio.current_task())
        await release.wait()
        tasks["slow"].append(asyncio.current_task())  # the same task after the wait
        slow_done.set()

    async def later() -> None:
        tasks["later"].append(asyncio.current_task())
        later_done.set()

    slow_ticket, later_ticket = _ticket(), _ticket()
    eager.submit(slow_ticket, slow())
    eager.submit(later_ticket, later())
    await _settled(later_done)  # ran while slow still waits
    assert not slow_done.is_set()
    release.set()
    await _settled(slow_done)
    assert tasks["slow"][0] is tasks["slow"][1] is slow_ticket.task
    assert tasks["later"][0] is later_ticket.task
    assert later_ticket.task is not slow_ticket.task


async def test_context_variables_never_reach_the_next_delivery() -> None:
    eager = Eager(asyncio.get_running_loop())
    seen: list[str] = []
    done = asyncio.Event()

    async def sets() -> None:
        seen.append(VAR.get())
        VAR.set("leaked")

    async def waits_then_sets() -> None:
        await asyncio.sleep(0)
        seen.append(VAR.get())
        VAR.set("leaked too")

    async def reads() -> None:
        await asyncio.sleep(0.01)
        seen.append(VAR.get())
        done.set()

    for coro in (sets(), waits_then_sets(), sets(), reads()):
        eager.submit(_ticket(), coro)
    await _settled(done)
    assert seen == ["unset"] * 4


async def test_a_timeout_in_a_waiting_delivery_cuts_only_that_delivery() -> None:
    """``asyncio.timeout`` takes the current task: it must be the delivery's own."""
    eager = Eager(asyncio.get_running_loop())
    outcomes: list[str] = []
    done = asyncio.Event()

    async def cut() -> None:
        try:
            async with asyncio.timeout(0.05):
                await asyncio.sleep(5)
        except TimeoutError:
            outcomes.append("cut timed out")

    async def others(n: int) -> None:
        await asyncio.sleep(0.1)
        outcomes.append(f"other {n}")
        if n == 2:
            done.set()

    eager.submit(_ticket(), cut())
    for n in range(3):
        eager.submit(_ticket(), others(n))
    await _settled(done)
    assert outcomes == ["cut timed out", "other 0", "other 1", "other 2"]


async def test_cancelling_a_waiting_delivery_reaches_it_and_nothing_else() -> None:
    eager = Eager(asyncio.get_running_loop())
    outcomes: list[str] = []
    waiting, done = asyncio.Event(), asyncio.Event()

    async def cancelled() -> None:
        waiting.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise

    async def after() -> None:
        await asyncio.sleep(0.05)
        outcomes.append("after")
        done.set()

    ticket = _ticket()
    eager.submit(ticket, cancelled())
    eager.submit(_ticket(), after())
    await _settled(waiting)
    ticket.task.cancel()
    await _settled(done)
    assert outcomes == ["cancelled", "after"]


async def test_a_delivery_cancelling_its_own_task_does_not_cancel_the_next() -> None:
    eager = Eager(asyncio.get_running_loop())
    seen: list[tuple[str, asyncio.Task[Any] | None]] = []
    done = asyncio.Event()

    async def cancels_itself() -> None:
        task = asyncio.current_task()
        assert task is not None
        seen.append(("self", task))
        task.cancel()  # returns without waiting: the cancel stays on the task

    async def next_one() -> None:
        seen.append(("next", asyncio.current_task()))
        await asyncio.sleep(0.01)  # a cancel left on its task would land here
        done.set()

    eager.submit(_ticket(), cancels_itself())
    eager.submit(_ticket(), next_one())
    await _settled(done)
    assert [name for name, _ in seen] == ["self", "next"]
    assert seen[0][1] is not seen[1][1]


async def test_an_error_ends_its_delivery_only() -> None:
    eager = Eager(asyncio.get_running_loop())
    done = asyncio.Event()

    async def fails() -> None:
        raise RuntimeError("boom")

    async def fine() -> None:
        done.set()

    eager.submit(_ticket(), fails())
    eager.submit(_ticket(), fine())
    await _settled(done)
