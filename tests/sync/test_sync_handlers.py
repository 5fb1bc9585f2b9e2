"""Plain ``def`` handlers: registration, the thread pool, and the consumer against the real broker.

Each broker test uses uuid-suffixed queues and deletes the whole topology (work,
retry and dead-letter queues) afterwards. A handler that must block waits on a
``threading.Event`` the test sets in a ``finally``, so no thread outlives a
failed test for long.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest
import structlog
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, SecretStr, field_validator

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq._consume.threads import FALLBACK_SIZE, HandlerThreads, pool_size
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.errors import ClosedError
from reliable_mq.handlers import AckPolicy, HandlerSpec, Reject, Retry, Router
from reliable_mq.headers import ERROR_TYPE_HEADER, REASON_HEADER
from reliable_mq.topology import QueueTopology, delete_topology
from tests.support.amqp import drain_queue
from tests.support.waiting import wait_until

URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")
ROOT = Path(__file__).resolve().parents[2]
WAIT = 20.0
"""Seconds any condition may take (generous: a loaded 2-core machine)."""


class Gate:
    """A thread-safe latch a blocked handler waits on; always opened at the end of a test."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()

    def block(self) -> None:
        self.entered.set()
        if not self.release.wait(WAIT * 3):
            raise AssertionError("the test never released the handler")


# -- registration (no broker) ------------------------------------------------------


class Order(BaseModel):
    id: int


class TestRegistration:
    def test_plain_def_in_every_signature(self) -> None:
        """(body), (body, delivery) and (delivery) plain defs are accepted, decoded as async ones."""

        def body_only(order: Order) -> None: ...

        def both(order: Order, delivery: Delivery) -> None: ...

        def delivery_only(delivery: Delivery) -> None: ...

        one, two, three = (HandlerSpec.build("q", f) for f in (body_only, both, delivery_only))
        assert one.sync and two.sync and three.sync
        assert one.decode is not None and one.decode(b'{"id": 3}', None) == Order(id=3)
        assert two.wants_delivery and not one.wants_delivery
        assert three.decode is None and three.wants_delivery

    def test_async_def_is_not_sync(self) -> None:
        async def handler(body: bytes) -> None: ...

        assert not HandlerSpec.build("q", handler).sync

    def test_manual_ack_policy_refused_for_a_plain_def(self) -> None:
        """A thread cannot await delivery.ack(): MANUAL is refused at registration."""
        router = Router()

        def handler(body: bytes) -> None: ...

        with pytest.raises(TypeError, match=r"plain def.*AckPolicy.MANUAL"):
            router.add_handler("q", handler, ack_policy="manual")
        assert router.handlers == ()
        for policy in AckPolicy:
            if policy is not AckPolicy.MANUAL:
                assert HandlerSpec.build("q", handler, ack_policy=policy).sync

    def test_generators_refused(self) -> None:
        """A generator's body would never run (every message acked unhandled)."""

        def gen(body: bytes) -> Iterator[None]:
            yield None

        async def agen(body: bytes) -> AsyncIterator[None]:
            yield None

        for func in (gen, agen):
            with pytest.raises(TypeError, match="generator"):
                HandlerSpec.build("q", func)  # type: ignore[arg-type]

    def test_sync_wrappers_of_coroutines_refused(self) -> None:
        """A decorator that hides an async def, or an object with an async __call__, is refused."""

        async def real(body: bytes) -> None: ...

        @functools.wraps(real)
        def wrapper(body: bytes) -> Coroutine[Any, Any, None]:
            return real(body)

        class Callable_:
            async def __call__(self, body: bytes) -> None: ...

        for func in (wrapper, Callable_()):
            with pytest.raises(TypeError, match="not an async def itself"):
                HandlerSpec.build("q", func)

    def test_not_callable_refused(self) -> None:
        with pytest.raises(TypeError, match="not callable"):
            HandlerSpec.build("q", 42)  # type: ignore[arg-type]

    def test_pool_size(self) -> None:
        """concurrency, else prefetch, else a fixed cap (unlimited prefetch)."""
        assert pool_size(4, 200) == 4
        assert pool_size(None, 3) == 3
        assert pool_size(None, 0) == FALLBACK_SIZE


