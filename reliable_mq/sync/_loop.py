"""An asyncio event loop running in a daemon thread, owned by one process.

The blocking facades run the async implementation on such a loop. The thread
is a daemon so that a forgotten ``close()`` never keeps the interpreter alive;
the facade closes it from an ``atexit`` hook instead, with a bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ("LoopThread",)

_T = TypeVar("_T")


class LoopThread:
    """Runs one event loop forever in a daemon thread until `stop`.

    Args:
        name: the thread's name (shown by debuggers and ``py-spy``).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.pid = os.getpid()
        """The process that started the thread; after a fork the loop is the parent's."""
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._running = threading.Event()
        self.ident: int | None = None
        """The loop thread's ``threading.get_ident()`` once started."""

    def start(self) -> None:
        """Start the thread and return once its loop runs."""
        self._thread.start()
        self._running.wait()

    def _run(self) -> None:
        self.ident = threading.get_ident()
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._running.set)
        try:
            self.loop.run_forever()
        finally:
            self._finish()

    def _finish(self) -> None:
        """Cancel what is left (nothing, after a clean close) and close the loop."""
        loop = self.loop
        tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        with contextlib.suppress(RuntimeError):
            loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()

    @property
    def alive(self) -> bool:
        """The thread runs (and belongs to this process)."""
        return self.pid == os.getpid() and self._thread.is_alive()

    def in_loop_thread(self) -> bool:
        return threading.get_ident() == self.ident

    def submit(self, coro: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        """Schedule ``coro`` on the loop; its outcome arrives in the returned future.

        Raises:
            RuntimeError: the loop is closed (the coroutine is closed, never run).
        """
        try:
            return asyncio.run_coroutine_threadsafe(coro, self.loop)
        except RuntimeError:
            coro.close()
            raise

    def stop(self, timeout: float) -> bool:
        """Stop the loop, cancel leftovers and join the thread for ``timeout`` s at most.

        Returns:
            True if the thread ended in time.
        """
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        return not self._thread.is_alive()
