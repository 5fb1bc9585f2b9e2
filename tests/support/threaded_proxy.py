"""A `TCPProxy` on its own event-loop thread, for tests written as plain functions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from reliable_mq.testing import TCPProxy

__all__ = ("ThreadedProxy",)

_T = TypeVar("_T")


class ThreadedProxy:
    """Start with `with ThreadedProxy(port) as proxy:`; every method blocks."""

    def __init__(self, target_port: int, target_host: str = "127.0.0.1") -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.proxy = TCPProxy(target_host, target_port)

    def _call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout=30)

    def __enter__(self) -> ThreadedProxy:
        self._thread.start()
        self._call(self.proxy.start())
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._call(self.proxy.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def port(self) -> int:
        return self.proxy.port

    @property
    def url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.proxy.port}/"

    def cut(self) -> int:
        return self._call(self.proxy.cut())

    def _run(self, func: Any, *args: Any) -> None:
        async def call() -> None:
            func(*args)

        self._call(call())

    def set_stall(self, enabled: bool) -> None:
        self._run(self.proxy.set_stall, enabled)

    def set_refuse(self, enabled: bool) -> None:
        self._run(self.proxy.set_refuse, enabled)

    def set_blackhole(self, enabled: bool) -> None:
        self._run(self.proxy.set_blackhole, enabled)
