"""The publisher's window (pure logic): FIFO slots, deadlines by sweep, abort."""

from __future__ import annotations

import asyncio

import pytest

from reliable_mq._publish.window import Window


class TestWindow:
    async def test_slots_pass_to_waiters_in_order(self) -> None:
        """A released slot goes to the oldest waiter; the high-water mark is kept."""
        window = Window(1)
        assert window.try_acquire()
        order: list[int] = []

        async def wait(n: int) -> None:
            await window.acquire(deadline=asyncio.get_running_loop().time() + 10)
            order.append(n)

        tasks = [asyncio.ensure_future(wait(n)) for n in range(3)]
        await asyncio.sleep(0)
        for _ in range(3):
            window.release()
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        assert order == [0, 1, 2]
        assert window.taken == 1
        assert window.high_water == 1

    async def test_expire_fails_only_waiters_past_their_deadline(self) -> None:
        window = Window(1)
        assert window.try_acquire()
        now = asyncio.get_running_loop().time()
        early = asyncio.ensure_future(window.acquire(deadline=now + 1))
        late = asyncio.ensure_future(window.acquire(deadline=now + 5))
        await asyncio.sleep(0)
        window.expire(now + 0.5)
        await asyncio.sleep(0)
        assert not early.done()
        window.expire(now + 2)
        with pytest.raises(TimeoutError):
            await early
        assert not late.done()
        window.release()
        await late
        assert window.taken == 1

    async def test_a_timed_out_head_does_not_block_new_acquirers(self) -> None:
        """Once the expired waiter is gone and a slot frees, try_acquire works again."""
        window = Window(1)
        assert window.try_acquire()
        now = asyncio.get_running_loop().time()
        waiter = asyncio.ensure_future(window.acquire(deadline=now))
        await asyncio.sleep(0)
        window.expire(now + 1)
        with pytest.raises(TimeoutError):
            await waiter
        window.release()
        assert window.taken == 0
        assert window.try_acquire()

    async def test_fail_waiters_aborts_everyone_waiting(self) -> None:
        window = Window(1)
        assert window.try_acquire()
        deadline = asyncio.get_running_loop().time() + 10
        waiters = [asyncio.ensure_future(window.acquire(deadline)) for _ in range(3)]
        await asyncio.sleep(0)
        window.fail_waiters(RuntimeError("closing"))
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert all(isinstance(r, RuntimeError) for r in results)


@pytest.mark.unit
class TestWindowEdges:
    """The window's edges: a slot handed over as its waiter leaves, deadlines swept in turn."""

    async def test_a_waiter_cancelled_as_it_is_handed_a_slot_passes_it_on(self) -> None:
        """Cancelled after ``release()`` gave it the slot but before it ran: the slot
        goes to the next waiter, or back to the window; the window never shrinks."""
        window = Window(1)
        assert window.try_acquire()
        deadline = asyncio.get_running_loop().time() + 10
        first = asyncio.ensure_future(window.acquire(deadline))
        second = asyncio.ensure_future(window.acquire(deadline))
        await asyncio.sleep(0)
        window.release()  # the slot is first's now
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1)  # first passed the slot on
        assert window.taken == 1
        third = asyncio.ensure_future(window.acquire(deadline))
        await asyncio.sleep(0)
        window.release()  # second's slot, handed to third
        third.cancel()
        with pytest.raises(asyncio.CancelledError):
            await third
        assert window.taken == 0  # third gave it back, with no one waiting: nothing is lost
        assert window.try_acquire()

    async def test_each_sweep_remembers_the_deadlines_still_ahead(self) -> None:
        """A sweep that fails the earliest waiter still fails the later ones when their
        deadlines pass, each at its own sweep (none waits past it)."""
        window = Window(1)
        assert window.try_acquire()
        now = asyncio.get_running_loop().time()
        waiters = [asyncio.ensure_future(window.acquire(now + n)) for n in (1, 2, 3)]
        await asyncio.sleep(0)
        for n, waiter in enumerate(waiters, start=1):
            window.expire(now + n)  # exactly at its deadline
            await asyncio.sleep(0)
            assert waiter.done(), n
            assert not any(w.done() for w in waiters[n:])
        for waiter in waiters:
            with pytest.raises(TimeoutError):
                await waiter
        window.release()
        assert window.taken == 0

    async def test_high_water_keeps_the_peak(self) -> None:
        """The high-water mark is the most slots ever taken at once."""
        window = Window(3)
        assert all(window.try_acquire() for _ in range(3))
        for _ in range(3):
            window.release()
        assert window.try_acquire()
        assert (window.taken, window.high_water) == (1, 3)
