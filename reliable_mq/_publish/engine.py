"""The publisher's policy: what happens to each message on every channel event.

A message is *admitted* (it holds a window slot and owns its ``message_id``),
then sent on the current channel generation, or queued in the backlog while
there is none. Every channel event resolves messages without a task or a timer
per message:

* ``basic.ack``: confirmed (or, after a ``basic.return``, unroutable);
* ``basic.nack``: republished after a backoff, until ``max_attempts``;
* channel or connection lost: back to the backlog in publish order;
* closed by a *refusal* of something we sent (``channel.close`` 403/404/406...,
  or a 50x connection close): the refused message fails alone with a typed
  error carrying the reply code and text, and the others are republished.
  When the reply text names the exchange, the culprits are the messages to it;
  otherwise the suspects are re-sent in halves, one half at a time, until the
  one the broker refuses is alone (`Isolation`);
* deadlines, stuck channels and long outages are enforced by one periodic
  sweep (`Engine.tick()`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from .._amqp.faults import Fault, FaultKind
from .._tracing import republished
from ..errors import (
    ClosedError,
    PublishAborted,
    PublishError,
    PublishGaveUp,
    PublishUnavailable,
    PublishUnroutable,
    ReliableMQError,
)
from ..settings import PublisherSettings
from .admission import Aborted, Unavailable, wait_for_admission
from .errors import (
    aborted_error,
    exchange_error,
    refused_error,
    timeout_error,
    unavailable_error,
)
from .isolation import Isolation, judge
from .ledger import Ledger
from .outgoing import Outgoing, Preparer, RetryReason, by_seq
from .ports import Exchanges, Link, SendChannel, StreamFactory
from .resolution import fail, not_admitted, succeed
from .window import Window

__all__ = ("Engine",)

_NACK_ONLY_SECONDS = 2.0
"""A channel that got only nacks (at least three, no ack) for this long is replaced."""


class Engine:
    """Sends admitted messages and resolves them; implements the stream's events.

    Its state is its own: the publisher, the admission and the closing talk to
    it through the methods below, and the stream through its events (`opened`,
    `confirmed`, `returned`, `lost`). It counts each message's events in the
    message's `ExchangeMetrics`, which serve both ``stats()`` and Prometheus.

    Args:
        settings: the publisher's settings (window, deadlines, retry policy).
        preparer: the publisher's encoder (told each channel's ``frame_max``).
        exchanges: the exchange probes.
        link: the connection (its reconnects, for returns right after one).
        stream: makes the confirm channel's keeper, given this engine as its events.
        log: the publisher's bound logger.
        on_idle: called when the last outstanding message gets its outcome.
    """

    def __init__(
        self,
        settings: PublisherSettings,
        preparer: Preparer,
        *,
        exchanges: Exchanges,
        link: Link,
        stream: StreamFactory,
        log: Any,
        on_idle: Callable[[], None] = lambda: None,
    ) -> None:
        self._settings = settings
        self._preparer = preparer
        self._link = link
        self._log = log
        self._ledger = Ledger(settings.max_in_flight, on_idle)
        self._window = self._ledger.window
        self._backlog: deque[Outgoing] = deque()
        self._isolation: Isolation | None = None
        self._closed = False
        self._aborting = False
        self._abort_reason = ""
        """Why `abort` was called, for the errors (empty: ``close()`` gave up)."""
        self._unavailable = False
        self._down_since: float | None = None
        self._exchanges = exchanges
        self._stream = stream(self, self._needed)
        self._diverted: dict[str, list[Outgoing]] = {}
        self._probes: set[asyncio.Task[None]] = set()
        self._next_deadline = float("inf")

    def _needed(self) -> bool:
        return not self._closed or self._ledger.busy

    # -- what others may ask ----------------------------------------------------------

    @property
    def window(self) -> Window:
        """The in-flight window (admission waits on it)."""
        return self._window

    @property
    def pending(self) -> int:
        """Callers without an outcome: admitted and outstanding, or waiting for admission."""
        return self._ledger.pending

    @property
    def in_flight(self) -> int:
        """Messages holding a window slot now."""
        return self._window.taken

    @property
    def high_water(self) -> int:
        """The most window slots ever held at once."""
        return self._window.high_water

    @property
    def channel_generation(self) -> int:
        """Confirm channels opened so far."""
        return self._stream.generation

    @property
    def unavailable(self) -> bool:
        """No connection for ``unavailable_timeout``: callers fail at once until one opens."""
        return self._unavailable

    @property
    def aborting(self) -> bool:
        """`abort` was called: every caller fails with ``PublishAborted``."""
        return self._aborting

    @property
    def idle(self) -> bool:
        """No caller waits for an outcome."""
        return self._ledger.idle

    async def wait_idle(self) -> None:
        """Return once no caller waits for an outcome."""
        await self._ledger.wait_idle()

    def holder(self, message_id: str) -> Outgoing | None:
        """The admitted message that owns ``message_id`` now, if any."""
        return self._ledger.holder(message_id)

    def exchange_known(self, exchange: str) -> bool:
        """``exchange`` is known to exist (no probe needed)."""
        return exchange in self._exchanges.known

    async def check_exchange(self, exchange: str) -> Fault | None:
        """Probe ``exchange`` (shared with concurrent callers): None when it exists."""
        return await self._exchanges.check(exchange)

    # -- life cycle -----------------------------------------------------------------------

    async def start(self) -> None:
        """Open the first confirm channel."""
        await self._stream.start()

    def stop_taking(self) -> None:
        """The publisher is closing: no channel is needed once nothing is left to send."""
        self._closed = True

    async def close(self) -> None:
        """Stop the probes, the confirm channel and the exchange checks (shutting down)."""
        self._closed = True
        for task in list(self._probes):
            task.cancel()
        await asyncio.gather(*self._probes, return_exceptions=True)
        await self._stream.close()
        await self._exchanges.close()

    # -- callers waiting for admission, and batches ----------------------------------------

    def hold(self) -> None:
        """A caller waits for admission: the engine is not idle until `unhold`."""
        self._ledger.hold()

    def unhold(self) -> None:
        self._ledger.unhold()

    def begin_batch(self) -> None:
        """A ``publish_many()`` runs: the engine is not idle until `end_batch`."""
        self._ledger.begin_batch()

    def end_batch(self) -> None:
        self._ledger.end_batch()

    # -- admission ------------------------------------------------------------------

    def admit_now(self, out: Outgoing) -> bool:
        """Admit and send ``out`` without waiting, if nothing stands in the way."""
        if (
            self._unavailable
            or self._ledger.holder(out.message_id) is not None
            or out.exchange not in self._exchanges.known
            or not self._window.try_acquire()
        ):
            return False
        self._admitted(out)
        return True

    async def admit(self, out: Outgoing) -> None:
        """Wait (until the message's deadline) for its id, its exchange and a slot; send it.

        While it waits, the caller counts as waiting (`pending`): ``close()``
        waits for it as for an admitted message.

        Raises:
            PublishError: the deadline passed, the exchange is missing or refused,
                the broker is unavailable, or the publisher is closing.
        """
        self.hold()
        try:  # no nested coroutine: this is the path of every caller past the window
            await wait_for_admission(self, out)
            self._admitted(out)  # before unhold(): the engine must not look idle between
        except BaseException as exc:
            not_admitted(out, exc)
            raise
        finally:
            self.unhold()

    async def admit_held(self, out: Outgoing) -> None:
        """`admit` for a caller already counted by `hold` (it calls `unhold` after)."""
        try:
            await wait_for_admission(self, out)
        except BaseException as exc:
            not_admitted(out, exc)
            raise
        self._admitted(out)

    def owns(self, out: Outgoing) -> bool:
        """``out`` was admitted: the engine gives its caller the outcome."""
        return out.finished or self._ledger.holder(out.message_id) is out

    def _admitted(self, out: Outgoing) -> None:
        """``out`` holds its slot and its id: count it, and send it or queue it."""
        self._ledger.admit(out)
        self._next_deadline = min(self._next_deadline, out.deadline)
        self._submit(out)

    # -- sending ----------------------------------------------------------------------

    def _submit(self, out: Outgoing) -> None:
        """Send ``out`` now, or queue it behind the messages already waiting."""
        generation = self._stream.current
        if generation is not None and not self._backlog and self._isolation is None:
            self._send(generation, out)
        else:
            self._backlog.append(out)

    def _send(self, generation: SendChannel, out: Outgoing) -> None:
        if out.exchange not in self._exchanges.known:
            self._divert(out)  # its exchange went missing (or was refused) since admission
            return
        out.attempts += 1
        if out.attempts > 1:
            out.metrics.republish(out.retry_reason)
            if out.batch is not None:
                out.batch.republished += 1
            if out.span is not None:
                republished(out.span, out.retry_reason, out.attempts)
        out.returned = None
        out.generation = generation.number
        out.sent_at = asyncio.get_running_loop().time()
        out.tag = generation.write(out)

    def _pump(self) -> None:
        """Send what waits, in order; during an isolation, only its current chunk."""
        generation = self._stream.current
        if generation is None or generation.closing:
            return
        isolation = self._isolation
        if isolation is not None:
            if isolation.chunk and not isolation.chunk_done():
                return
            chunk = isolation.next_chunk()
            if chunk:
                for out in chunk:
                    self._send(generation, out)
                return
            self._isolation = None
            self._log.info("refusal_isolated", reason=isolation.fault.describe())
        backlog = self._backlog
        while backlog and not generation.closing:
            out = backlog.popleft()
            if not out.finished:
                self._send(generation, out)

    def _divert(self, out: Outgoing) -> None:
        """Hold ``out`` until its exchange is probed again; one probe per exchange."""
        waiting = self._diverted.get(out.exchange)
        if waiting is not None:
            waiting.append(out)
            return
        self._diverted[out.exchange] = [out]
        task = asyncio.get_running_loop().create_task(self._reprobe(out.exchange))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _reprobe(self, exchange: str) -> None:
        fault: Fault | None = None
        try:
            while True:
                fault = await self._exchanges.check(exchange)
                if fault is None or fault.refusal:
                    break
                await asyncio.sleep(0.2)  # could not check (connection trouble): again
        except (ClosedError, asyncio.CancelledError):
            for out in self._diverted.pop(exchange, []):
                self._fail(out, self.aborted_error(out))
            raise
        for out in self._diverted.pop(exchange, []):
            if out.finished:
                continue
            if fault is None:
                self._submit(out)
            else:
                self._fail(out, exchange_error(out, exchange, fault))

    # -- stream events ------------------------------------------------------------------

    def opened(self, generation: SendChannel) -> None:
        self._preparer.frame_max = generation.frame_max
        self._down_since = None
        if self._unavailable:
            self._unavailable = False
            self._log.info("broker_available_again")
        self._pump()

    def confirmed(self, generation: SendChannel, items: list[Outgoing], ack: bool) -> None:
        now = asyncio.get_running_loop().time()
        if ack:
            generation.last_ack = now
            generation.nacks_since_ack = 0
        for out in items:
            out.tag = 0
            if not ack:
                self._nacked(generation, out, now)
            elif out.returned is not None:
                self._returned(out, now)
            else:
                metrics = out.metrics
                metrics.confirmed += 1
                metrics.latency.observe(now - out.sent_at)
                if out.finished:
                    self._ledger.release(out)
                else:
                    self._succeed(out, now)
        if self._isolation is not None:
            self._pump()

    def returned(self, generation: SendChannel, message_id: str, code: int, text: str) -> None:
        out = self._ledger.holder(message_id)
        if out is not None and out.generation == generation.number and out.tag:
            out.returned = (code, text)

    def lost(self, generation: SendChannel, items: list[Outgoing], fault: Fault | None) -> None:
        if self._stream.current is None and self._down_since is None:
            self._down_since = asyncio.get_running_loop().time()
        live: list[Outgoing] = []
        for out in items:
            out.tag = 0
            if out.finished:
                self._ledger.release(out)
            else:
                live.append(out)
        if fault is not None and fault.refusal:
            self._refused(live, fault)
        else:
            self._requeue(live, RetryReason.CONNECTION_LOST)

    def _requeue(self, items: Iterable[Outgoing], reason: RetryReason) -> None:
        """Put messages back in front of the backlog, in publish order."""
        items = list(items)
        if not items:
            return
        lost = reason is RetryReason.CONNECTION_LOST
        for out in items:
            out.retry_reason = reason
            if lost:
                out.maybe_routed = True
        if self._isolation is not None:
            self._isolation.chunk = []
            self._isolation.suspects.extendleft(reversed(sorted(items, key=by_seq)))
            return
        merged = sorted([*items, *self._backlog], key=by_seq)
        self._backlog = deque(merged)

    # -- outcomes -------------------------------------------------------------------------

    def _nacked(self, generation: SendChannel, out: Outgoing, now: float) -> None:
        out.metrics.nacked += 1
        if generation.number == self._stream.generation:
            generation.nacks_since_ack += 1
            if generation.nacks_since_ack >= 3 and now - generation.last_ack >= _NACK_ONLY_SECONDS:
                # RabbitMQ 3.10 (seen on 3.10.8): a channel that first published to a
                # quorum queue while it had no leader nacks every later publish to
                # it, even after a new leader is elected; a fresh channel works.
                self._stream.replace(generation)
        if out.finished:
            self._ledger.release(out)
            return
        if self._counted_failure(out, "nacked by the broker"):
            return
        out.retry_reason = RetryReason.NACK
        self._back_off(out, out.failures, now)

    def _counted_failure(self, out: Outgoing, what: str) -> bool:
        """Count a nack or a confirm timeout; True if ``out`` gave up (max_attempts)."""
        out.failures += 1
        if out.failures < self._settings.max_attempts:
            return False
        self._fail(
            out,
            PublishGaveUp(
                f"{what} {out.failures} times", message_id=out.message_id, attempts=out.attempts
            ),
        )
        return True

    def _returned(self, out: Outgoing, now: float) -> None:
        out.metrics.returned += 1
        if out.finished:
            self._ledger.release(out)
            return
        assert out.returned is not None
        code, text = out.returned
        if self._return_may_be_transient(now):
            out.returns += 1
            out.retry_reason = RetryReason.RETURNED_AFTER_RECONNECT
            self._back_off(out, out.returns, now)
            return
        self._fail(
            out,
            PublishUnroutable(
                message_id=out.message_id,
                attempts=out.attempts,
                exchange=out.exchange,
                routing_key=out.routing_key,
                reply_code=code,
                reply_text=text,
            ),
        )

    def _return_may_be_transient(self, now: float) -> bool:
        """A basic.return soon after a REconnect may mean "queue not recovered yet"."""
        grace = self._settings.returns_retried_after_reconnect
        return grace > 0 and self._link.generation > 1 and now - self._link.connected_at < grace

    def _back_off(self, out: Outgoing, failures: int, now: float) -> None:
        loop = asyncio.get_running_loop()
        delay = self._settings.backoff(failures)
        if now + delay >= out.deadline:
            loop.call_at(out.deadline, self._expire, out)
        else:
            loop.call_later(delay, self._resend, out)

    def _resend(self, out: Outgoing) -> None:
        if not out.finished and out.tag == 0:
            self._submit(out)

    def _expire(self, out: Outgoing) -> None:
        if not out.finished:
            self._fail(out, self.timeout_error(out))

    def _refused(self, live: list[Outgoing], fault: Fault) -> None:
        """The broker closed the channel (or connection) refusing something we sent."""
        for out in live:
            out.refusals += 1
        entity = fault.entity
        if entity is not None and entity[0] == "exchange":
            name = entity[1]
            culprits = [out for out in live if out.exchange == name]
            if culprits:
                self._exchange_refused(name, culprits, fault)
                self._requeue(
                    [out for out in live if out.exchange != name], RetryReason.REFUSED_NEARBY
                )
                return
        failed, isolation = judge(live, self._isolation, fault)
        if isolation is not None and isolation is not self._isolation:
            self._log.warning(
                "refusal_isolating", reason=fault.describe(), suspects=len(isolation.suspects)
            )
            for out in isolation.suspects:
                out.retry_reason = RetryReason.REFUSED_NEARBY
        self._isolation = isolation
        for out in failed:
            self._fail(out, refused_error(out, fault))

    def _exchange_refused(self, name: str, culprits: list[Outgoing], fault: Fault) -> None:
        if fault.kind is FaultKind.NOT_FOUND:
            self._exchanges.forget(name)
            if len(culprits) > 1:
                # One of them met the 404; the ones before it may have been routed
                # before the exchange went away. Which is which, the broker does not say.
                for out in culprits:
                    out.maybe_routed = True
        else:
            self._exchanges.refuse(name, fault)
        for out in culprits:
            self._fail(out, exchange_error(out, name, fault))

    # -- resolution -----------------------------------------------------------------------

    def _succeed(self, out: Outgoing, now: float) -> None:
        succeed(out, now)
        self._ledger.release(out)
        self._ledger.resolved()

    def _fail(self, out: Outgoing, error: ReliableMQError) -> None:
        """Give ``out`` its final error (it stays in the window while still on a channel)."""
        if out.finished:
            return
        fail(out, error, self._log)
        if out.tag == 0:
            self._ledger.release(out)
        self._ledger.resolved()

    # -- errors ------------------------------------------------------------------------------

    def timeout_error(self, out: Outgoing) -> PublishError:
        if self._aborting:
            return self.aborted_error(out)
        return timeout_error(out)

    def aborted_error(self, out: Outgoing) -> PublishAborted:
        return aborted_error(out, self._abort_reason)

    def unavailable_error(self, out: Outgoing) -> PublishUnavailable:
        return unavailable_error(out, self._settings.unavailable_timeout)

    # -- the periodic sweep --------------------------------------------------------------------

    def tick(self, now: float) -> None:
        """Deadlines, stuck channels and outages: called every 50 ms by the publisher."""
        self._window.expire(now)
        if now >= self._next_deadline:
            self._expire_deadlines(now)
        generation = self._stream.current
        if generation is not None and not generation.closing:
            self._check_stuck(generation, now)
        elif (
            not self._unavailable
            and self._down_since is not None
            and now - self._down_since >= self._settings.unavailable_timeout
        ):
            self._go_unavailable()

    def _expire_deadlines(self, now: float) -> None:
        earliest = float("inf")
        for out in self._ledger.admitted():
            if out.finished:
                continue
            if out.deadline <= now:
                self._fail(out, self.timeout_error(out))
            elif out.deadline < earliest:
                earliest = out.deadline
        self._next_deadline = earliest

    def _check_stuck(self, generation: SendChannel, now: float) -> None:
        oldest = generation.tracker.oldest()
        timeout = self._settings.confirm_timeout
        if oldest is None or now - oldest.sent_at < timeout:
            return
        self._log.warning(
            "confirm_timeout",
            message_id=oldest.message_id,
            seconds=timeout,
            unconfirmed=len(generation.tracker),
        )
        for out in generation.tracker.outstanding():
            if out.finished or now - out.sent_at < timeout:
                continue
            self._counted_failure(out, f"not confirmed within {timeout}s")
        self._stream.replace(generation)

    def _go_unavailable(self) -> None:
        self._unavailable = True
        self._log.error(
            "broker_unavailable",
            seconds=self._settings.unavailable_timeout,
            waiting=sum(1 for out in self._ledger.admitted() if not out.finished),
        )
        self._window.fail_waiters(Unavailable())
        for out in self._ledger.admitted():
            if not out.finished and out.tag == 0:
                self._fail(out, self.unavailable_error(out))

    def abort(self, why: str = "") -> int:
        """Fail every caller without an outcome with PublishAborted, now; return how many.

        Admitted messages fail here; callers waiting for admission are woken and
        fail as they leave it (`waiting` then drops to 0). ``why`` replaces the
        error's default wording ("publisher closed before a confirm").
        """
        count = self.pending
        if not self._aborting:
            self._abort_reason = why
        self._aborting = True
        self._window.fail_waiters(Aborted())
        for out in self._ledger.admitted():
            if not out.finished:
                self._fail(out, self.aborted_error(out))
        for out in self._ledger.admitted():
            out.tag = 0
            self._ledger.release(out)
        return count
