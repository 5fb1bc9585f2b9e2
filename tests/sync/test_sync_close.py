"""BlockingPublisher.close() and interpreter exit settle every caller: what was handed
over is published while the timeout lasts, the rest fails with a typed error and is
logged with its count. Exact counts: confirmed + failed == submitted, and every
confirmed message is in the queue."""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from reliable_mq import (
    ClosedError,
    ConnectionSettings,
    PublisherSettings,
    PublishResult,
    ReliableMQError,
)
from reliable_mq.sync import BlockingPublisher
from reliable_mq.sync._process import EXIT_MARGIN
from tests.support.amqp import drain_queue_sync, run_sync
from tests.support.threaded_proxy import ThreadedProxy

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def squeue(broker_url: str) -> Iterator[str]:
    name = f"test-sync-close-{uuid.uuid4().hex[:12]}"

    async def declare(delete: bool) -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            channel = await connection.channel()
            if delete:
                await channel.queue_delete(name)
            else:
                await channel.declare_queue(name, durable=True)

    run_sync(lambda: declare(False))
    yield name
    run_sync(lambda: declare(True))


def _connection(url: str, **overrides: Any) -> ConnectionSettings:
    name = f"test-sync-close-{uuid.uuid4().hex[:8]}"
    return ConnectionSettings(url=url, connection_name=name, **overrides)


def _tally(futures: list[concurrent.futures.Future[PublishResult]]) -> collections.Counter[str]:
    tally: collections.Counter[str] = collections.Counter()
    for future in futures:
        assert future.done()
        error = future.exception(timeout=0)
        if error is None:
            tally["ok"] += 1
        else:
            assert isinstance(error, ReliableMQError), repr(error)
            tally[type(error).__name__] += 1
    return tally


def _confirmed_ids(futures: list[concurrent.futures.Future[PublishResult]]) -> set[str]:
    return {f.result().message_id for f in futures if f.exception(timeout=0) is None}


class TestClose:
    def test_close_publishes_every_submitted_message(self, broker_url: str, squeue: str) -> None:
        """50 submit()s through a window of 10, then close(10): all 50 confirmed, in the queue."""
        publisher = BlockingPublisher(
            _connection(broker_url),
            settings=PublisherSettings(max_in_flight=10),
            max_pending=100,
        )
        publisher.start()
        futures = [
            publisher.submit(b"x", routing_key=squeue, message_id=f"s-{n}") for n in range(50)
        ]
        publisher.close(timeout=10)
        assert _tally(futures) == {"ok": 50}
        queued = [m.message_id for m in drain_queue_sync(broker_url, squeue)]
        assert sorted(queued) == sorted(_confirmed_ids(futures))  # type: ignore[type-var]

    def test_close_publishes_what_blocked_publish_calls_handed_over(
        self, broker_url: str, squeue: str
    ) -> None:
        """50 threads blocked in publish() (10 slots): close() lets every one of them confirm."""
        publisher = BlockingPublisher(
            _connection(broker_url), settings=PublisherSettings(max_in_flight=10)
        )
        publisher.start()
        outcomes: list[Any] = []
        lock = threading.Lock()
        gate = threading.Barrier(51)

        def publish(n: int) -> None:
            gate.wait()
            try:
                outcome: Any = publisher.publish(b"x", routing_key=squeue, message_id=f"p-{n}")
            except ReliableMQError as exc:
                outcome = exc
            with lock:
                outcomes.append(outcome)

        threads = [threading.Thread(target=publish, args=(n,)) for n in range(50)]
        for thread in threads:
            thread.start()
        gate.wait()
        deadline = time.monotonic() + 30
        while publisher.stats().published < 50 and time.monotonic() < deadline:
            time.sleep(0.001)  # every call handed over to the loop
        publisher.close(timeout=10)
        for thread in threads:
            thread.join(30)
            assert not thread.is_alive()
        kinds = collections.Counter(
            "ok" if isinstance(o, PublishResult) else type(o).__name__ for o in outcomes
        )
        assert sum(kinds.values()) == 50
        assert set(kinds) <= {"ok", "ClosedError"}  # ClosedError: came in after close began
        queued = sorted(str(m.message_id) for m in drain_queue_sync(broker_url, squeue))
        assert queued == sorted(o.message_id for o in outcomes if isinstance(o, PublishResult))
        assert kinds["ok"] == publisher.stats().confirmed

    def test_close_timeout_fails_the_rest_with_a_typed_error_and_logs_the_count(
        self, broker_url: str, squeue: str, caplog: pytest.LogCaptureFixture
    ) -> None:
        with ThreadedProxy(5672) as proxy:
            publisher = BlockingPublisher(
                _connection(proxy.url, heartbeat=0),
                settings=PublisherSettings(max_in_flight=10, confirm_timeout=60),
                max_pending=100,
            )
            publisher.start()
            proxy.set_stall(True)
            futures = [publisher.submit(b"x", routing_key=squeue) for _ in range(40)]
            started = time.monotonic()
            with caplog.at_level("ERROR"):
                publisher.close(timeout=1)
            took = time.monotonic() - started
            proxy.set_stall(False)
        assert 1 <= took < 10, took
        assert _tally(futures) == {"PublishAborted": 40}
        lines = [r.getMessage() for r in caplog.records if "close_aborted" in r.getMessage()]
        assert len(lines) == 1 and "aborted=40" in lines[0], lines

    def test_calls_after_close_are_refused(self, broker_url: str, squeue: str) -> None:
        publisher = BlockingPublisher(_connection(broker_url))
        publisher.start()
        publisher.close()
        with pytest.raises(ClosedError):
            publisher.submit(b"x", routing_key=squeue)


