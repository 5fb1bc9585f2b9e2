"""BlockingPublisher against the real broker: results, errors, hostile input, exit."""

from __future__ import annotations

import concurrent.futures
import math
import os
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from reliable_mq import (
    BrokerUnavailable,
    ClosedError,
    ConnectionSettings,
    ExchangeNotFound,
    InvalidBody,
    InvalidMessage,
    InvalidSettings,
    Message,
    PublishBatchError,
    PublisherSettings,
    PublisherState,
    PublishResult,
    PublishTimeout,
    PublishUnroutable,
    WouldDeadlock,
)
from reliable_mq.sync import BlockingPublisher
from reliable_mq.sync._process import EXIT_MARGIN
from tests.support.amqp import drain_queue_sync, run_sync
from tests.support.private_node import free_port
from tests.support.threaded_proxy import ThreadedProxy

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]


def _declare(url: str, name: str, *, delete: bool = False) -> None:
    async def go() -> None:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            if delete:
                await channel.queue_delete(name)
            else:
                await channel.declare_queue(name, durable=True)

    run_sync(go)


@pytest.fixture
def squeue(broker_url: str) -> Iterator[str]:
    """A fresh durable queue (for plain, non-async tests), deleted afterwards."""
    name = f"test-sync-{uuid.uuid4().hex[:12]}"
    _declare(broker_url, name)
    yield name
    _declare(broker_url, name, delete=True)


def _settings(**overrides: object) -> PublisherSettings:
    return PublisherSettings(**overrides)  # type: ignore[arg-type]


def _connection(url: str, **overrides: object) -> ConnectionSettings:
    name = f"test-sync-{uuid.uuid4().hex[:8]}"
    return ConnectionSettings(url=url, connection_name=name, **overrides)  # type: ignore[arg-type]


@pytest.fixture
def publisher(broker_url: str) -> Iterator[BlockingPublisher]:
    with BlockingPublisher(_connection(broker_url)) as running:
        yield running


def _ids(url: str, queue: str, *, settled: bool = False) -> list[str | None]:
    """Drained ids; ``settled``: every publish to the queue has returned, confirmed or failed."""
    return [message.message_id for message in drain_queue_sync(url, queue, settled=settled)]