# -- the pool on its own -------------------------------------------------------------


def _delivery(**fields: Any) -> Delivery:
    values: dict[str, Any] = {
        "body": b"x",
        "message_id": "m1",
        "headers": {"h": 1},
        "redelivered": False,
        "attempt": 2,
        "queue": "q",
        "exchange": "",
        "routing_key": "q",
        "content_type": None,
    }
    values.update(fields)
    return Delivery(**values)


class TestHandlerThreads:
    async def test_never_more_threads_than_size(self) -> None:
        """20 jobs on 3 threads: at most 3 at once, 3 threads started, all done."""
        pool = HandlerThreads(3, "t")
        lock = threading.Lock()
        running = peak = 0
        names: set[str] = set()

        def job(n: int) -> None:
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
                names.add(threading.current_thread().name)
            time.sleep(0.02)
            with lock:
                running -= 1

        await asyncio.gather(*(pool.run(job, n) for n in range(20)))
        assert peak == 3 == pool.peak
        assert pool.started == 3 and len(names) == 3
        assert all(name.startswith("t-") for name in names)
        assert pool.busy == 0
        assert pool.close() == 0

    async def test_context_is_copied_into_the_thread(self) -> None:
        """contextvars (structlog's bound context) set in the task are seen in the thread."""
        pool = HandlerThreads(1, "t")
        seen: list[Any] = []
        var: contextvars.ContextVar[str] = contextvars.ContextVar("var")
        var.set("from the task")
        structlog.contextvars.bind_contextvars(message_id="m-42")
        try:
            await pool.run(
                lambda: seen.append((var.get(), structlog.contextvars.get_contextvars()))
            )
        finally:
            structlog.contextvars.unbind_contextvars("message_id")
            pool.close()
        assert seen[0][0] == "from the task"
        assert seen[0][1]["message_id"] == "m-42"

    async def test_errors_come_back(self) -> None:
        """An exception is raised in the caller; StopIteration as RuntimeError; an awaitable too."""
        pool = HandlerThreads(1, "t")

        def boom() -> None:
            raise Retry("later", delay=5)

        def stop() -> None:
            raise StopIteration

        async def coro() -> None: ...

        with pytest.raises(Retry) as info:
            await pool.run(boom)
        assert info.value.delay == 5
        with pytest.raises(RuntimeError, match="StopIteration"):
            await pool.run(stop)
        with pytest.raises(TypeError, match="returned an awaitable"):
            await pool.run(coro)  # type: ignore[arg-type]  # closed: no "never awaited" warning
        pool.close()

    async def test_cancelled_running_job_is_discarded_and_frees_its_thread(self) -> None:
        """The wait is cancelled; the thread finishes later, its error goes nowhere, its slot frees."""
        pool = HandlerThreads(1, "t")
        gate = Gate()

        def stuck() -> None:
            gate.block()
            raise ValueError("late")

        try:
            with structlog.testing.capture_logs() as logs:
                pool._log = structlog.get_logger()  # captured from now on
                waiter = asyncio.ensure_future(pool.run(stuck))
                await asyncio.to_thread(gate.entered.wait, WAIT)
                waiter.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await waiter
                assert pool.busy == 1
                gate.release.set()
                await wait_until(
                    lambda: pool.busy == 0, what="the late thread to finish", timeout=WAIT
                )
                await wait_until(lambda: bool(logs), what="the late log line", timeout=WAIT)
            assert logs[0]["event"] == "handler_finished_late"
            assert "late" in logs[0]["error"]
            ran: list[str] = []
            await pool.run(lambda: ran.append(threading.current_thread().name))
            assert ran == ["t-1"]  # the same (only) thread took the next job
        finally:
            gate.release.set()
            pool.close()

    async def test_cancelled_queued_job_never_runs(self) -> None:
        pool = HandlerThreads(1, "t")
        gate = Gate()
        ran: list[int] = []
        try:
            first = asyncio.ensure_future(pool.run(gate.block))
            await asyncio.to_thread(gate.entered.wait, WAIT)
            queued = asyncio.ensure_future(pool.run(ran.append, 1))
            await asyncio.sleep(0.05)
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            gate.release.set()
            await first
            await pool.run(ran.append, 2)
            assert ran == [2]
        finally:
            gate.release.set()
            pool.close()

    async def test_close_never_waits_for_a_stuck_thread(self) -> None:
        """close() returns at once with the busy count; queued jobs fail; no new jobs."""
        pool = HandlerThreads(1, "t")
        gate = Gate()
        try:
            first = asyncio.ensure_future(pool.run(gate.block))
            await asyncio.to_thread(gate.entered.wait, WAIT)
            queued = asyncio.ensure_future(pool.run(time.sleep, 0))
            await asyncio.sleep(0.05)
            started = time.monotonic()
            assert pool.close() == 1
            assert time.monotonic() - started < 1.0
            with pytest.raises(ClosedError):
                await queued
            with pytest.raises(ClosedError):
                await pool.run(time.sleep, 0)
        finally:
            gate.release.set()
        await first  # the running job still completes normally
        await wait_until(
            lambda: not any(t.name == "t-1" for t in threading.enumerate()),
            what="the thread to exit",
            timeout=WAIT,
        )

    async def test_a_thread_that_cannot_start_fails_the_call_not_the_pool(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """Out of threads: the call raises (a handler error), the job never runs later."""
        pool = HandlerThreads(2, "t")
        ran: list[int] = []

        def cannot_start(self: threading.Thread) -> None:
            raise RuntimeError("can't start new thread")

        with monkeypatch.context() as patched:
            patched.setattr(threading.Thread, "start", cannot_start)
            with pytest.raises(RuntimeError, match="can't start"):
                await pool.run(ran.append, 1)
        assert pool.started == 0
        await pool.run(ran.append, 2)
        assert ran == [2]
        assert pool.close() == 0

    async def test_a_threads_delivery_cannot_be_settled(self) -> None:
        """The Delivery a plain def gets reads like the original; its settle methods raise."""
        pool = HandlerThreads(1, "t")
        original = _delivery()
        errors: list[str] = []
        seen: list[Delivery] = []

        def handler(delivery: Delivery) -> None:
            seen.append(delivery)
            for name in ("ack", "retry", "reject", "nack"):
                try:
                    getattr(delivery, name)()
                except RuntimeError as exc:
                    errors.append(str(exc))

        await pool.run(handler, original)
        pool.close()
        copy = seen[0]
        assert isinstance(copy, Delivery) and copy is not original
        assert (copy.message_id, copy.attempt, copy.headers) == ("m1", 2, {"h": 1})
        assert len(errors) == 4 and all("plain def handler" in e for e in errors)


# -- against the broker ---------------------------------------------------------------


class Env:
    """Names, consumers and clean-up of one broker test."""

    def __init__(self) -> None:
        self.suffix = uuid.uuid4().hex[:10]
        self.queue = f"test-sync-{self.suffix}"
        self.topologies: list[QueueTopology] = []

    def consumer(self, **overrides: Any) -> ReliableConsumer:
        connection = ConnectionSettings(
            url=SecretStr(URL), connection_name=f"test-sync-{self.suffix}"
        )
        defaults: dict[str, Any] = {"retry_delays": (0.1,), "max_attempts": 2, "dedup": None}
        return ReliableConsumer(connection, registry=CollectorRegistry(), **defaults | overrides)

    def track(self, consumer: ReliableConsumer) -> None:
        self.topologies += [consumer.topology(spec.queue) for spec in consumer.handlers]

    async def publish(self, *bodies: Any, ids: list[str], content_type: str | None = None) -> None:
        async with ReliablePublisher(URL, registry=CollectorRegistry()) as publisher:
            for body, message_id in zip(bodies, ids, strict=True):
                await publisher.publish(
                    body, routing_key=self.queue, message_id=message_id, content_type=content_type
                )

    async def queue_depth(self, queue: str) -> int:
        connection = await aio_pika.connect(URL)
        async with connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            return declared.declaration_result.message_count or 0


@pytest.fixture(name="env")
async def _env(broker_url: str) -> AsyncIterator[Env]:
    env = Env()
    yield env
    connection = await aio_pika.connect(URL)
    async with connection:
        for topology in env.topologies:
            channel = await connection.channel()
            await delete_topology(channel, topology)
            await channel.close()


class Op(BaseModel):
    op: str
    decoded_in: str = ""

    @field_validator("decoded_in")
    @classmethod
    def _thread(cls, value: str) -> str:
        return threading.current_thread().name


@pytest.mark.rabbitmq
class TestOutcomes:
    async def test_return_raise_retry_reject_settle_and_a_bad_body(self, env: Env) -> None:
        """Each ends as for an async def, decided on the loop; the handler runs in a pool thread."""
        consumer = env.consumer()
        runs: list[tuple[str, int]] = []
        context: list[dict[str, Any]] = []
        threads: set[str] = set()
        decoded_in: set[str] = set()

        @consumer.handler(env.queue)
        def handle(body: Op, delivery: Delivery) -> None:
            runs.append((body.op, delivery.attempt))
            context.append(structlog.contextvars.get_contextvars())
            threads.add(threading.current_thread().name)
            decoded_in.add(body.decoded_in)
            match body.op:
                case "raise":
                    raise ValueError("boom")
                case "retry":
                    raise Retry("later")
                case "reject":
                    raise Reject("no")
                case "settle":
                    delivery.ack()  # type: ignore[unused-coroutine]  # RuntimeError: retried

        env.track(consumer)
        ops = ["ok", "raise", "retry", "reject", "settle"]
        # Bound before start: the delivery tasks' contexts descend from this one.
        structlog.contextvars.bind_contextvars(test_case=env.suffix)
        try:
            await consumer.start()
        finally:
            structlog.contextvars.unbind_contextvars("test_case")
        async with consumer:
            await env.publish(*({"op": op, "decoded_in": "?"} for op in ops), ids=ops)
            await env.publish(b"{not json", ids=["bad"], content_type="application/json")
            await wait_until(
                lambda: (
                    (s := consumer.stats()).acked == 1
                    and s.dead_lettered == 5
                    and s.in_progress == 0
                ),
                what="1 ack and 5 dead letters, and nothing in progress",
                timeout=WAIT,
            )
            stats = consumer.stats()
        assert (stats.retried, stats.in_progress, stats.threads_busy) == (3, 0, 0)
        assert sorted(runs) == sorted(
            [
                *[("ok", 1), ("raise", 1), ("raise", 2), ("retry", 1), ("retry", 2)],
                *[("reject", 1), ("settle", 1), ("settle", 2)],
            ]
        )
        assert all(name.startswith(f"reliable_mq:{env.queue}-") for name in threads)
        assert decoded_in == {threading.current_thread().name}  # decoded on the loop
        assert {c.get("test_case") for c in context} == {env.suffix}  # the task's log context
        dead = await drain_queue(URL, f"{env.queue}.dlq", idle_timeout=0.3)
        reasons = {
            m.message_id: (m.headers[REASON_HEADER], m.headers[ERROR_TYPE_HEADER]) for m in dead
        }
        assert reasons == {
            "raise": ("max_attempts", "ValueError"),
            "retry": ("max_attempts", "Retry"),
            "reject": ("rejected", "Reject"),
            "settle": ("max_attempts", "RuntimeError"),
            "bad": ("invalid_body", "BodyDecodeError"),
        }

    @pytest.mark.parametrize(
        ("settings", "limit"),
        [({"concurrency": 4, "prefetch": 50}, 4), ({"prefetch": 3}, 3)],
        ids=["concurrency", "prefetch"],
    )
    async def test_threads_in_handlers_never_exceed_the_limit(
        self, env: Env, settings: dict[str, Any], limit: int
    ) -> None:
        consumer = env.consumer(**settings)
        lock = threading.Lock()
        running = peak = 0
        idents: set[int] = set()

        @consumer.handler(env.queue)
        def handle(body: bytes) -> None:
            nonlocal running, peak
            with lock:
                running += 1
                peak = max(peak, running)
                idents.add(threading.get_ident())
            time.sleep(0.05)
            with lock:
                running -= 1

        env.track(consumer)
        count = 10 * limit
        async with consumer:
            await env.publish(*([b"x"] * count), ids=[f"m{n}" for n in range(count)])
            await wait_until(
                lambda: consumer.stats().acked == count, what=f"{count} acks", timeout=WAIT
            )
        assert peak == limit  # reached, never passed
        assert len(idents) <= limit


@pytest.mark.rabbitmq
class TestTimeoutsAndStop:
    async def test_past_handler_timeout_retried_late_result_discarded(self, env: Env) -> None:
        """Attempt 1 hangs: retried at the timeout; attempt 2 waits (deferred, not counted)
        until attempt 1's thread returns, then acks; attempt 1's late error is dropped.
        (The two used to run at once.)"""
        consumer = env.consumer(handler_timeout=0.3, concurrency=2, max_attempts=3)
        gate = Gate()
        runs: list[int] = []

        @consumer.handler(env.queue)
        def handle(delivery: Delivery) -> None:
            runs.append(delivery.attempt)
            if delivery.attempt == 1:
                gate.block()
                raise ValueError("too late to matter")

        env.track(consumer)
        try:
            with structlog.testing.capture_logs() as logs:
                async with consumer:
                    await env.publish(b"x", ids=["slow"])
                    await wait_until(
                        lambda: (s := consumer.stats()).deferred >= 2 and s.in_progress == 0,
                        what="attempt 2 deferred while attempt 1 still runs",
                        timeout=WAIT,
                    )
                    stats = consumer.stats()
                    assert (stats.retried, stats.acked, stats.threads_busy) == (1, 0, 1)
                    assert runs == [1]  # never twice at once
                    gate.release.set()
                    await wait_until(
                        lambda: (s := consumer.stats()).acked == 1 and s.in_progress == 0,
                        what="attempt 2's ack, and nothing in progress",
                        timeout=WAIT,
                    )
                    await wait_until(
                        lambda: consumer.stats().threads_busy == 0,
                        what="a free thread",
                        timeout=WAIT,
                    )
                    await asyncio.sleep(0.3)  # room for a (wrong) second settle
                    stats = consumer.stats()
                    depths = [
                        await env.queue_depth(q) for q in consumer.topology(env.queue).all_queues
                    ]
        finally:
            gate.release.set()
        assert runs == [1, 2]
        assert (stats.acked, stats.retried, stats.dead_lettered, stats.requeued) == (1, 1, 0, 0)
        assert (stats.stale, stats.channel_reopens, stats.in_progress) == (0, 0, 0)
        assert depths == [0] * len(depths)  # nothing left anywhere, nothing settled twice
        events = [e["event"] for e in logs]
        assert "handler_timeout" in events
        late = [e for e in logs if e["event"] == "handler_finished_late"]
        assert len(late) == 1 and "too late to matter" in late[0]["error"]
        assert late[0]["message_id"] == "slow"  # logged in the delivery's context

    async def test_stop_waits_for_a_handler_that_ends_within_grace(self, env: Env) -> None:
        consumer = env.consumer(shutdown_grace=10)
        gate = Gate()

        @consumer.handler(env.queue)
        def handle(body: bytes) -> None:
            gate.block()

        env.track(consumer)
        try:
            await consumer.start()
            await env.publish(b"x", ids=["m"])
            await asyncio.to_thread(gate.entered.wait, WAIT)
            stopping = asyncio.ensure_future(consumer.stop())
            await asyncio.sleep(0.2)
            assert not stopping.done()
            gate.release.set()
            await stopping
        finally:
            gate.release.set()
            await consumer.stop()
        stats = consumer.stats()
        assert (stats.acked, stats.requeued, stats.threads_busy) == (1, 0, 0)
        assert await env.queue_depth(env.queue) == 0

    async def test_stop_does_not_wait_past_grace_for_a_stuck_handler(self, env: Env) -> None:
        """stop() returns after shutdown_grace; the delivery is requeued; the thread is left to end."""
        gate = Gate()
        with structlog.testing.capture_logs() as logs:
            consumer = env.consumer(shutdown_grace=0.5)

            @consumer.handler(env.queue)
            def handle(body: bytes) -> None:
                gate.block()

            env.track(consumer)
            try:
                await consumer.start()
                await env.publish(b"x", ids=["stuck"])
                await asyncio.to_thread(gate.entered.wait, WAIT)
                started = time.monotonic()
                await consumer.stop()
                took = time.monotonic() - started
                stats = consumer.stats()
                gate.release.set()
                await wait_until(
                    lambda: consumer.stats().threads_busy == 0,
                    what="the thread to end",
                    timeout=WAIT,
                )
            finally:
                gate.release.set()
                await consumer.stop()
        assert 0.5 <= took < 10  # the grace, and never the thread's whole life
        assert (stats.acked, stats.requeued, stats.threads_busy) == (0, 1, 1)
        assert consumer.stats().acked == 0  # the late return settled nothing
        assert await env.queue_depth(env.queue) == 1  # requeued, for the next consumer
        still = [e for e in logs if e["event"] == "handler_threads_still_running"]
        assert len(still) == 1 and still[0]["count"] == 1
        assert any(e["event"] == "handler_finished_late" for e in logs)


@pytest.mark.rabbitmq
class TestRunner:
    async def test_a_router_of_plain_defs_under_reliable_mq_run(
        self, env: Env, tmp_path: Path
    ) -> None:
        """`reliable-mq run` with a Router of a plain def: handles, and drains on SIGTERM.

        One handler never returns: the worker still exits cleanly after
        ``shutdown_grace`` (not killed after ``--graceful-timeout``), and its
        message is back in the queue.
        """
        out = tmp_path / "handled"
        environ = {
            **os.environ,
            "RELIABLE_MQ_URL": URL,
            "RELIABLE_MQ_CONSUMER_SHUTDOWN_GRACE": "0.5",
            "SYNC_RUNNER_QUEUE": env.queue,
            "SYNC_RUNNER_OUT": str(out),
        }
        environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        env.topologies.append(QueueTopology(env.queue))
        log = (tmp_path / "runner.log").open("wb")
        process = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
            [
                sys.executable,
                "-m",
                "reliable_mq.cli",
                "run",
                "tests.support.sync_runner_app:router",
                "--graceful-timeout",
                "60",
            ],
            cwd=ROOT,
            env=environ,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            ids = ["stuck", *(f"r{n}" for n in range(20))]
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline and b'"worker_ready"' not in _read(tmp_path):
                assert process.poll() is None, _read(tmp_path)[-3000:]
                await asyncio.sleep(0.1)
            await env.publish(*([b"x"] * len(ids)), ids=ids)
            while time.monotonic() < deadline and len(_lines(out)) < len(ids):
                await asyncio.sleep(0.1)
            process.send_signal(signal.SIGTERM)
            stopping = time.monotonic()
            code = await asyncio.to_thread(process.wait, 90)
            took = time.monotonic() - stopping
            assert code == 0, _read(tmp_path)[-3000:]
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                await asyncio.to_thread(process.wait, 30)
            log.close()
        handled = _lines(out)
        assert sorted(line.split()[0] for line in handled) == sorted(ids)
        assert all(line.split()[1].startswith(f"reliable_mq:{env.queue}-") for line in handled)
        assert b"worker_stopped" in _read(tmp_path)
        assert b"handler_threads_still_running" in _read(tmp_path)
        assert took < 30  # well before --graceful-timeout would kill the worker
        assert await env.queue_depth(env.queue) == 1  # "stuck" was requeued


def _read(tmp_path: Path) -> bytes:
    return (tmp_path / "runner.log").read_bytes()


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []
