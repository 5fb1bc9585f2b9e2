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