class TestPublish:
    def test_publish_blocks_until_confirmed(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        """publish() returns the confirm's result, and the message is in the queue."""
        result = publisher.publish({"n": 1}, routing_key=squeue, message_id="m-1")
        assert isinstance(result, PublishResult)
        assert (result.message_id, result.attempts) == ("m-1", 1)
        drained = drain_queue_sync(broker_url, squeue, settled=True)
        assert [(m.message_id, m.body) for m in drained] == [("m-1", b'{"n":1}')]

    def test_submit_returns_a_future(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        """submit() returns a concurrent future that ends with the result."""
        futures = [publisher.submit(b"x", routing_key=squeue) for _ in range(200)]
        results = [f.result(timeout=60) for f in futures]
        assert all(isinstance(r, PublishResult) for r in results)
        ids = _ids(broker_url, squeue, settled=True)
        assert sorted(ids) == sorted(r.message_id for r in results)  # type: ignore[type-var]

    def test_flush_waits_for_submitted_messages(
        self, publisher: BlockingPublisher, squeue: str
    ) -> None:
        futures = [publisher.submit(b"x", routing_key=squeue) for _ in range(300)]
        publisher.flush(timeout=60)
        assert all(f.done() for f in futures)

    def test_same_typed_errors_as_async(self, publisher: BlockingPublisher) -> None:
        """Unroutable and missing-exchange publishes raise the async publisher's errors."""
        with pytest.raises(PublishUnroutable):
            publisher.publish(b"x", routing_key=f"nowhere-{uuid.uuid4().hex}")
        with pytest.raises(ExchangeNotFound):
            publisher.publish(b"x", routing_key="k", exchange=f"missing-{uuid.uuid4().hex}")
        with pytest.raises(InvalidBody):
            publisher.publish(object(), routing_key="k")
        future = publisher.submit(b"x", routing_key=f"nowhere-{uuid.uuid4().hex}")
        assert isinstance(future.exception(timeout=60), PublishUnroutable)
        assert publisher.publish(b"still fine", routing_key="", mandatory=False).attempts == 1


class TestPublishMany:
    def test_a_generator_is_published_in_full(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        """Every message of a long generator is confirmed and lands, in order."""
        count = 3000
        messages = (Message(b"m", routing_key=squeue, message_id=f"b-{i}") for i in range(count))
        result = publisher.publish_many(messages)
        assert (result.taken, result.confirmed, result.failures) == (count, count, ())
        assert _ids(broker_url, squeue) == [f"b-{i}" for i in range(count)]

    def test_failures_are_recorded_and_the_rest_go_on(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        nowhere = f"nowhere-{uuid.uuid4().hex}"
        messages = [
            Message(b"ok", routing_key=squeue, message_id="ok-0"),
            Message(b"lost", routing_key=nowhere, message_id="bad-1"),
            Message(b"ok", routing_key=squeue, message_id="ok-2"),
        ]
        with pytest.raises(PublishBatchError) as caught:
            publisher.publish_many(messages)
        result = caught.value.result
        assert (result.taken, result.confirmed) == (3, 2)
        assert [(f.index, f.message_id) for f in result.failures] == [(1, "bad-1")]
        assert isinstance(result.failures[0].error, PublishUnroutable)
        assert publisher.publish_many(messages, raise_on_error=False).confirmed == 2
        assert sorted(_ids(broker_url, squeue, settled=True)) == ["ok-0", "ok-0", "ok-2", "ok-2"]  # type: ignore[type-var]

    def test_an_item_that_is_not_a_message_is_a_failure(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        """As in the async publish_many: recorded with its index, the others go on."""
        items: list[object] = [
            Message(b"m", routing_key=squeue, message_id=f"i-{i}") for i in range(5)
        ]
        items.append({"body": b"m"})
        items.append(Message(b"m", routing_key=squeue, message_id="i-6"))
        with pytest.raises(PublishBatchError) as caught:
            publisher.publish_many(items)  # type: ignore[arg-type]
        result = caught.value.result
        assert (result.taken, result.confirmed) == (7, 6)
        assert [f.index for f in result.failures] == [5]
        assert isinstance(result.failures[0].error, InvalidMessage)
        assert _ids(broker_url, squeue, settled=True) == [*(f"i-{i}" for i in range(5)), "i-6"]

    def test_max_failures_stops_taking_messages(self, publisher: BlockingPublisher) -> None:
        """The stream stops early, the caller learns where; an empty stream is fine too."""
        nowhere = f"nowhere-{uuid.uuid4().hex}"
        messages = (Message(b"m", routing_key=nowhere) for _ in range(100_000))
        result = publisher.publish_many(messages, max_failures=5, raise_on_error=False)
        assert result.stopped_early and len(result.failures) >= 5
        assert result.taken < 100_000 and result.confirmed == 0
        assert publisher.publish_many([]).taken == 0

    def test_an_error_from_the_iterable_is_raised_after_the_rest(
        self, publisher: BlockingPublisher, broker_url: str, squeue: str
    ) -> None:
        def broken() -> Iterator[Message]:
            for i in range(700):
                yield Message(b"m", routing_key=squeue, message_id=f"g-{i}")
            raise OSError("source went away")

        with pytest.raises(OSError, match="source went away"):
            publisher.publish_many(broken())
        assert _ids(broker_url, squeue) == [f"g-{i}" for i in range(700)]


class TestHostileInput:
    @pytest.mark.parametrize("timeout", [math.nan, math.inf, -1.0, 0, "5", True, []])
    def test_bad_timeouts_are_refused(self, publisher: BlockingPublisher, timeout: object) -> None:
        with pytest.raises(InvalidMessage, match="timeout"):
            publisher.publish(b"x", routing_key="k", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(InvalidMessage, match="timeout"):
            publisher.submit(b"x", routing_key="k", timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(InvalidMessage, match="timeout"):
            publisher.publish_many([], timeout=timeout)  # type: ignore[arg-type]

    @pytest.mark.parametrize("field", ["routing_key", "exchange"])
    @pytest.mark.parametrize("value", [None, 7, b"bytes"])
    def test_names_must_be_str(
        self, publisher: BlockingPublisher, field: str, value: object
    ) -> None:
        kwargs: dict[str, object] = {"routing_key": "k", field: value}
        with pytest.raises(InvalidMessage, match=f"{field} must be a str"):
            publisher.publish(b"x", **kwargs)  # type: ignore[arg-type]

    @pytest.mark.parametrize("messages", ["abc", b"abc", {"a": 1}, 5, None])
    def test_publish_many_wants_an_iterable_of_messages(
        self, publisher: BlockingPublisher, messages: object
    ) -> None:
        with pytest.raises(InvalidMessage, match="iterable of Message"):
            publisher.publish_many(messages)  # type: ignore[arg-type]

    def test_publish_many_refuses_async_iterables_and_bad_max_failures(
        self, publisher: BlockingPublisher
    ) -> None:
        async def agen() -> object:
            yield Message(b"x", routing_key="k")

        with pytest.raises(InvalidMessage, match="iterable of Message"):
            publisher.publish_many(agen())  # type: ignore[arg-type]
        for bad in (0, -1, 1.5, "3", True):
            with pytest.raises(InvalidSettings, match="max_failures"):
                publisher.publish_many([], max_failures=bad)  # type: ignore[arg-type]

    @pytest.mark.parametrize(
        "kwargs",
        [
            {"max_pending": 0},
            {"max_pending": 2.5},
            {"max_pending": True},
            {"exit_timeout": math.nan},
            {"exit_timeout": -1},
            {"exit_timeout": "1"},
        ],
    )
    def test_bad_constructor_arguments(self, kwargs: dict[str, object]) -> None:
        with pytest.raises(InvalidSettings):
            BlockingPublisher("amqp://guest:guest@127.0.0.1/", **kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidSettings):
            BlockingPublisher(12345)  # type: ignore[arg-type]

    def test_blocking_calls_from_the_loop_thread_raise_instead_of_hanging(
        self, publisher: BlockingPublisher, squeue: str
    ) -> None:
        """A future callback runs on the loop thread: blocking there would deadlock."""
        seen: list[BaseException] = []
        calls = {
            "publish": lambda: publisher.publish(b"x", routing_key=squeue),
            "submit": lambda: publisher.submit(b"x", routing_key=squeue),
            "publish_many": lambda: publisher.publish_many([]),
            "flush": publisher.flush,
            "close": publisher.close,
            "start": publisher.start,
        }
        here = threading.current_thread()
        ran = threading.Event()

        def callback(_: object) -> None:
            try:
                if threading.current_thread() is not here:  # the loop thread
                    for call in calls.values():
                        try:
                            call()
                        except WouldDeadlock as exc:
                            seen.append(exc)
            finally:
                ran.set()

        for _ in range(20):
            ran.clear()
            # if the confirm beat add_done_callback, the callback runs here: try again
            publisher.submit(b"x", routing_key=squeue).add_done_callback(callback)
            assert ran.wait(60)
            if seen:
                break
        assert len(seen) == len(calls)
        assert publisher.state is PublisherState.OPEN
        assert publisher.publish(b"after", routing_key=squeue).attempts == 1


class TestLifeCycle:
    def test_use_after_close_raises_closed(self, broker_url: str, squeue: str) -> None:
        publisher = BlockingPublisher(_connection(broker_url))
        assert publisher.state is PublisherState.IDLE
        publisher.publish(b"x", routing_key=squeue)  # connects on first use
        assert publisher.state is PublisherState.OPEN
        publisher.close()
        publisher.close()  # twice is fine
        assert publisher.state is PublisherState.CLOSED
        assert publisher.stats().confirmed == 1  # the counters outlive the connection
        with pytest.raises(ClosedError):
            publisher.publish(b"x", routing_key=squeue)
        with pytest.raises(ClosedError):
            publisher.submit(b"x", routing_key=squeue)
        with pytest.raises(ClosedError):
            publisher.start()

    def test_close_from_many_threads_while_publishing(self, broker_url: str, squeue: str) -> None:
        """Concurrent publishers and closers: every call ends, with a result or ClosedError."""
        publisher = BlockingPublisher(_connection(broker_url))
        publisher.start()
        outcomes: list[str] = []
        lock = threading.Lock()

        def publish_loop() -> None:
            for _ in range(200):
                try:
                    publisher.publish(b"x", routing_key=squeue, timeout=30)
                    outcome = "ok"
                except ClosedError:
                    outcome = "closed"
                with lock:
                    outcomes.append(outcome)
                if outcome == "closed":
                    return

        workers = [threading.Thread(target=publish_loop) for _ in range(4)]
        for worker in workers:
            worker.start()
        time.sleep(0.2)
        closers = [threading.Thread(target=publisher.close) for _ in range(3)]
        for closer in closers:
            closer.start()
        for thread in workers + closers:
            thread.join(60)
            assert not thread.is_alive()
        assert publisher.state is PublisherState.CLOSED
        confirmed = outcomes.count("ok")
        assert len(_ids(broker_url, squeue)) >= confirmed

    def test_unreachable_broker_raises_and_a_later_call_retries(self) -> None:
        """start() fails fast with BrokerUnavailable; the publisher is not stuck closed."""
        url = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
        publisher = BlockingPublisher(_connection(url, connect_timeout=2))
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable):
            publisher.start()
        assert time.monotonic() - started < 30
        assert publisher.state is PublisherState.IDLE
        with pytest.raises(BrokerUnavailable):
            publisher.publish(b"x", routing_key="k")
        publisher.close()

    def test_backpressure_bounds_pending_messages(self, broker_url: str, squeue: str) -> None:
        """Past max_pending, submit() waits, then times out; the accepted ones still land."""
        with ThreadedProxy(5672) as proxy:
            publisher = BlockingPublisher(_connection(proxy.url), max_pending=5)
            with publisher:
                publisher.publish(b"warm", routing_key=squeue)
                proxy.set_stall(True)
                futures = [publisher.submit(b"x", routing_key=squeue) for _ in range(5)]
                with pytest.raises(PublishTimeout) as caught:
                    publisher.submit(b"x", routing_key=squeue, timeout=0.5, message_id="late")
                assert (caught.value.message_id, caught.value.attempts) == ("late", 0)
                proxy.set_stall(False)
                for future in concurrent.futures.as_completed(futures, timeout=60):
                    assert future.result().attempts >= 1
        assert len(_ids(broker_url, squeue)) == 6


_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, gc, sys, time
    from reliable_mq import ConnectionSettings
    from reliable_mq.sync import BlockingPublisher

    url, queue, count, exit_timeout, mode = sys.argv[1:6]
    if mode == "hang":  # a close that never ends by itself
        import asyncio
        from reliable_mq.sync._runtime import Runtime

        async def never(self, wait):
            await asyncio.sleep(3600)

        Runtime.close = never
    # atexit runs hooks last-in first-out: these two bracket the publisher's hook.
    atexit.register(lambda: print("closed", time.monotonic(), flush=True))
    publisher = BlockingPublisher(
        ConnectionSettings(url=url, connection_name="test-sync-exit"),
        exit_timeout=float(exit_timeout),
    )
    atexit.register(lambda: print("closing", time.monotonic(), flush=True))
    publisher.publish(b"first", routing_key=queue, message_id="first")
    print("ready", flush=True)
    sys.stdin.readline()
    for n in range(int(count)):
        publisher.submit(b"x", routing_key=queue, message_id=f"exit-{n}")
    if mode == "drop":  # the last reference goes, unclosed
        import weakref

        ref = weakref.ref(publisher)
        del publisher
        gc.collect()
        print("dropped", ref() is None, flush=True)
    # no close(): the atexit hook must flush what was submitted, or give up in time
    """
)


def _run_exit_script(
    url: str, queue: str, count: int, exit_timeout: float, mode: str = "plain"
) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT, url, queue, str(count), str(exit_timeout), mode],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(process: subprocess.Popen[str], timeout: float) -> tuple[str, str]:
    """Wait for the script, then read all its output (with what ``readline`` buffered)."""
    assert process.stdin is not None and process.stdout is not None and process.stderr is not None
    process.stdin.close()
    try:
        process.wait(timeout)
    finally:
        process.kill()
    return process.stdout.read(), process.stderr.read()


def _close_seconds(out: str) -> float:
    """How long the at-exit close took, from the bracketing hooks' timestamps."""
    times = dict(line.split() for line in out.splitlines() if line.startswith("clos"))
    return float(times["closed"]) - float(times["closing"])


class TestInterpreterExit:
    def test_exit_flushes_submitted_messages(self, broker_url: str, squeue: str) -> None:
        process = _run_exit_script(broker_url, squeue, 500, 30)
        _out, err = process.communicate("go\n", timeout=120)
        assert process.returncode == 0, err[-3000:]
        assert sorted(_ids(broker_url, squeue)) == sorted(  # type: ignore[type-var]
            ["first", *(f"exit-{n}" for n in range(500))]
        )

    def test_a_dropped_unclosed_publisher_is_flushed_at_exit(
        self, broker_url: str, squeue: str
    ) -> None:
        """Submit, drop the last reference, exit: every message is confirmed.

        The link is stalled while the script submits and exits, so no confirm can
        arrive before the exit hook runs: the hook must find the publisher and wait.
        """
        with ThreadedProxy(5672) as proxy:
            process = _run_exit_script(proxy.url, squeue, 500, 30, "drop")
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline().strip() == "ready"
            proxy.set_stall(True)
            process.stdin.write("go\n")
            process.stdin.flush()
            closing = ""
            try:
                assert process.stdout.readline().startswith("dropped")
                # Waited for, not assumed after a fixed second: the exit hooks began.
                closing = process.stdout.readline()
                assert closing.startswith("closing"), closing
                time.sleep(1.0)  # the publisher's hook waits on the stalled link meanwhile
            finally:
                proxy.set_stall(False)
            out, err = _finish(process, 120)
        assert process.returncode == 0, err[-3000:]
        assert sorted(_ids(broker_url, squeue)) == sorted(  # type: ignore[type-var]
            ["first", *(f"exit-{n}" for n in range(500))]
        )
        assert _close_seconds(closing + out) >= 0.9  # the exit hook waited for the confirms

    @pytest.mark.parametrize("mode", ["plain", "hang"])
    def test_exit_does_not_hang_on_a_stalled_link(
        self, broker_url: str, squeue: str, mode: str
    ) -> None:
        """With the link stalled (or a close that never ends), the at-exit close takes
        at most exit_timeout + EXIT_MARGIN seconds, and the process exits."""
        exit_timeout = 1.0
        with ThreadedProxy(5672) as proxy:
            process = _run_exit_script(proxy.url, squeue, 10, exit_timeout, mode)
            assert process.stdout is not None and process.stdin is not None
            assert process.stdout.readline().strip() == "ready"
            proxy.set_stall(True)
            process.stdin.write("go\n")
            process.stdin.flush()
            try:
                out, err = _finish(process, 60)
            finally:
                proxy.set_stall(False)
        assert process.returncode == 0, err[-3000:]
        took = _close_seconds(out)
        assert exit_timeout <= took <= exit_timeout + EXIT_MARGIN, (took, err[-3000:])


def test_env_settings_are_used(monkeypatch: pytest.MonkeyPatch, broker_url: str) -> None:
    """With no arguments, the publisher reads RELIABLE_MQ_* like the async one."""
    monkeypatch.setenv("RELIABLE_MQ_URL", broker_url)
    monkeypatch.setenv("RELIABLE_MQ_CONNECTION_NAME", "from-env")
    monkeypatch.setenv("RELIABLE_MQ_PUBLISHER_MAX_IN_FLIGHT", "7")
    publisher = BlockingPublisher()
    assert publisher.connection_name == "from-env.publisher"
    assert publisher.settings.max_in_flight == 7
    assert os.environ["RELIABLE_MQ_URL"] == broker_url
    publisher.close()
