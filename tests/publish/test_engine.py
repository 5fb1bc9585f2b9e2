"""The publisher's engine, against a fake stream: its policy without a broker.

The fake stream plays the broker: it records what the engine writes on each
channel generation and replays acks, nacks, returns, refusals and losses. The
engine's state is reached only through its API (`Engine.pending`, ``idle``,
``in_flight``...) and what its callers get.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq._amqp.faults import Fault, FaultKind
from reliable_mq._publish.confirms import ConfirmTracker
from reliable_mq._publish.engine import Engine
from reliable_mq._publish.outgoing import Outgoing, Preparer
from reliable_mq._publish.ports import StreamEvents
from reliable_mq.errors import (
    ExchangeNotFound,
    PublishAborted,
    PublishGaveUp,
    PublishRefused,
    PublishTimeout,
    PublishUnavailable,
    PublishUnroutable,
)
from reliable_mq.metrics import ExchangeMetrics, Metrics
from reliable_mq.outcomes import PublishResult
from reliable_mq.settings import PublisherSettings

pytestmark = pytest.mark.unit


class FakeChannel:
    """One channel generation: what was written on it, in order."""

    def __init__(self, number: int) -> None:
        self.number = number
        self.frame_max = 4096
        self.closing = False
        self.last_ack = 0.0
        self.nacks_since_ack = 0
        self.tracker: ConfirmTracker[Outgoing] = ConfirmTracker()
        self.written: list[str] = []

    def write(self, out: Outgoing) -> int:
        self.written.append(out.message_id)
        return self.tracker.add(out)


class FakeStream:
    """Channels opened on demand; the test acts as the broker."""

    def __init__(self, events: StreamEvents, needed: Callable[[], bool]) -> None:
        self.events = events
        self.needed = needed
        self.current: FakeChannel | None = None
        self.generation = 0
        self.channels: list[FakeChannel] = []
        self.replaced: list[int] = []
        self.closed = False

    async def start(self) -> None:
        self.open()

    async def close(self) -> None:
        self.closed = True
        self.current = None

    def replace(self, generation: FakeChannel) -> None:
        self.replaced.append(generation.number)

    # -- the broker's side ------------------------------------------------------------

    def open(self) -> FakeChannel:
        self.generation += 1
        channel = FakeChannel(self.generation)
        self.channels.append(channel)
        self.current = channel
        self.events.opened(channel)
        return channel

    def ack(self, tag: int, *, multiple: bool = False, nack: bool = False) -> None:
        channel = self.current
        assert channel is not None
        items = channel.tracker.settle(tag, multiple)
        self.events.confirmed(channel, items, not nack)

    def returned(self, message_id: str, code: int = 312, text: str = "NO_ROUTE") -> None:
        assert self.current is not None
        self.events.returned(self.current, message_id, code, text)

    def lose(self, fault: Fault | None = None) -> FakeChannel:
        channel = self.current
        assert channel is not None
        self.current = None
        channel.closing = True
        self.events.lost(channel, channel.tracker.drain(), fault)
        return channel


class FakeExchanges:
    def __init__(self, missing: frozenset[str] = frozenset()) -> None:
        self.known: set[str] = {""}
        self.missing = missing
        self.forgotten: list[str] = []

    async def check(self, exchange: str) -> Fault | None:
        if exchange in self.missing:
            return Fault(FaultKind.NOT_FOUND, 404, f"NOT_FOUND - no exchange '{exchange}'")
        self.known.add(exchange)
        return None

    def forget(self, exchange: str) -> None:
        self.forgotten.append(exchange)
        self.known.discard(exchange)

    def refuse(self, exchange: str, fault: Fault) -> None:
        self.known.discard(exchange)

    async def close(self) -> None:
        return None


class FakeLink:
    generation = 1
    connected_at = 0.0


class Harness:
    """An engine on a fake stream, and a way to hand it messages as a publisher does."""

    def __init__(self, **settings: Any) -> None:
        values: dict[str, Any] = {"max_in_flight": 100, "backoff_initial": 0.0, "backoff_max": 0.0}
        self.settings = PublisherSettings(**{**values, **settings})
        self.exchanges = FakeExchanges(frozenset({"gone"}))
        self.streams: list[FakeStream] = []
        self.idle_calls = 0

        def stream(events: StreamEvents, needed: Callable[[], bool]) -> FakeStream:
            made = FakeStream(events, needed)
            self.streams.append(made)
            return made

        def went_idle() -> None:
            self.idle_calls += 1

        self.engine = Engine(
            self.settings,
            Preparer(self.settings, "t-"),
            exchanges=self.exchanges,
            link=FakeLink(),
            stream=stream,
            log=_NullLog(),
            on_idle=went_idle,
        )
        self.counts = Metrics.on(CollectorRegistry()).for_publisher("p")
        self.seq = 0

    @property
    def stream(self) -> FakeStream:
        return self.streams[0]

    def message(self, exchange: str = "", timeout: float = 30.0) -> Outgoing:
        self.seq += 1
        loop = asyncio.get_running_loop()
        out = Outgoing(
            self.seq,
            f"m{self.seq}",
            None,  # type: ignore[arg-type]  # the fake channel never encodes
            exchange,
            "rk",
            True,
            loop.time() + timeout,
            time.monotonic(),
            self.metrics(exchange),
        )
        out.future = loop.create_future()
        return out

    def metrics(self, exchange: str = "") -> ExchangeMetrics:
        return self.counts.for_exchange(exchange)

    async def publish(self, *outs: Outgoing) -> None:
        for out in outs:
            if not self.engine.admit_now(out):
                await self.engine.admit(out)


class _NullLog:
    def __getattr__(self, name: str) -> Callable[..., None]:
        return lambda *args, **kwargs: None


async def _outcome(out: Outgoing) -> PublishResult | BaseException:
    assert out.future is not None
    try:
        return await asyncio.wait_for(asyncio.shield(out.future), 5)
    except Exception as exc:
        return exc


async def _settled(*outs: Outgoing) -> list[PublishResult | BaseException]:
    return [await _outcome(out) for out in outs]


class TestConfirms:
    async def test_an_ack_resolves_every_message_it_covers(self) -> None:
        """A multiple ack confirms the prefix; the engine is idle once all are confirmed."""
        h = Harness()
        await h.engine.start()
        outs = [h.message() for _ in range(3)]
        await h.publish(*outs)
        assert h.stream.current is not None and h.stream.current.written == ["m1", "m2", "m3"]
        assert h.engine.pending == 3 and not h.engine.idle and h.engine.in_flight == 3
        h.stream.ack(2, multiple=True)
        assert [out.future.done() for out in outs if out.future] == [True, True, False]
        h.stream.ack(3)
        results = await _settled(*outs)
        assert all(isinstance(r, PublishResult) and r.attempts == 1 for r in results)
        assert h.engine.idle and h.engine.pending == 0 and h.engine.in_flight == 0
        assert h.idle_calls == 1
        assert h.metrics().confirmed == 3 and h.metrics().latency.count == 3

    async def test_messages_wait_for_a_channel_and_go_in_order(self) -> None:
        """Admitted with no channel: queued; sent in publish order when one opens."""
        h = Harness()
        outs = [h.message() for _ in range(3)]
        await h.publish(*outs)
        assert h.stream.current is None and h.engine.pending == 3
        channel = h.stream.open()
        assert channel.written == ["m1", "m2", "m3"]


class TestLosses:
    async def test_a_lost_channel_republishes_in_the_original_order(self) -> None:
        """Unconfirmed messages of a lost channel go out again, first, in order, once each."""
        h = Harness()
        await h.engine.start()
        first = [h.message() for _ in range(3)]
        await h.publish(*first)
        h.stream.ack(1)
        h.stream.lose()
        later = h.message()
        await h.publish(later)  # admitted while no channel is open
        channel = h.stream.open()
        assert channel.written == ["m2", "m3", "m4"]
        assert h.metrics().republished == {"connection_lost": 2}
        h.stream.ack(3, multiple=True)
        results = await _settled(*first, later)
        assert [r.attempts for r in results if isinstance(r, PublishResult)] == [1, 2, 2, 1]

    async def test_nacks_give_up_after_max_attempts(self) -> None:
        """Each nack republishes (after the backoff) until max_attempts, then PublishGaveUp."""
        h = Harness(max_attempts=3)
        await h.engine.start()
        out = h.message()
        await h.publish(out)
        for tag in (1, 2, 3):
            await _until(lambda tag=tag: len(h.stream.channels[0].written) == tag)
            h.stream.ack(tag, nack=True)
        result = await _outcome(out)
        assert isinstance(result, PublishGaveUp) and result.attempts == 3
        assert h.metrics().nacked == 3 and h.metrics().failed == {"PublishGaveUp": 1}
        assert h.engine.idle and h.engine.in_flight == 0

    async def test_nack_only_channel_is_replaced(self) -> None:
        """Three nacks and no ack for two seconds: the channel is replaced."""
        h = Harness(max_attempts=10)
        await h.engine.start()
        await h.publish(*(h.message() for _ in range(3)))
        h.stream.current.last_ack = -10.0  # type: ignore[union-attr]  # long ago
        h.stream.ack(3, multiple=True, nack=True)
        assert h.stream.replaced == [1]


class TestReturnsAndRefusals:
    async def test_a_return_before_the_ack_is_unroutable(self) -> None:
        h = Harness()
        await h.engine.start()
        out = h.message()
        await h.publish(out)
        h.stream.returned("m1")
        h.stream.ack(1)
        result = await _outcome(out)
        assert isinstance(result, PublishUnroutable) and result.reply_code == 312
        assert h.metrics().returned == 1 and h.metrics().confirmed == 0

    async def test_a_refusal_naming_the_exchange_fails_its_messages_only(self) -> None:
        """A 404 naming exchange X: the messages to X fail, the others go out again."""
        h = Harness()
        await h.engine.start()
        h.exchanges.known.add("x")
        to_x, other = h.message("x"), h.message()
        await h.publish(to_x, other)
        fault = Fault(
            FaultKind.NOT_FOUND, 404, "NOT_FOUND - no exchange 'x'", entity=("exchange", "x")
        )
        h.stream.lose(fault)
        assert isinstance(await _outcome(to_x), ExchangeNotFound)
        assert h.exchanges.forgotten == ["x"]
        channel = h.stream.open()
        assert channel.written == ["m2"]
        h.stream.ack(1)
        assert isinstance(await _outcome(other), PublishResult)

    async def test_an_unnamed_refusal_isolates_the_culprit(self) -> None:
        """The broker refuses one of four without naming it: halves are re-sent alone until
        the refused one is alone; it fails with PublishRefused, the rest are confirmed."""
        h = Harness()
        await h.engine.start()
        outs = [h.message() for _ in range(4)]
        await h.publish(*outs)
        refusal = Fault(FaultKind.REFUSED, 406, "PRECONDITION_FAILED - something")
        culprit = "m3"
        while True:
            channel = h.stream.lose(refusal) if h.stream.current else None
            channel = h.stream.open()
            sent = list(channel.written)
            if not sent:
                break
            if culprit in sent and not outs[2].finished:
                continue  # refused again: the loop loses this channel too
            h.stream.ack(len(sent), multiple=True)
            if all(out.finished for out in outs):
                break
        results = await _settled(*outs)
        assert isinstance(results[2], PublishRefused)
        assert all(isinstance(r, PublishResult) for i, r in enumerate(results) if i != 2)

    async def test_a_missing_exchange_fails_at_admission(self) -> None:
        h = Harness()
        await h.engine.start()
        out = h.message("gone")
        with pytest.raises(ExchangeNotFound):
            await h.publish(out)
        assert h.engine.idle and h.engine.in_flight == 0
        assert h.metrics("gone").failed == {"ExchangeNotFound": 1}


class TestDeadlines:
    async def test_the_sweep_times_out_a_message_past_its_deadline(self) -> None:
        h = Harness()
        await h.engine.start()
        out = h.message(timeout=0.01)
        await h.publish(out)
        await asyncio.sleep(0.02)
        h.engine.tick(asyncio.get_running_loop().time())
        assert isinstance(await _outcome(out), PublishTimeout)
        assert h.engine.in_flight == 1  # still on its channel: its slot waits for the ack
        h.stream.ack(1)
        assert h.engine.in_flight == 0

    async def test_no_channel_for_unavailable_timeout_fails_the_unsent(self) -> None:
        h = Harness(unavailable_timeout=0.01)
        out = h.message()
        await h.publish(out)  # no channel yet
        h.stream.open()
        h.stream.lose()
        await asyncio.sleep(0.02)
        h.engine.tick(asyncio.get_running_loop().time())
        assert h.engine.unavailable
        assert isinstance(await _outcome(out), PublishUnavailable)
        with pytest.raises(PublishUnavailable):
            await h.publish(h.message())
        h.stream.open()
        assert not h.engine.unavailable

    async def test_abort_fails_every_caller_and_frees_the_window(self) -> None:
        """abort(): admitted and waiting callers all get PublishAborted; nothing is held."""
        h = Harness(max_in_flight=1)
        await h.engine.start()
        first, second = h.message(), h.message()
        await h.publish(first)
        waiting = asyncio.ensure_future(h.publish(second))  # waits for the window
        await asyncio.sleep(0)
        assert h.engine.pending == 2
        assert h.engine.abort("test") == 2
        assert isinstance(await _outcome(first), PublishAborted)
        with pytest.raises(PublishAborted):
            await waiting
        assert h.engine.idle and h.engine.in_flight == 0 and h.engine.aborting

    async def test_stopped_engine_needs_no_channel_once_empty(self) -> None:
        """``needed()`` stays true while messages are left, false once closed and empty."""
        h = Harness()
        await h.engine.start()
        out = h.message()
        await h.publish(out)
        h.engine.stop_taking()
        assert h.stream.needed()
        h.stream.ack(1)
        await _outcome(out)
        assert not h.stream.needed()
        await h.engine.close()
        assert h.stream.closed


async def _until(condition: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.001)
