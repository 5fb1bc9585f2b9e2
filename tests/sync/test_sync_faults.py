"""Proof for the blocking publisher: many threads through a cut link, and fork safety."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from reliable_mq import ConnectionSettings, PublisherSettings, PublishResult
from reliable_mq.sync import BlockingPublisher
from tests.support.amqp import drain_queue_sync
from tests.support.threaded_proxy import ThreadedProxy
from tests.sync.test_sync_publisher import _declare

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]
THREADS = 8
TOTAL = 10_000


@pytest.fixture
def squeue(broker_url: str) -> Iterator[str]:
    name = f"test-sync-faults-{uuid.uuid4().hex[:12]}"
    _declare(broker_url, name)
    yield name
    _declare(broker_url, name, delete=True)


class TestThreadsThroughACut:
    def test_eight_threads_ten_thousand_messages_none_lost(
        self, broker_url: str, squeue: str
    ) -> None:
        """8 threads share one publisher; the link is cut halfway; every id is confirmed and queued."""
        confirmed = 0
        halfway = threading.Event()
        lock = threading.Lock()
        failures: list[BaseException] = []

        def count(_: object) -> None:
            nonlocal confirmed
            with lock:
                confirmed += 1
                if confirmed >= TOTAL // 2:
                    halfway.set()

        def worker(index: int, publisher: BlockingPublisher) -> None:
            ids = [f"t{index}-{n}" for n in range(TOTAL // THREADS)]
            try:
                for start in range(0, len(ids), 125):
                    futures = []
                    for n, message_id in enumerate(ids[start : start + 125]):
                        if n % 5 == 0:  # one in five blocks for its own confirm
                            result = publisher.publish(
                                b"m", routing_key=squeue, message_id=message_id
                            )
                            assert isinstance(result, PublishResult)
                            count(None)
                        else:
                            future = publisher.submit(
                                b"m", routing_key=squeue, message_id=message_id
                            )
                            future.add_done_callback(count)
                            futures.append(future)
                    for future in futures:
                        assert isinstance(future.result(timeout=120), PublishResult)
            except BaseException as exc:
                failures.append(exc)
                raise

        with ThreadedProxy(5672) as proxy:
            connection = ConnectionSettings(
                url=proxy.url, connection_name=f"test-sync-cut-{uuid.uuid4().hex[:6]}"
            )  # type: ignore[arg-type]
            settings = PublisherSettings(persistent=False, publish_timeout=120)
            with BlockingPublisher(connection, settings=settings) as publisher:
                with concurrent.futures.ThreadPoolExecutor(THREADS) as pool:
                    jobs = [pool.submit(worker, i, publisher) for i in range(THREADS)]
                    assert halfway.wait(120), "half the messages were never confirmed"
                    with lock:
                        confirmed_at_cut = confirmed
                    assert proxy.cut() >= 1
                    for job in jobs:
                        job.result(timeout=180)
                stats = publisher.stats()
            assert proxy.proxy.connections_total >= 2  # it reconnected after the cut
        assert not failures
        assert confirmed_at_cut < TOTAL and confirmed == TOTAL
        assert stats.confirmed == TOTAL and stats.failed == 0
        drained = {m.message_id for m in drain_queue_sync(broker_url, squeue)}
        expected = {f"t{i}-{n}" for i in range(THREADS) for n in range(TOTAL // THREADS)}
        assert expected - drained == set()  # none lost (a republish may duplicate)
        assert drained - expected == set()


def _connections(prefix: str) -> dict[str, str]:
    """connection_name -> the broker's name of the TCP connection, for names with ``prefix``."""
    out = subprocess.run(
        ["rabbitmqctl", "-q", "list_connections", "name", "client_properties"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    found: dict[str, str] = {}
    for line in out.splitlines():
        tcp, _, properties = line.partition("\t")
        marker = '{"connection_name","'
        if marker in properties:
            name = properties.split(marker, 1)[1].split('"', 1)[0]
            if name.startswith(prefix):
                found[name] = tcp
    return found


class TestFork:
    def test_a_forked_child_publishes_on_its_own_connection(
        self, broker_url: str, squeue: str
    ) -> None:
        """The child reconnects under its own name, holding no fd of the parent's connection.

        The parent's connection is untouched: the same TCP connection on the
        broker before, during and after the child, never reconnected.
        """
        name = f"test-fork-{uuid.uuid4().hex[:8]}"
        process = subprocess.Popen(
            [sys.executable, "-m", "tests.support.fork_publish", broker_url, squeue, name],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # the child too can be killed as one group
        )
        assert process.stdout is not None and process.stdin is not None
        try:
            first = json.loads(process.stdout.readline())
            assert first["stage"] == "parent-connected", first
            parent_name = first["connection"]
            before = _connections(name)
            assert set(before) == {parent_name}
            process.stdin.write("fork\n")
            process.stdin.flush()
            child = json.loads(process.stdout.readline())
            assert child["stage"] == "child-published", child
            assert child["connection"] != parent_name and ".fork" in child["connection"]
            prefix = first["auto_id"].rsplit("-", 1)[0]
            assert not child["auto_id"].startswith(prefix)  # generated ids never collide
            during = _connections(name)
            assert set(during) == {parent_name, child["connection"]}
            assert during[parent_name] == before[parent_name]  # the same TCP connection
            assert during[child["connection"]] != before[parent_name]
            # The child dropped its copy of the parent's socket at the fork (pointed
            # at /dev/null: nothing sent), and holds only the socket it opened itself.
            assert len(first["sockets"]) == 1, first
            assert child["sockets_at_fork"] == [], child
            assert len(child["sockets"]) == 1 and child["sockets"] != first["sockets"], child
            process.stdin.write("go\n")
            process.stdin.flush()
            after = json.loads(process.stdout.readline())
            assert after["stage"] == "parent-after", after
            assert after["child_exit"] == 0
            assert (after["connection"], after["attempts"]) == (parent_name, 1)
            assert (after["generation"], after["republished"]) == (1, 0)  # never reconnected
            assert after["sockets"] == first["sockets"]  # the same socket, still open
            assert process.wait(timeout=60) == 0
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            _, stderr = process.communicate(timeout=30)
        assert process.returncode == 0, stderr[-3000:]
        ids = sorted(m.message_id or "" for m in drain_queue_sync(broker_url, squeue))
        expected = ["child", "parent-after", "parent-before", first["auto_id"], child["auto_id"]]
        assert ids == sorted(expected)
