"""The executor side: one partition's rows published with confirms, in bounded rounds."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry
from pyspark import TaskContext

from .._sync import run_sync
from .._tracing import Tracing, partition_ended, start_partition, use_span
from ..errors import (
    BrokerUnavailable,
    InvalidMessage,
    MessageTooLarge,
    PublishRefused,
    PublishUnroutable,
    ReliableMQError,
)
from ..log import get_logger
from ..message import Message
from ..publisher import ReliablePublisher
from ._errors import PartitionNotConfirmed
from ._plan import Prepared, PublishPlan, RowEncoder, TaskInfo

__all__ = ("PartitionStats", "current_task", "publish_partition")

_log = get_logger("reliable_mq.spark")
_BATCH_ID_PROPERTY = "streaming.sql.batchId"  # set by Structured Streaming on its jobs

_DETERMINISTIC: tuple[type[ReliableMQError], ...] = (
    PublishUnroutable,  # basic.return: sending it again is returned again
    PublishRefused,  # refused by the broker (ExchangeNotFound is one)
    MessageTooLarge,
    InvalidMessage,  # our encoder or the publisher's: InvalidBody, NullKey, null routing key
)
"""Failures that would repeat identically: the partition stops, Spark must not retry."""


@dataclass(frozen=True, slots=True)
class PartitionStats:
    """What one task attempt of one partition did (one row per partition).

    Attributes:
        partition: the partition index.
        task_attempt: Spark's attempt number of the task that produced this row
            (0 unless Spark retried the task).
        batch_id: the Structured Streaming micro-batch id, if any.
        rows: rows read from the partition.
        confirmed: messages confirmed by the broker.
        republished: resends: inside the publisher (nack, timeout, lost channel)
            plus whole in-task rounds.
        rounds: in-task publishing rounds (0 for an empty partition: no
            connection was opened; 1 unless some messages needed another).
        seconds: wall time in the task.
        error: a deterministic failure (unroutable, unencodable...) that stopped
            the partition, the error object itself; `publish_dataframe` raises
            it on the driver.
    """

    partition: int
    task_attempt: int
    batch_id: int | None
    rows: int
    confirmed: int
    republished: int
    rounds: int
    seconds: float
    error: ReliableMQError | None = None


def current_task(batch_id: int | None = None) -> TaskInfo:
    """The running Spark task's partition and attempt (zeros outside a task).

    Without ``batch_id``, a streaming micro-batch's id is read from the task's
    local properties, so writers of ``writeStream`` jobs get it too.
    """
    context = TaskContext.get()
    if context is None:  # called outside a Spark task (tests, local use)
        return TaskInfo(partition=0, attempt=0, batch_id=batch_id)
    if batch_id is None:
        value = context.getLocalProperty(_BATCH_ID_PROPERTY)
        batch_id = int(value) if value else None
    return TaskInfo(
        partition=int(context.partitionId()),
        attempt=int(context.attemptNumber()),
        batch_id=batch_id,
    )


def publish_partition(
    plan: PublishPlan, rows: Iterable[Any], *, batch_id: int | None = None
) -> PartitionStats:
    """Publish one partition's rows (tuples in schema order); return once all are confirmed.

    Runs in the executor's Python worker, on a fresh event loop. An empty
    partition opens no connection.

    Returns:
        The partition's stats; ``error`` is set when a deterministic failure
        (unroutable, unencodable...) stopped it.

    Raises:
        PartitionNotConfirmed: messages stayed unconfirmed after every round.
        BrokerUnavailable: no connection could be had (``PublishUnavailable``
            once the publisher's ``unavailable_timeout`` passed).
    """
    started = time.monotonic()
    task = current_task(batch_id)
    iterator = iter(rows)
    first = next(iterator, _END)
    if first is _END:
        return PartitionStats(task.partition, task.attempt, task.batch_id, 0, 0, 0, 0, 0.0)
    source = itertools.chain((first,), iterator)
    return run_sync(
        lambda: _publish_partition(plan, source, task, started), thread_name="reliable_mq.spark"
    )


_END = object()
_TRACING = Tracing()
"""The executor's global tracer provider: a span per partition only where one is set."""


class _Counters:
    __slots__ = ("confirmed", "republished", "rounds", "rows")

    def __init__(self) -> None:
        self.rows = 0
        self.confirmed = 0
        self.republished = 0
        self.rounds = 0

    def as_attributes(self) -> dict[str, int]:
        return {
            "rows": self.rows,
            "confirmed": self.confirmed,
            "republished": self.republished,
            "rounds": self.rounds,
        }


@dataclass(slots=True)
class _Outcome:
    """How one round ended: what failed (to send again), and why it stopped."""

    failed: list[Prepared] = field(default_factory=list)
    unsent: list[Prepared] = field(default_factory=list)
    deterministic: ReliableMQError | None = None
    unavailable: BrokerUnavailable | None = None
    stop: bool = False

    def record(self, prepared: Prepared, error: ReliableMQError) -> None:
        if isinstance(error, _DETERMINISTIC):
            self.deterministic = self.deterministic or error
            self.stop = True
        elif isinstance(error, BrokerUnavailable):  # PublishUnavailable: the bound passed
            self.unavailable = self.unavailable or error
            self.stop = True
        else:  # nacked, never confirmed, deadline passed: republished in the next round
            self.failed.append(prepared)
            # Feeding more rows into a connection in trouble would only make
            # each of them wait out its own deadline.
            self.stop = True


async def _publish_partition(
    plan: PublishPlan, rows: Iterable[Any], task: TaskInfo, started: float
) -> PartitionStats:
    """The partition's rounds, inside a ``publish_partition`` span when the
    executor has a tracer provider (the chunks' batch spans are its children)."""
    counters = _Counters()
    tracer = _TRACING.tracer()
    span = (
        None
        if tracer is None
        else start_partition(tracer, task.partition, task.attempt, task.batch_id)
    )
    if span is None:
        return await _rounds(plan, rows, task, started, counters)
    with use_span(span):
        try:
            stats = await _rounds(plan, rows, task, started, counters)
        except BaseException as exc:
            partition_ended(span, counters.as_attributes(), exc)
            raise
        partition_ended(span, counters.as_attributes(), stats.error)
        return stats


async def _rounds(
    plan: PublishPlan, rows: Iterable[Any], task: TaskInfo, started: float, counters: _Counters
) -> PartitionStats:
    spec = plan.spec
    encoder = RowEncoder(plan, task)

    def prepared() -> Iterator[Prepared]:
        for row in rows:
            counters.rows += 1
            yield encoder(row)

    fresh = prepared()
    retry: list[Prepared] = []
    connection = spec.connection.model_copy(
        update={"connection_name": f"{spec.connection.connection_name}.p{task.partition}"}
    )
    log = _log.bind(partition=task.partition, task_attempt=task.attempt, batch_id=task.batch_id)
    rounds = 0
    while True:
        rounds += 1
        counters.rounds = rounds
        outcome = _Outcome()
        try:
            async with ReliablePublisher(
                connection, settings=spec.publisher, registry=CollectorRegistry()
            ) as publisher:
                try:
                    await _send(publisher, spec.exchange, itertools.chain(retry, fresh), outcome)
                finally:
                    counters.republished += publisher.stats().republished
                    counters.confirmed += publisher.stats().confirmed
        except BrokerUnavailable as exc:
            # Raised by start(): nothing of this round was read or sent.
            if rounds >= spec.max_task_attempts:
                exc.add_note(
                    f"partition {task.partition}: no connection in {rounds} rounds; "
                    "Spark retries the task"
                )
                raise
            log.warning("spark_round_no_connection", round=rounds, error=str(exc))
            await asyncio.sleep(spec.publisher.backoff(rounds))
            continue
        if outcome.deterministic is not None:
            return _stats(task, counters, rounds, started, outcome.deterministic)
        if outcome.unavailable is not None:
            outcome.unavailable.add_note(
                f"partition {task.partition}: the broker stayed unreachable; "
                f"{counters.confirmed} messages confirmed before. Spark retries the task"
            )
            raise outcome.unavailable
        if not outcome.stop:
            return _stats(task, counters, rounds, started)
        retry = outcome.failed + outcome.unsent
        if rounds >= spec.max_task_attempts:
            first = retry[0].message_id if retry else "-"
            raise PartitionNotConfirmed(
                f"partition {task.partition} (task attempt {task.attempt}): "
                f"{len(retry)} messages still unconfirmed after {rounds} rounds, "
                f"first message_id={first}; Spark retries the task with the same message ids"
            )
        log.warning("spark_round_incomplete", round=rounds, unconfirmed=len(outcome.failed))
        counters.republished += len(outcome.failed)
        await asyncio.sleep(spec.publisher.backoff(rounds))


async def _send(
    publisher: ReliablePublisher, exchange: str, source: Iterator[Prepared], outcome: _Outcome
) -> None:
    """Publish ``source`` with ``publish_many`` in chunks, and sort the outcomes.

    The one place that talks to the publisher. Chunks of ``10 x max_in_flight``
    messages keep memory flat while every message of a chunk stays at hand: a
    failure names its index, and a round must republish the message itself.
    The window drains at each chunk's end (one confirm round trip per chunk).
    A round stops at its first failure (``max_failures=1``); what was not sent
    goes to the next round with the failures.
    """
    size = 10 * publisher.settings.max_in_flight
    while not outcome.stop:
        chunk: list[Prepared] = []
        try:
            chunk.extend(itertools.islice(source, size))
        except InvalidMessage as exc:  # our encoder: null key, NaN, null routing key...
            outcome.deterministic = exc
            outcome.stop = True
        if not chunk:
            return
        try:
            result = await publisher.publish_many(
                (_message(prepared, exchange) for prepared in chunk),
                max_failures=1,
                raise_on_error=False,
            )
        except ReliableMQError as exc:  # the whole call refused: keep every message
            outcome.record(chunk[0], exc)
            outcome.stop = True
            outcome.unsent.extend(chunk[1:])
            return
        for failure in result.failures:
            outcome.record(chunk[failure.index], failure.error)
        if result.stopped_early:
            outcome.stop = True
            outcome.unsent.extend(chunk[result.taken :])
        if len(chunk) < size:
            return


def _message(prepared: Prepared, exchange: str) -> Message:
    return Message(
        body=prepared.body,
        routing_key=prepared.routing_key,
        exchange=exchange,
        message_id=prepared.message_id,
        headers=prepared.headers,
        content_type=prepared.content_type,
    )


def _stats(
    task: TaskInfo,
    counters: _Counters,
    rounds: int,
    started: float,
    error: ReliableMQError | None = None,
) -> PartitionStats:
    return PartitionStats(
        partition=task.partition,
        task_attempt=task.attempt,
        batch_id=task.batch_id,
        rows=counters.rows,
        confirmed=counters.confirmed,
        republished=counters.republished,
        rounds=rounds,
        seconds=time.monotonic() - started,
        error=error,
    )
