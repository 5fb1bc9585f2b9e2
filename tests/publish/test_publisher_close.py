"""ReliablePublisher.close() settles every caller: what was handed over is published
while the timeout lasts, the rest fails with a typed error, and nothing waits forever
(nor on I/O that is already gone)."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import (
    BrokerUnavailable,
    ClosedError,
    ConnectionSettings,
    Message,
    PublishAborted,
    PublishBatchError,
    PublishError,
    PublisherSettings,
    PublisherState,
    PublishResult,
    PublishTimeout,
    ReliableMQError,
    ReliablePublisher,
)
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.support.amqp import drain_queue
from tests.support.threaded_proxy import ThreadedProxy
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq


def _conn(url: str, **overrides: Any) -> ConnectionSettings:
    values: dict[str, Any] = {
        "url": url,
        "connection_name": f"test-close-{uuid.uuid4().hex[:8]}",
        "reconnect_initial_delay": 0.05,
        "reconnect_max_delay": 0.5,
        "connect_timeout": 5,
    }
    values.update(overrides)
    return ConnectionSettings(**values)


def _settings(**overrides: Any) -> PublisherSettings:
    values: dict[str, Any] = {"max_in_flight": 10, "publish_timeout": 60}
    values.update(overrides)
    return PublisherSettings(**values)


def _tally(outcomes: list[Any]) -> collections.Counter[str]:
    """``ok`` for a confirm, else the error's class name (each must be a typed error)."""
    tally: collections.Counter[str] = collections.Counter()
    for outcome in outcomes:
        if isinstance(outcome, PublishResult):
            tally["ok"] += 1
        else:
            assert isinstance(outcome, ReliableMQError), repr(outcome)
            tally[type(outcome).__name__] += 1
    return tally


async def _outcome(coro: Any) -> Any:
    try:
        return await coro
    except ReliableMQError as exc:
        return exc


class TestCloseWaitsForEveryCaller:
    """On a healthy broker, close(timeout) publishes what callers handed over, slots or not."""

    async def test_publish_callers_waiting_for_a_slot_are_published(
        self, broker_url: str, queue: str
    ) -> None:
        publisher = ReliablePublisher(
            _conn(broker_url), settings=_settings(), registry=CollectorRegistry()
        )
        await publisher.start()
        ids = [f"w-{n}" for n in range(50)]
        tasks = [
            asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue, message_id=i)))
            for i in ids
        ]
        await asyncio.sleep(0)  # each caller ran: 10 hold a slot, 40 wait for one
        assert publisher.in_flight == 10
        await publisher.close(timeout=10)
        assert all(task.done() for task in tasks)  # no caller is left waiting
        outcomes = [task.result() for task in tasks]
        assert _tally(outcomes) == {"ok": 50}
        assert sorted(
            m.message_id for m in await drain_queue(broker_url, queue, settled=True)
        ) == sorted(ids)

    async def test_enqueue_callbacks_and_batches_waiting_for_slots_are_published(
        self, broker_url: str, queue: str
    ) -> None:
        """Every entry point at once: enqueue(), publish_with_callback(), publish_many()."""
        publisher = ReliablePublisher(
            _conn(broker_url), settings=_settings(), registry=CollectorRegistry()
        )
        await publisher.start()
        called: list[Any] = []
        for n in range(30):
            publisher.publish_with_callback(
                lambda result, error: called.append(result or error),
                b"c",
                routing_key=queue,
                message_id=f"c-{n}",
            )
        enqueued = [
            asyncio.create_task(publisher.enqueue(b"e", routing_key=queue, message_id=f"e-{n}"))
            for n in range(30)
        ]
        batch = asyncio.create_task(
            publisher.publish_many(
                [Message(b"b", routing_key=queue, message_id=f"b-{n}") for n in range(30)]
            )
        )
        await asyncio.sleep(0)
        assert publisher.in_flight == 10
        await publisher.close(timeout=20)
        assert len(called) == 30 and _tally(called) == {"ok": 30}
        pending = [task.result() for task in enqueued]  # each enqueue() returned
        assert all(p.done() for p in pending)
        assert _tally([await _outcome(p) for p in pending]) == {"ok": 30}
        assert batch.done() and batch.result().confirmed == 30
        drained = [m.message_id for m in await drain_queue(broker_url, queue, settled=True)]
        assert len(drained) == 90 and len(set(drained)) == 90

    async def test_a_second_close_waits_for_the_first(self, broker_url: str, queue: str) -> None:
        publisher = ReliablePublisher(
            _conn(broker_url), settings=_settings(), registry=CollectorRegistry()
        )
        await publisher.start()
        tasks = [
            asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue)))
            for _ in range(40)
        ]
        await asyncio.sleep(0)
        assert publisher.in_flight == 10
        first = asyncio.create_task(publisher.close(timeout=10))
        await asyncio.sleep(0)
        await publisher.close(timeout=10)
        assert all(task.done() for task in tasks)
        assert _tally([task.result() for task in tasks]) == {"ok": 40}
        await first

    async def test_new_calls_after_close_began_are_refused(
        self, broker_url: str, queue: str
    ) -> None:
        publisher = ReliablePublisher(
            _conn(broker_url), settings=_settings(), registry=CollectorRegistry()
        )
        await publisher.start()
        tasks = [
            asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue)))
            for _ in range(20)
        ]
        await asyncio.sleep(0)
        assert publisher.in_flight == 10
        closing = asyncio.create_task(publisher.close(timeout=10))
        await asyncio.sleep(0)
        with pytest.raises(ClosedError):
            await publisher.publish(b"late", routing_key=queue)
        called: list[Any] = []
        publisher.publish_with_callback(
            lambda result, error: called.append(error), b"late", routing_key=queue
        )
        assert len(called) == 1 and isinstance(called[0], ClosedError)
        await closing
        assert _tally([task.result() for task in tasks]) == {"ok": 20}


