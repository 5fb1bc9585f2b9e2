"""Which exchanges exist: checked once with a passive declare, on a channel of its own.

A publish to a missing exchange makes the broker close the channel with 404,
and with it every other publish in flight on that channel. So the first
publish to an exchange waits for a ``exchange.declare(passive=True)`` on a
separate probe channel; only a 404 there fails the message, and the confirm
channel never sees it. Concurrent first publishes to one exchange share one
probe. The answer is cached: "exists" until a publish channel is closed with a
404 naming the exchange; "missing" (a 404 from the probe) for `MISSING_TTL`
seconds; "refused" (for example an internal exchange, 403) for `REFUSAL_TTL`
seconds. So a loop publishing to a bad exchange fails locally and fast: it
neither closes the confirm channel again and again nor opens and closes a probe
channel (a channel error logged by the broker) for every message. The price of
the "missing" entry: an exchange declared just after a publish to it failed may
still fail with ``ExchangeNotFound`` for up to `MISSING_TTL` seconds.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .._amqp import AMQP_ERRORS, Channel, Fault, FaultKind, classify
from ..connection import ConnectionSupervisor
from ..errors import ClosedError

__all__ = ("MISSING_TTL", "REFUSAL_TTL", "ExchangeCache")

REFUSAL_TTL = 5.0
"""Seconds a refused exchange fails publishes locally before it is tried again."""
MISSING_TTL = 1.0
"""Seconds a missing exchange (404 from the probe) fails publishes locally before it
is probed again: at most one probe channel per second per missing exchange."""
_PROBE_ATTEMPTS = 8


class ExchangeCache:
    """Known-good exchanges, and the probes that find out."""

    def __init__(self, supervisor: ConnectionSupervisor, *, open_timeout: float, log: Any) -> None:
        self.known: set[str] = {""}
        """Exchanges that exist (the default exchange always does)."""
        self._supervisor = supervisor
        self._open_timeout = open_timeout
        self._log = log
        self._refused: dict[str, tuple[float, Fault]] = {}
        self._probes: dict[str, asyncio.Task[Fault | None]] = {}
        self._channel: Channel | None = None
        self._lock = asyncio.Lock()
        self.channels_opened = 0
        """Probe channels opened so far (a 404 closes the probe channel)."""

    def refused(self, exchange: str) -> Fault | None:
        """The cached refusal (or 404) of ``exchange``, if one is still in force."""
        entry = self._refused.get(exchange)
        if entry is None:
            return None
        if entry[0] <= asyncio.get_running_loop().time():
            del self._refused[exchange]
            return None
        return entry[1]

    def forget(self, exchange: str) -> None:
        """A publish channel was closed with 404 for ``exchange``: probe it again next time."""
        self.known.discard(exchange)

    def refuse(self, exchange: str, fault: Fault) -> None:
        """The broker refused a publish to ``exchange``: fail the next ones locally for a while."""
        self.known.discard(exchange)
        self._refused[exchange] = (asyncio.get_running_loop().time() + REFUSAL_TTL, fault)

    async def check(self, exchange: str) -> Fault | None:
        """Probe ``exchange`` (shared by concurrent callers); None when it exists.

        Callers bound the wait with their own deadline.
        """
        refusal = self.refused(exchange)
        if refusal is not None:
            return refusal
        probe = self._probes.get(exchange)
        if probe is None:
            probe = asyncio.get_running_loop().create_task(self._probe(exchange))
            self._probes[exchange] = probe
            probe.add_done_callback(lambda _: self._probes.pop(exchange, None))
        return await asyncio.shield(probe)

    async def close(self) -> None:
        for probe in list(self._probes.values()):
            probe.cancel()
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()

    async def _probe(self, exchange: str) -> Fault | None:
        fault: Fault | None = None
        for attempt in range(_PROBE_ATTEMPTS):
            try:
                # One probe at a time: a 404 closes the probe channel, and with it
                # every other declare in flight on it, each raising that 404.
                async with self._lock:
                    channel = await self._open_channel()
                    async with asyncio.timeout(self._open_timeout):
                        await channel.declare_exchange(exchange, passive=True)
            except ClosedError:
                raise
            except AMQP_ERRORS as exc:
                fault = classify(exc)
                assert fault is not None
                if fault.kind is FaultKind.NOT_FOUND and not fault.names("exchange", exchange):
                    await asyncio.sleep(0)  # someone else's 404: ask again
                    continue
                if fault.kind is FaultKind.NOT_FOUND or fault.refusal:
                    self._log.debug(
                        "exchange_probe_refused", exchange=exchange, reason=fault.describe()
                    )
                    if fault.kind is FaultKind.NOT_FOUND:
                        until = asyncio.get_running_loop().time() + MISSING_TTL
                        self._refused[exchange] = (until, fault)
                    return fault
                self._log.info("exchange_probe_failed", exchange=exchange, error=fault.describe())
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
                continue
            self.known.add(exchange)
            return None
        return fault

    async def _open_channel(self) -> Channel:
        channel = self._channel
        if channel is not None and not channel.is_closed:
            return channel
        link = await self._supervisor.wait_connected()
        async with asyncio.timeout(self._open_timeout):
            opened = await link.channel()
        self.channels_opened += 1
        self._channel = opened
        return opened
