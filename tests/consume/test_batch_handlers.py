"""Batch handlers: registration (no broker), then batches against the real broker.

The broker tests count every settle by draining: each message ends acked (gone),
in its retry queue's round trip back to the handler, or in the DLQ, once.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry import trace
from pydantic import BaseModel

from reliable_mq import BatchFailed, InvalidSettings
from reliable_mq._consume.batches import Batcher, _Batch, cause_of, check_batch
from reliable_mq._consume.settle import Outcome
from reliable_mq._tracing import Tracing
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import MemoryDedupStore, SQLiteDedupStore
from reliable_mq.delivery import Delivery
from reliable_mq.handlers import AckPolicy, BatchOptions, Reject, Retry, Router
from reliable_mq.headers import REASON_HEADER
from reliable_mq.settings import ConsumerSettings
from reliable_mq.topology import QueueTopology, declare_topology
from tests.consume.test_consumer_broker import (  # noqa: F401 (_env: fixture)
    URL,
    Env,
    _connection_pid,
    _env,
    _rabbitmqctl,
    drain,
)
from tests.support.waiting import wait_until
from tests.test_tracing import Spans, ids_of


class Row(BaseModel):
    n: int


@pytest.mark.unit
class TestRegistration:
    def test_list_of_models_decodes_each_body(self) -> None:
        """``list[Row]`` decodes every body as a Row; the spec carries the batch options."""
        router = Router()

        @router.batch_handler("q", max_size=10, max_wait=0.2)
        async def rows(items: list[Row]) -> None: ...

        (spec,) = router.handlers
        assert spec.batch == BatchOptions(max_size=10, max_wait=0.2)
        assert spec.decode is not None and not spec.wants_delivery
        assert spec.decode(b'{"n": 3}', "application/json") == Row(n=3)

    def test_list_of_deliveries_and_pairs(self) -> None:
        """``list[Delivery]`` gets the deliveries alone; ``(bodies, deliveries)`` both."""
        router = Router()

        @router.batch_handler("d")
        async def deliveries(items: list[Delivery]) -> None: ...

        @router.batch_handler("p")
        def pairs(bodies: list[bytes], items: list[Delivery]) -> None: ...

        @router.batch_handler("raw")
        async def raw(bodies: list) -> None:  # type: ignore[type-arg]
            ...

        by_queue = {spec.queue: spec for spec in router.handlers}
        assert by_queue["d"].decode is None
        assert by_queue["p"].wants_delivery and by_queue["p"].sync
        assert by_queue["p"].decode is not None
        assert by_queue["p"].decode(b"\xff", None) == b"\xff"
        assert by_queue["raw"].decode is not None
        assert by_queue["raw"].decode(b"x", None) == b"x"

    def test_bad_signatures_and_options_are_refused(self) -> None:
        """Not a list, a second list not of Delivery, bad sizes, queue_only: refused."""
        router = Router()

        async def single(item: Row) -> None: ...

        async def second(items: list[Row], more: list[Row]) -> None: ...

        async def ok(items: list[Row]) -> None: ...

        with pytest.raises(TypeError, match="list"):
            router.add_batch_handler("a", single)
        with pytest.raises(TypeError, match="Delivery"):
            router.add_batch_handler("b", second)
        with pytest.raises(ValueError, match="max_size"):
            router.add_batch_handler("c", ok, max_size=0)
        with pytest.raises(ValueError, match="max_wait"):
            router.add_batch_handler("c", ok, max_wait=-1)
        with pytest.raises(TypeError, match="alone"):
            router.add_batch_handler("c", ok, queue_only=True, ack_policy=AckPolicy.MANUAL)
        assert router.handlers == ()

    def test_prefetch_below_max_size_is_refused_at_registration(self) -> None:
        """A batch that could never fill is refused when the handler is registered."""
        consumer = ReliableConsumer(prefetch=50, dedup=None)

        async def rows(items: list[Row]) -> None: ...

        with pytest.raises(InvalidSettings, match="prefetch"):
            consumer.add_batch_handler("q", rows, max_size=100)
        assert consumer.handlers == ()
        consumer.add_batch_handler("q", rows, max_size=50)  # equal is fine
        unlimited = ConsumerSettings(prefetch=0, allow_unlimited_prefetch=True)
        check_batch(consumer.handlers[0], unlimited)  # unlimited prefetch: any size

    def test_batch_failed_pickles(self) -> None:
        """BatchFailed keeps its failures through pickle (a thread's error may cross processes)."""
        error = pickle.loads(pickle.dumps(BatchFailed({0: ValueError("x"), "m1": Reject("r")})))
        assert set(error.failures) == {0, "m1"}


@pytest.mark.unit
class TestCauses:
    def test_cause_of_each_failure(self) -> None:
        """Retry and Reject are signals, any other exception a handler error."""
        retry = cause_of(Retry("later", delay=2))
        assert (retry.outcome, retry.note, retry.delay) == (Outcome.RETRY_SIGNAL, "later", 2)
        assert cause_of(Reject("bad")).outcome is Outcome.REJECT_SIGNAL
        assert cause_of(KeyError("k")).outcome is Outcome.RAISED
        assert isinstance(cause_of("not an error").error, TypeError)

    def test_failures_by_index_and_message_id(self) -> None:
        """BatchFailed names failed messages by index or message_id; the rest returned."""
        batcher, batch = _batcher(["a", "b", "c", "d"])
        causes = batcher._failed(batch, BatchFailed({1: ValueError("x"), "d": Reject("no")}))
        assert [c.outcome for c in causes] == [
            Outcome.RETURNED,
            Outcome.RAISED,
            Outcome.RETURNED,
            Outcome.REJECT_SIGNAL,
        ]

    @pytest.mark.parametrize("key", [4, -1, "zz", True, 1.0])
    def test_unknown_key_fails_the_whole_batch(self, key: Any) -> None:
        """A key naming no message of the batch fails every message (none is acked unsure)."""
        batcher, batch = _batcher(["a", "b", "c", "d"])
        causes = batcher._failed(batch, BatchFailed({key: ValueError("x")}))
        assert {c.outcome for c in causes} == {Outcome.RAISED}
        assert isinstance(causes[0].error, LookupError)


@pytest.mark.unit
class TestGathering:
    """`Batcher.join` on its own: tickets and a route reduced to what it reads (no broker)."""

    async def test_max_size_closes_the_batch_and_each_gets_its_cause(self) -> None:
        """5 joins at max_size=3: a batch of 3 at once, a batch of 2 after max_wait."""
        calls: list[list[str]] = []

        async def handler(items: list[Delivery]) -> None:
            calls.append([d.message_id for d in items])
            if len(items) == 2:
                raise BatchFailed({"e": Retry("again")})

        batcher, route = _live_batcher(handler, max_size=3, max_wait=0.2)
        session = _Session()
        started = time.perf_counter()
        causes = await asyncio.gather(
            *(batcher.join(_ticket(session, mid), None) for mid in "abcde")
        )
        assert calls == [["a", "b", "c"], ["d", "e"]]
        assert route.sizes == [3, 2]  # the batch-size histogram's observations
        assert [c.outcome for c in causes] == [Outcome.RETURNED] * 4 + [Outcome.RETRY_SIGNAL]
        assert time.perf_counter() - started >= 0.2  # the second batch waited for max_wait
        assert route.running == {}  # every id released once its call ended

    async def test_ids_run_from_joining_until_the_call_ends(self) -> None:
        """An id counts as running while its batch gathers and runs (a copy is deferred)."""
        release = asyncio.Event()

        async def handler(items: list[Delivery]) -> None:
            await release.wait()

        batcher, route = _live_batcher(handler, max_size=10, max_wait=0.05)
        task = asyncio.ensure_future(batcher.join(_ticket(_Session(), "a"), None))
        await asyncio.sleep(0)
        assert route.running == {"a": 1}
        await asyncio.sleep(0.1)  # past max_wait: the call runs
        assert route.running == {"a": 1}
        release.set()
        assert (await task).outcome is Outcome.RETURNED
        assert route.running == {}

    async def test_timeout_cuts_the_call_for_every_delivery(self) -> None:
        """handler_timeout applies to the batch's call: each delivery times out."""

        async def handler(items: list[Delivery]) -> None:
            await asyncio.sleep(10)

        batcher, _ = _live_batcher(handler, max_size=2, max_wait=0.01, handler_timeout=0.1)
        session = _Session()
        causes = await asyncio.wait_for(
            asyncio.gather(*(batcher.join(_ticket(session, m), None) for m in "ab")), 5
        )
        assert [c.outcome for c in causes] == [Outcome.TIMED_OUT] * 2

    async def test_a_timeout_error_of_the_handler_is_an_error(self) -> None:
        """A TimeoutError the handler raises itself is a handler error, not our timeout."""

        async def handler(items: list[Delivery]) -> None:
            raise TimeoutError("the database timed out")

        batcher, _ = _live_batcher(handler, max_size=1, max_wait=0.01, handler_timeout=5)
        cause = await batcher.join(_ticket(_Session(), "a"), None)
        assert cause.outcome is Outcome.RAISED

    async def test_leader_cancelled_settles_its_followers(self) -> None:
        """The leader's task cancelled (a shutdown): followers get SHUTDOWN, not a hang."""
        started = asyncio.Event()

        async def handler(items: list[Delivery]) -> None:
            started.set()
            await asyncio.sleep(10)

        batcher, shared_route = _live_batcher(handler, max_size=3, max_wait=0.01)
        session = _Session()
        leader = asyncio.ensure_future(batcher.join(_ticket(session, "a"), None))
        await asyncio.sleep(0)
        followers = [asyncio.ensure_future(batcher.join(_ticket(session, m), None)) for m in "bc"]
        await asyncio.wait_for(started.wait(), 5)
        batcher.shared.stopping = True
        leader.cancel()
        causes = await asyncio.wait_for(asyncio.gather(*followers), 5)
        assert [c.outcome for c in causes] == [Outcome.SHUTDOWN] * 2
        with pytest.raises(asyncio.CancelledError):
            await leader
        assert shared_route.running == {}

    async def test_flush_runs_the_open_batch_now(self) -> None:
        """`flush` (the consumer stopping) does not wait for max_wait."""
        calls: list[int] = []

        async def handler(items: list[Delivery]) -> None:
            calls.append(len(items))

        batcher, _ = _live_batcher(handler, max_size=10, max_wait=60)
        session = _Session()
        joined = [asyncio.ensure_future(batcher.join(_ticket(session, m), None)) for m in "ab"]
        await asyncio.sleep(0.01)
        batcher.flush()
        await asyncio.wait_for(asyncio.gather(*joined), 5)
        assert calls == [2]

    async def test_a_new_channel_starts_a_new_batch(self) -> None:
        """Deliveries of two channels never share a batch."""
        calls: list[list[str]] = []

        async def handler(items: list[Delivery]) -> None:
            calls.append([d.message_id for d in items])

        batcher, _ = _live_batcher(handler, max_size=10, max_wait=0.05)
        first, second = _Session(), _Session()
        await asyncio.gather(
            batcher.join(_ticket(first, "a"), None), batcher.join(_ticket(second, "b"), None)
        )
        assert sorted(calls) == [["a"], ["b"]]


class _Session:
    def dead(self) -> bool:
        return False


class _Route:
    def __init__(self, spec: Any, handler: Any) -> None:
        self.spec = spec
        self.handler = handler
        self.threads = None
        self.running: dict[str, int] = {}
        self.sizes: list[int] = []
        self.metrics = SimpleNamespace(
            handlers_running=0,
            handler_ended=lambda seconds: None,
            batch_sizes=SimpleNamespace(observe=self.sizes.append),
        )

    def handler_ended(self, message_id: str) -> None:
        count = self.running[message_id] - 1
        if count:
            self.running[message_id] = count
        else:
            del self.running[message_id]

    def ack_lost(self, message_id: str, attempt: int) -> None:
        raise AssertionError("not in these tests")


def _ticket(session: _Session, message_id: str) -> Any:
    delivery = SimpleNamespace(message_id=message_id, attempt=1)
    return SimpleNamespace(
        session=session, delivery=delivery, admitted=time.perf_counter(), settled=False
    )


def _live_batcher(
    handler: Any, *, max_size: int, max_wait: float, handler_timeout: float | None = None
) -> tuple[Batcher, _Route]:
    router = Router()
    router.add_batch_handler("q", handler, max_size=max_size, max_wait=max_wait)
    route = _Route(router.handlers[0], handler)
    settings = ConsumerSettings(handler_timeout=handler_timeout)
    shared = SimpleNamespace(
        settings=settings,
        broker_cut=None,
        stopping=False,
        consumer_timeout=None,
        tracing=Tracing(None),
    )
    return Batcher(route, shared), route  # type: ignore[arg-type]


def _batcher(ids: list[str]) -> tuple[Batcher, _Batch]:
    """A batcher and a batch of tickets reduced to what `Batcher._failed` reads."""
    router = Router()

    @router.batch_handler("q")
    async def rows(items: list[Delivery]) -> None: ...

    route = SimpleNamespace(spec=router.handlers[0])
    shared = SimpleNamespace(settings=ConsumerSettings())
    batcher = Batcher(route, shared)  # type: ignore[arg-type]
    batch = _Batch(None)  # type: ignore[arg-type]
    batch.tickets = [SimpleNamespace(delivery=SimpleNamespace(message_id=i)) for i in ids]  # type: ignore[misc]
    return batcher, batch


# -- against the broker ----------------------------------------------------------------

FAST: dict[str, Any] = {"retry_delays": (0.05,), "max_attempts": 2, "dedup": None}


async def _declare(env: Env) -> None:
    """Declare the queue set the consumers below declare (so messages can wait in it)."""
    topology = QueueTopology(queue=env.queue, retry_delays=(0.05,))
    env.topologies.append(topology)
    await declare_topology(URL, topology)


async def _start(env: Env, consumer: ReliableConsumer) -> None:
    assert consumer.topology(env.queue) == env.topologies[0]
    await consumer.start()


async def _dlq(env: Env) -> Counter[str]:
    """The DLQ's messages by message_id, each with its reason header."""
    messages = await drain(f"{env.queue}.dlq")
    return Counter(f"{m.message_id}:{(m.headers or {}).get(REASON_HEADER)}" for m in messages)


@pytest.mark.rabbitmq
class TestBatches:
    async def test_queued_messages_arrive_as_one_call_and_one_ack_frame(self, env: Env) -> None:
        """50 waiting messages reach a max_size=50 handler in one call, acked in one frame."""
        await _declare(env)
        ids = await env.publish([b"x"] * 50)
        consumer = env.consumer(prefetch=50, **FAST)
        calls: list[list[str]] = []

        @consumer.batch_handler(env.queue, max_size=50, max_wait=2.0)
        async def load(items: list[Delivery]) -> None:
            calls.append([d.message_id for d in items])

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().acked == 50, what="50 acks")
        finally:
            await consumer.stop()
        assert calls == [ids]  # one call, in queue order
        assert consumer.stats().ack_frames == 1
        labels = {"queue": env.queue}
        sample = env.registry.get_sample_value
        assert sample("reliable_mq_handler_batch_size_count", labels) == 1
        assert sample("reliable_mq_handler_batch_size_sum", labels) == 50
        assert await drain(env.queue) == []

    async def test_max_wait_runs_a_partial_batch(self, env: Env) -> None:
        """3 messages and max_size=100: the batch runs with 3 once max_wait has passed."""
        await _declare(env)
        await env.publish([b"a", b"b", b"c"])
        consumer = env.consumer(prefetch=100, **FAST)
        calls: list[tuple[float, list[bytes]]] = []

        @consumer.batch_handler(env.queue, max_size=100, max_wait=0.4)
        async def load(bodies: list[bytes]) -> None:
            calls.append((time.perf_counter(), bodies))

        started = time.perf_counter()
        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().acked == 3, what="3 acks")
        finally:
            await consumer.stop()
        assert [bodies for _, bodies in calls] == [[b"a", b"b", b"c"]]
        assert 0.4 <= calls[0][0] - started < 5.0

    async def test_three_of_500_fail_one_by_one_the_rest_acked_once(self, env: Env) -> None:
        """BatchFailed names 3 of 500: those go down the ladder alone, 497 are acked once."""
        await _declare(env)
        ids = await env.publish(
            [f'{{"n": {i}}}'.encode() for i in range(500)], content_type="application/json"
        )
        consumer = env.consumer(prefetch=500, **FAST)
        done: Counter[str] = Counter()
        runs: Counter[str] = Counter()

        @consumer.batch_handler(env.queue, max_size=500, max_wait=1.0)
        async def load(rows: list[Row], items: list[Delivery]) -> None:
            failures: dict[int | str, BaseException] = {}
            for index, (row, delivery) in enumerate(zip(rows, items, strict=True)):
                runs[delivery.message_id] += 1
                if row.n in (7, 123):
                    failures[index] = ValueError(f"row {row.n}")
                elif row.n == 400:
                    failures[delivery.message_id] = Reject("row 400")
                else:
                    done[delivery.message_id] += 1
            if failures:
                raise BatchFailed(failures)

        await _start(env, consumer)
        try:
            await wait_until(
                lambda: consumer.stats().dead_lettered == 3, timeout=30, what="3 dead letters"
            )
            await wait_until(lambda: consumer.stats().acked == 497, what="497 acks")
        finally:
            await consumer.stop()
        stats = consumer.stats()
        assert (stats.retried, stats.dead_lettered, stats.acked) == (2, 3, 497)
        assert set(done.values()) == {1} and len(done) == 497
        assert (runs["m7"], runs["m123"], runs["m400"]) == (2, 2, 1)  # max_attempts=2
        assert await _dlq(env) == Counter(
            {"m7:max_attempts": 1, "m123:max_attempts": 1, "m400:rejected": 1}
        )
        assert await drain(env.queue) == []
        assert set(ids) == set(runs)

    async def test_a_batch_raising_sends_every_message_down_the_ladder(self, env: Env) -> None:
        """A handler raising for its whole batch: each message retried, then dead-lettered."""
        await _declare(env)
        await env.publish([b"x"] * 20)
        consumer = env.consumer(prefetch=20, **FAST)
        runs: Counter[str] = Counter()

        @consumer.batch_handler(env.queue, max_size=20, max_wait=0.2)
        async def load(items: list[Delivery]) -> None:
            runs.update(d.message_id for d in items)
            raise RuntimeError("the database is down")

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().dead_lettered == 20, what="20 dead letters")
        finally:
            await consumer.stop()
        assert consumer.stats().retried == 20
        assert set(runs.values()) == {2} and len(runs) == 20
        assert await _dlq(env) == Counter({f"m{i}:max_attempts": 1 for i in range(20)})

    async def test_handler_timeout_applies_per_batch(self, env: Env) -> None:
        """A batch past handler_timeout is cut; each message is retried, then runs once."""
        await _declare(env)
        await env.publish([b"x"] * 10)
        consumer = env.consumer(prefetch=10, handler_timeout=0.3, **FAST)
        calls: list[int] = []
        done: Counter[str] = Counter()

        @consumer.batch_handler(env.queue, max_size=10, max_wait=0.2)
        async def load(items: list[Delivery]) -> None:
            calls.append(len(items))
            if items[0].attempt == 1:
                await asyncio.sleep(10)
            done.update(d.message_id for d in items)

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().acked == 10, timeout=15, what="10 acks")
        finally:
            await consumer.stop()
        assert consumer.stats().retried == 10
        assert calls[0] == 10 and sum(calls) == 20
        assert set(done.values()) == {1} and len(done) == 10

    async def test_stop_runs_a_partial_batch_at_once(self, env: Env) -> None:
        """stop() does not wait for max_wait: the partial batch runs, and is acked."""
        await _declare(env)
        await env.publish([b"x"] * 5)
        consumer = env.consumer(prefetch=100, **FAST)
        calls: list[int] = []

        @consumer.batch_handler(env.queue, max_size=100, max_wait=60)
        async def load(items: list[Delivery]) -> None:
            calls.append(len(items))

        await _start(env, consumer)
        # in_progress counts deliveries past their intake: each has joined the batch.
        await wait_until(lambda: consumer.stats().in_progress == 5, what="5 in the batch")
        started = time.perf_counter()
        await consumer.stop()
        assert time.perf_counter() - started < 10
        assert calls == [5]
        assert consumer.stats().acked == 5
        assert await drain(env.queue) == []

    async def test_stop_past_grace_requeues_the_batch_once(self, env: Env) -> None:
        """A batch still running past shutdown_grace: every message requeued, once."""
        await _declare(env)
        await env.publish([b"x"] * 30)
        consumer = env.consumer(prefetch=30, **FAST)
        running = asyncio.Event()

        @consumer.batch_handler(env.queue, max_size=30, max_wait=0.5)
        async def load(items: list[Delivery]) -> None:
            running.set()
            await asyncio.sleep(30)

        await _start(env, consumer)
        await asyncio.wait_for(running.wait(), 10)
        await consumer.stop(grace=0.2)
        stats = consumer.stats()
        assert (stats.acked, stats.requeued, stats.retried) == (0, 30, 0)
        back = await drain(env.queue)
        assert Counter(m.message_id for m in back) == Counter({f"m{i}": 1 for i in range(30)})
        assert await _dlq(env) == Counter()

    async def test_connection_cut_mid_batch_loses_nothing(self, env: Env) -> None:
        """The broker closes the connection while one batch's call runs and the next
        gathers: each of their deliveries is settled once, as stale (the broker requeued
        them), both batches' tasks end, every message is handled after the reopen, and
        the new channel trips no stale tag."""
        await _declare(env)
        ids = await env.publish([b"x"] * 300)
        consumer = env.consumer(prefetch=200, **FAST)
        handled: Counter[str] = Counter()
        in_call, cut_done = asyncio.Event(), asyncio.Event()

        @consumer.batch_handler(env.queue, max_size=150, max_wait=30)
        async def load(items: list[Delivery]) -> None:
            if not cut_done.is_set():
                in_call.set()
                await cut_done.wait()  # cancelled by the cut: not handled
            handled.update(d.message_id for d in items)

        await _start(env, consumer)
        try:
            pid = await _connection_pid(consumer.connection_name)
            await asyncio.wait_for(in_call.wait(), 10)  # 150 in the call, 50 gathering
            await wait_until(lambda: consumer.stats().in_progress == 200, what="200 in flight")
            await _rabbitmqctl("close_connection", pid, "test cut")
            await wait_until(lambda: consumer.stats().channel_reopens >= 1, what="the reopen")
            cut_done.set()
            await wait_until(lambda: set(ids) <= set(handled), timeout=60, what="all handled")
            stats = consumer.stats()
        finally:
            await consumer.stop()
        assert stats.channel_reopens == 1  # no PRECONDITION_FAILED after the reopen
        assert stats.stale == 200  # both batches, each delivery once
        assert stats.acked == 300
        assert stats.in_progress == 0
        assert await drain(env.queue) == []
        assert await _dlq(env) == Counter()

    async def test_an_awaited_dedup_store_filters_the_batch(self, env: Env, tmp_path: Any) -> None:
        """With a dedup store that is awaited (SQLite), each delivery has its own task up to
        the batch (`Batcher.join`): a copy of a done id still never reaches the handler."""
        await _declare(env)
        await env.publish([b"x"] * 6, ids=["a", "b", "c", "a", "d", "e"])
        store = SQLiteDedupStore(tmp_path / "dedup.db")
        consumer = env.consumer(prefetch=10, retry_delays=(0.05,), dedup=store)
        runs: Counter[str] = Counter()

        @consumer.batch_handler(env.queue, max_size=10, max_wait=0.3)
        async def load(items: list[Delivery]) -> None:
            runs.update(d.message_id for d in items)

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().acked == 5, what="5 acked")
            await wait_until(lambda: consumer.stats().duplicates == 1, what="1 duplicate")
        finally:
            await consumer.stop()
            await store.close()
        assert runs == Counter({"a": 1, "b": 1, "c": 1, "d": 1, "e": 1})
        assert await drain(env.queue) == []

    async def test_dedup_filters_the_batch(self, env: Env) -> None:
        """Copies of an id done (or in the batch) never reach the handler; they are acked."""
        await _declare(env)
        await env.publish([b"x"] * 5, ids=["a", "b", "c", "a", "b"])
        store = MemoryDedupStore()
        consumer = env.consumer(prefetch=10, retry_delays=(0.05,), dedup=store)
        runs: Counter[str] = Counter()

        @consumer.batch_handler(env.queue, max_size=10, max_wait=0.3)
        async def load(items: list[Delivery]) -> None:
            runs.update(d.message_id for d in items)

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().duplicates == 2, what="2 duplicates")
        finally:
            await consumer.stop()
            await store.close()
        assert runs == Counter({"a": 1, "b": 1, "c": 1})
        assert consumer.stats().acked == 3
        assert await drain(env.queue) == []

    async def test_def_form_runs_in_a_thread_with_pydantic_rows(self, env: Env) -> None:
        """A plain def over list[Row] runs in a thread; a bad body is dead-lettered alone."""
        await _declare(env)
        await env.publish(
            [b'{"n": 1}', b'{"n": "nope"}', b'{"n": 3}'], content_type="application/json"
        )
        consumer = env.consumer(prefetch=10, **FAST)
        seen: list[tuple[str, list[Row]]] = []

        @consumer.batch_handler(env.queue, max_size=10, max_wait=0.3)
        def load(rows: list[Row]) -> None:
            seen.append((threading.current_thread().name, rows))

        await _start(env, consumer)
        try:
            await wait_until(lambda: consumer.stats().acked == 2, what="2 acks")
        finally:
            await consumer.stop()
        ((thread, rows),) = seen
        assert thread.startswith("reliable_mq:")
        assert rows == [Row(n=1), Row(n=3)]
        assert await _dlq(env) == Counter({"m1:invalid_body": 1})

    async def test_each_delivery_of_a_batch_gets_its_process_span(self, env: Env) -> None:
        """Tracing: a process span per delivery, one ack span for the batch's frame; the
        handler runs inside the batch's own process span (`tests/test_tracing_consume.py`
        has its links), not inside the first delivery's."""
        spans = Spans()
        await _declare(env)
        await env.publish([b"x"] * 5)
        consumer = ReliableConsumer(
            env.connection(),
            registry=env.registry,
            tracer_provider=spans.provider,
            prefetch=10,
            **FAST,
        )
        current: list[int] = []

        @consumer.batch_handler(env.queue, max_size=5, max_wait=1.0)
        async def load(items: list[Delivery]) -> None:
            current.append(trace.get_current_span().get_span_context().span_id)

        await _start(env, consumer)
        try:
            await wait_until(lambda: len(spans.named("ack ")) == 1, what="the ack span")
        finally:
            await consumer.stop()
        found = spans.named("process ")
        [batch] = [p for p in found if "messaging.batch.message_count" in (p.attributes or {})]
        processes = [p for p in found if p is not batch]
        assert len(processes) == 5
        assert current == [ids_of(batch)[1]]
        [ack] = spans.named("ack ")
        assert (ack.attributes or {})["messaging.batch.message_count"] == 5