_EXIT_SCRIPT = textwrap.dedent(
    """
    import atexit, collections, json, sys, time
    from reliable_mq import ConnectionSettings, PublisherSettings
    from reliable_mq.sync import BlockingPublisher

    url, queue, count, exit_timeout, in_flight, mode = sys.argv[1:7]
    futures = []

    def report():  # registered first: runs after the publisher's exit hook
        kinds = collections.Counter()
        for future in futures:
            if not future.done():
                kinds["unresolved"] += 1
            elif future.exception() is None:
                kinds["ok"] += 1
            else:
                kinds[type(future.exception()).__name__] += 1
        print(json.dumps(kinds), flush=True)

    atexit.register(report)
    publisher = BlockingPublisher(
        ConnectionSettings(url=url, connection_name="test-sync-exit-count", heartbeat=0),
        settings=PublisherSettings(max_in_flight=int(in_flight), confirm_timeout=120),
        max_pending=int(count) + 1,
        exit_timeout=float(exit_timeout),
    )
    publisher.start()
    print("ready", flush=True)
    sys.stdin.readline()
    if mode == "block":  # a callback that never returns holds the loop thread
        first = publisher.submit(b"x", routing_key=queue, message_id="blocker")
        first.add_done_callback(lambda _: time.sleep(3600))
        futures.append(first)
    for n in range(int(count)):
        futures.append(publisher.submit(b"x", routing_key=queue, message_id=f"exit-{n}"))
    print("submitted", flush=True)
    sys.stdin.readline()
    # no close(): the exit hook publishes what was submitted, or reports what it could not
    """
)


def _exit_run(
    url: str, queue: str, count: int, exit_timeout: float, in_flight: int, mode: str = "plain"
) -> subprocess.Popen[str]:
    args = [url, queue, *map(str, (count, exit_timeout, in_flight)), mode]
    process = subprocess.Popen(
        [sys.executable, "-c", _EXIT_SCRIPT, *args],
        cwd=ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stdin is not None
    assert process.stdout.readline().strip() == "ready"
    return process


def _go(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("go\n")
    process.stdin.flush()
    assert process.stdout.readline().strip() == "submitted"


class TestInterpreterExit:
    @pytest.mark.parametrize(("count", "in_flight"), [(50, 10), (5000, 20)])
    def test_exit_publishes_every_pending_submit(
        self, broker_url: str, squeue: str, count: int, in_flight: int
    ) -> None:
        """Pending submit()s far beyond the window are all confirmed by the exit hook."""
        process = _exit_run(broker_url, squeue, count, 60, in_flight)
        _go(process)
        out, err = process.communicate("exit\n", timeout=120)
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": count}, err[-3000:]
        queued = [m.message_id for m in drain_queue_sync(broker_url, squeue)]
        assert sorted(queued) == sorted(f"exit-{n}" for n in range(count))  # type: ignore[type-var]

    def test_exit_logs_what_it_could_not_send_with_the_count(
        self, broker_url: str, squeue: str
    ) -> None:
        """With the link stalled, the exit hook gives up after exit_timeout: every pending
        future fails with PublishAborted, and an error line says how many."""
        with ThreadedProxy(5672) as proxy:
            process = _exit_run(proxy.url, squeue, 50, 1.0, 10)
            proxy.set_stall(True)
            try:
                _go(process)
                out, err = process.communicate("exit\n", timeout=60)
            finally:
                proxy.set_stall(False)
        assert process.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == {"PublishAborted": 50}, err[-3000:]
        aborted = [line for line in err.splitlines() if "close_aborted" in line]
        assert len(aborted) == 1 and "aborted=50" in aborted[0], err[-3000:]

    def test_exit_fails_and_logs_what_a_blocked_loop_thread_holds(
        self, broker_url: str, squeue: str
    ) -> None:
        """A future callback that never returns blocks the loop thread: the exit hook
        gives up after exit_timeout + EXIT_MARGIN, and every future it could not settle
        fails with PublishAborted, counted in one error line (taken by the loop and
        unsettled: ``aborted``; never taken: ``never_sent``)."""
        process = _exit_run(broker_url, squeue, 20, 1.0, 10, "block")
        _go(process)
        started = time.monotonic()
        out, err = process.communicate("exit\n", timeout=60)
        took = time.monotonic() - started
        assert process.returncode == 0, err[-3000:]
        assert took < 1.0 + EXIT_MARGIN + 5, took
        assert json.loads(out.strip().splitlines()[-1]) == {"ok": 1, "PublishAborted": 20}
        [unsent] = [line for line in err.splitlines() if "close_unsent" in line]
        counts = dict(re.findall(r"(aborted|never_sent)=(\d+)", unsent))
        assert int(counts["aborted"]) + int(counts["never_sent"]) == 20, unsent