class TestCloseTimeout:
    """Past the timeout, every caller still waiting fails with PublishAborted."""

    async def test_every_caller_is_aborted_when_the_link_is_stalled(
        self, proxy: TCPProxy, queue: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        publisher = ReliablePublisher(
            _conn(proxied_url(proxy), heartbeat=0),
            settings=_settings(confirm_timeout=60),
            registry=CollectorRegistry(),
        )
        await publisher.start()
        proxy.set_stall(True)
        called: list[Any] = []
        tasks = [
            asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue)))
            for _ in range(30)
        ]
        for _ in range(20):
            publisher.publish_with_callback(
                lambda result, error: called.append(result or error), b"c", routing_key=queue
            )
        messages = [Message(b"b", routing_key=queue) for _ in range(20)]
        batching = [asyncio.create_task(_outcome(publisher.publish_many(messages)))]
        await asyncio.sleep(0.1)  # every caller ran: 10 hold a slot, the rest wait
        assert publisher.in_flight == 10
        started = time.monotonic()
        with caplog.at_level("ERROR", logger="reliable_mq.publisher"):
            await publisher.close(timeout=1.0)
        took = time.monotonic() - started
        assert 1.0 <= took < 10, took
        await asyncio.sleep(0)
        assert all(task.done() for task in tasks)
        assert _tally([task.result() for task in tasks]) == {"PublishAborted": 30}
        assert _tally(called) == {"PublishAborted": 20}
        failed = await batching[0]
        assert isinstance(failed, PublishBatchError)
        result = failed.result  # its first message waited for a slot; the next one met
        assert result.stopped_early and result.confirmed == 0  # the closed publisher
        assert [type(f.error) for f in result.failures] == [PublishAborted, ClosedError]
        [line] = [r.getMessage() for r in caplog.records if "close_aborted" in r.getMessage()]
        assert "aborted=51" in line, line
        proxy.set_stall(False)

    async def test_a_deadline_resolves_its_call_while_close_waits(
        self, proxy: TCPProxy, queue: str
    ) -> None:
        """A caller waiting for a slot gets PublishTimeout at its own deadline, close or not."""
        publisher = ReliablePublisher(
            _conn(proxied_url(proxy), heartbeat=0),
            settings=_settings(max_in_flight=2, confirm_timeout=60),
            registry=CollectorRegistry(),
        )
        await publisher.start()
        proxy.set_stall(True)
        held = [asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue)))]
        held.append(asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue))))
        await wait_until(lambda: publisher.in_flight == 2)
        short = asyncio.create_task(_outcome(publisher.publish(b"s", routing_key=queue, timeout=1)))
        await asyncio.sleep(0.05)
        closing = asyncio.create_task(publisher.close(timeout=30))
        started = time.monotonic()
        outcome = await asyncio.wait_for(short, 10)
        assert isinstance(outcome, PublishTimeout)
        assert time.monotonic() - started < 5
        assert not closing.done()  # the others still had time: close kept waiting
        proxy.set_stall(False)
        await closing
        assert _tally([task.result() for task in held]) == {"ok": 2}


