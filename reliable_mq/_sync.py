"""Run a coroutine from synchronous code, even where a loop already runs.

Spark's executors call us from plain functions, and a notebook (or an async
test) may already run a loop in the calling thread: then the coroutine gets a
fresh loop in a helper thread instead of clashing with it.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ("run_sync",)

_T = TypeVar("_T")


def run_sync(factory: Callable[[], Awaitable[_T]], *, thread_name: str = "reliable_mq.sync") -> _T:
    """Run ``factory()`` to completion on a fresh event loop and return its result."""

    async def main() -> _T:
        return await factory()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        running = False
    else:
        running = True
    if not running:
        # Outside the ``except`` block: an error raised by the coroutine must not
        # be chained to the "no running event loop" RuntimeError of the probe.
        return asyncio.run(main())
    result: list[_T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(main()))
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=target, name=thread_name, daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
