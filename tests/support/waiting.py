"""The one way a test waits for something: poll a condition until it holds or time runs out."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

__all__ = ("wait_until",)


async def wait_until(
    condition: Callable[[], object],
    *,
    timeout: float = 10.0,
    what: str = "",
    interval: float = 0.02,
) -> None:
    """Poll ``condition()`` every ``interval`` seconds until it is truthy.

    Args:
        condition: checked at once, then after each sleep; never awaited.
        timeout: seconds (on the loop's clock) before the test fails.
        what: what is awaited, for the failure message.
        interval: seconds between checks.

    Raises:
        AssertionError: ``condition()`` still false after ``timeout`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        if loop.time() > deadline:
            raise AssertionError(
                f"timed out after {timeout}s waiting for {what or 'the condition'}"
            )
        await asyncio.sleep(interval)