def _run_loop_torn_down_by_system_exit(
    url: str, queue: str, stall: Callable[[], None], report: dict[str, Any]
) -> None:
    """asyncio.run() whose loop is torn down by a SystemExit from another task, as a
    handler's ``sys.exit()`` does in a worker: every task is cancelled (the publisher's
    I/O included), then the main task's ``finally`` closes the publisher."""

    async def main() -> None:
        publisher = ReliablePublisher(
            _conn(url, heartbeat=0),
            settings=_settings(confirm_timeout=60, close_timeout=30),
            registry=CollectorRegistry(),
        )
        await publisher.start()
        stall()  # from now on no confirm can come but from a link that is gone
        pending = [await publisher.enqueue(b"x", routing_key=queue) for _ in range(5)]
        report["pending"] = pending
        called: list[Any] = []
        for _ in range(10):
            publisher.publish_with_callback(
                lambda result, error: called.append(result or error), b"c", routing_key=queue
            )
        report["called"] = called

        async def exit_soon() -> None:
            await asyncio.sleep(0.2)
            raise SystemExit(3)

        asyncio.get_running_loop().create_task(exit_soon())
        try:
            await asyncio.sleep(3600)
        finally:
            started = time.monotonic()
            try:
                await publisher.close()
            finally:
                report["close_took"] = time.monotonic() - started

    try:
        asyncio.run(main())
    except SystemExit as exc:
        report["exit"] = exc.code


class TestStartFails:
    async def test_a_call_made_while_start_fails_gets_an_outcome(self, queue: str) -> None:
        """publish() while start() is connecting, and the connection fails: the call ends
        with PublishAborted (it waited for a channel that will never open), and the
        publisher is closed."""
        refusing = TCPProxy("127.0.0.1", 5672)
        await refusing.start()
        refusing.set_refuse(True)
        try:
            publisher = ReliablePublisher(
                _conn(proxied_url(refusing), connect_timeout=1),
                settings=_settings(),
                registry=CollectorRegistry(),
            )
            early = asyncio.create_task(_outcome(publisher.publish(b"x", routing_key=queue)))
            with pytest.raises(BrokerUnavailable):
                await publisher.start()
            assert isinstance(await asyncio.wait_for(early, 5), PublishAborted)
            assert publisher.state is PublisherState.CLOSED
            with pytest.raises(ClosedError):
                await publisher.start()
            await publisher.close()
        finally:
            await refusing.close()


class TestIoGone:
    def test_close_does_not_wait_on_io_the_loop_already_cancelled(self, queue: str) -> None:
        """The loop's teardown cancels the publisher's tasks: close() returns at once and
        every message in flight ends with PublishAborted (the confirm can never come)."""
        report: dict[str, Any] = {}
        with ThreadedProxy(5672) as proxy:
            thread = threading.Thread(
                target=_run_loop_torn_down_by_system_exit,
                args=(proxy.url, queue, lambda: proxy.set_stall(True), report),
                daemon=True,
            )
            thread.start()
            thread.join(60)
            proxy.set_stall(False)
        assert not thread.is_alive()
        assert report["exit"] == 3
        assert report["close_took"] < 5, report["close_took"]
        for pending in report["pending"]:
            assert pending.done()
            with pytest.raises(PublishAborted):
                pending.result()
        assert _tally(report["called"]) == {"PublishAborted": 10}

    async def test_publish_after_the_io_is_gone_fails_at_once(
        self, broker_url: str, queue: str
    ) -> None:
        """Once the publisher's I/O tasks are cancelled from outside, new calls are refused
        (ClosedError) instead of queueing for a channel that will never open."""
        connection = _conn(broker_url)
        publisher = ReliablePublisher(
            connection, settings=_settings(), registry=CollectorRegistry()
        )
        await publisher.start()
        await publisher.publish(b"x", routing_key=queue)
        for task in asyncio.all_tasks():
            if task.get_name().startswith(f"reliable_mq:{connection.connection_name}.publisher"):
                task.cancel()
        await asyncio.sleep(0.1)
        with pytest.raises((ClosedError, PublishError)):
            await asyncio.wait_for(publisher.publish(b"x", routing_key=queue, timeout=30), 5)
        started = time.monotonic()
        await publisher.close(timeout=30)
        assert time.monotonic() - started < 6
