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

    def drop_fds_in_child(self) -> None:
        """In a forked child: point the parent's loop's descriptors at ``/dev/null``.

        The child's copies of the loop's sockets (its connections, the wake-up
        pipe) and of its selector are replaced with ``dup2``: the child no
        longer holds the parent's connection open, and nothing is sent on it
        (the parent's copy keeps the socket alive). The descriptor numbers stay
        taken, so a finalizer of the abandoned objects can never close a
        descriptor the child opens later.
        """
        if self.pid == os.getpid() or self.loop.is_closed():
            return
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        try:
            for fd in _loop_fds(self.loop) - {null}:
                with contextlib.suppress(OSError):
                    os.dup2(null, fd, inheritable=False)
        finally:
            os.close(null)

    def stop(self, timeout: float) -> bool:
        """Stop the loop, cancel leftovers and join the thread for ``timeout`` s at most.

        Returns:
            True if the thread ended in time.
        """
        with contextlib.suppress(RuntimeError):  # already closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _loop_fds(loop: asyncio.AbstractEventLoop) -> set[int]:
    """The open descriptors a selector event loop owns (CPython's private attributes).

    Only descriptors known to be open: registered with the selector, held by
    a live transport's socket, the loop's self-pipe, the selector itself. A
    number taken from a closed socket could belong to something else by now.
    """
    fds: set[int] = set()
    selector = getattr(loop, "_selector", None)
    if selector is not None:
        with contextlib.suppress(Exception):
            fds.update(key.fd for key in selector.get_map().values())
        with contextlib.suppress(Exception):
            fds.add(selector.fileno())
    transports = getattr(loop, "_transports", None) or {}
    for transport in list(transports.values()):
        with contextlib.suppress(Exception):
            sock = transport.get_extra_info("socket")
            if sock is not None:
                fds.add(sock.fileno())
    for name in ("_ssock", "_csock"):
        sock = getattr(loop, name, None)
        if sock is not None:
            fds.add(sock.fileno())
    return {fd for fd in fds if fd >= 0}
