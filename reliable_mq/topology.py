"""Declare a work queue with its delayed-retry queues and its dead-letter queue.

For a work queue ``orders`` with retry delays 1 s, 5 s and 30 s:

```
orders              the work queue (x-dead-letter-exchange → orders.dlq, a safety net
                    for plain rejects)
orders.retry.1s     x-message-ttl 1000, dead-letters back to "orders"
orders.retry.5s     x-message-ttl 5000, dead-letters back to "orders"
orders.retry.30s    x-message-ttl 30000, dead-letters back to "orders"
orders.dlq          where poison and malformed messages end, with reason headers
```

A failed message is republished (with confirms) to the retry queue of its
attempt; the broker expires it after the TTL and dead-letters it through the
default exchange back to the work queue. Every queue holds one delay, so
expiry is FIFO and exact (per-message TTLs in one queue would block behind the
head). For quorum queues every queue is a quorum queue and the retry queues
dead-letter ``at-least-once`` (which needs ``x-overflow: reject-publish``), so
the hop back cannot lose a message.

A stream (`declare_stream`, `StreamSpec`: re-exported from
`reliable_mq.streams`) is declared with its retention instead: it has no retry
queues or DLQ, since nothing is rejected or requeued in a stream.
"""

from __future__ import annotations

import contextlib
import enum
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from ._amqp import (
    AMQP_ERRORS,
    Channel,
    ChannelOpener,
    Fault,
    FaultKind,
    Link,
    UserChannel,
    UserConnection,
    classify,
    inequivalence,
    is_user_channel,
    user_channel,
    user_connection,
)
from .connection import ConnectionSupervisor
from .errors import ConsumerError
from .metrics import Metrics
from .settings import ConnectionSettings

# Re-exported (explicitly, for mypy), documented in reliable_mq.streams: not in __all__.
from .streams import StreamSpec as StreamSpec  # noqa: PLC0414
from .streams import declare_stream as declare_stream  # noqa: PLC0414

__all__ = (
    "QueueCheck",
    "QueueTopology",
    "QueueType",
    "declare_topology",
    "delete_topology",
    "prepare_topology",
)


class QueueType(enum.StrEnum):
    """The RabbitMQ queue type to declare."""

    CLASSIC = "classic"
    """Classic durable queues; redeliveries only show as the ``redelivered`` flag."""
    QUORUM = "quorum"
    """Replicated quorum queues; the broker counts deliveries in ``x-delivery-count``."""


def _delay_label(seconds: float) -> str:
    return f"{seconds:g}s"


@dataclass(frozen=True)
class QueueTopology:
    """The queues that serve one work queue.

    Attributes:
        queue: the work queue name.
        queue_type: classic or quorum (applies to every queue of the set).
        retry_delays: seconds before attempt 2, 3, ...; the last one repeats.
        dead_letter_queue: the DLQ name (default ``{queue}.dlq``).
        arguments: extra ``x-`` arguments for the work queue only.
    """

    queue: str
    queue_type: QueueType = QueueType.CLASSIC
    retry_delays: tuple[float, ...] = (1.0, 5.0, 30.0)
    dead_letter_queue: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.queue:
            raise ValueError("queue name must not be empty")
        if not self.retry_delays or any(d <= 0 for d in self.retry_delays):
            raise ValueError("retry_delays must be a non-empty list of positive seconds")
        if not self.dead_letter_queue:
            object.__setattr__(self, "dead_letter_queue", f"{self.queue}.dlq")
        object.__setattr__(self, "queue_type", QueueType(self.queue_type))

    def retry_queue(self, delay: float) -> str:
        """The retry queue name for ``delay`` seconds."""
        return f"{self.queue}.retry.{_delay_label(delay)}"

    def retry_queue_for(self, failed_attempt: int) -> tuple[str, float]:
        """The retry queue (and its delay) after attempt ``failed_attempt`` failed."""
        index = min(max(failed_attempt, 1) - 1, len(self.retry_delays) - 1)
        delay = self.retry_delays[index]
        return self.retry_queue(delay), delay

    def nearest_retry_queue(self, delay: float) -> tuple[str, float]:
        """The declared retry queue whose delay is closest to ``delay``."""
        best = min(self.retry_delays, key=lambda d: abs(d - delay))
        return self.retry_queue(best), best

    @property
    def retry_queues(self) -> tuple[str, ...]:
        """Every retry queue name, one per distinct delay."""
        return tuple(self.retry_queue(d) for d in sorted(set(self.retry_delays)))

    @property
    def all_queues(self) -> tuple[str, ...]:
        """The work queue, every retry queue and the DLQ."""
        return (self.queue, *self.retry_queues, self.dead_letter_queue)

    @property
    def side_queues(self) -> tuple[str, ...]:
        """The queues the library owns: the DLQ and every retry queue."""
        return (self.dead_letter_queue, *self.retry_queues)

    def _type_args(self) -> dict[str, Any]:
        if self.queue_type is QueueType.QUORUM:
            return {"x-queue-type": "quorum"}
        return {}

    def work_queue_arguments(self) -> dict[str, Any]:
        return {
            **self._type_args(),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.dead_letter_queue,
            **self.arguments,
        }

    def retry_queue_arguments(self, delay: float) -> dict[str, Any]:
        args: dict[str, Any] = {
            **self._type_args(),
            "x-message-ttl": max(1, round(delay * 1000)),
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": self.queue,
        }
        if self.queue_type is QueueType.QUORUM:
            args["x-dead-letter-strategy"] = "at-least-once"
            args["x-overflow"] = "reject-publish"
        return args

    def dead_letter_queue_arguments(self) -> dict[str, Any]:
        return self._type_args()


async def declare_topology(
    target: UserChannel | str | ConnectionSettings, topology: QueueTopology | str
) -> None:
    """Declare (idempotently) every queue of ``topology``, all durable.

    Args:
        target: an open aio-pika channel, or where to connect: an AMQP URL
            (several, comma separated, fail over) or
            [`ConnectionSettings`][reliable_mq.settings.ConnectionSettings]; a
            connection is then opened for the declaration and closed again.
        topology: the queue set, or just the work queue's name for the
            defaults (the same set a `ReliableConsumer` with default settings
            declares).

    Raises:
        ConsumerError: a queue exists with other arguments, or the broker refused
            the declaration (when called with a channel, the broker has closed it).
        BrokerUnavailable: ``target`` is a URL and no broker accepted a connection.
    """
    if isinstance(topology, str):
        topology = QueueTopology(topology)
    if is_user_channel(target):
        await _declare_refused(await user_channel(target), topology)
        return
    async with _connection(target) as link:
        channel = await link.channel()
        try:
            await _declare_refused(channel, topology)
        finally:
            await channel.close()


async def _declare_refused(channel: Channel, topology: QueueTopology) -> None:
    """`_declare_all`, a refusal raised as `ConsumerError`."""
    try:
        await _declare_all(channel, topology)
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None or not fault.refusal:
            raise
        raise ConsumerError(
            f"cannot declare the queues of {topology.queue!r}: {fault.describe()}"
        ) from None


async def _declare_all(channel: Channel, topology: QueueTopology) -> None:
    await channel.declare_queue(
        topology.dead_letter_queue, durable=True, arguments=topology.dead_letter_queue_arguments()
    )
    for delay in sorted(set(topology.retry_delays)):
        await channel.declare_queue(
            topology.retry_queue(delay),
            durable=True,
            arguments=topology.retry_queue_arguments(delay),
        )
    await channel.declare_queue(
        topology.queue, durable=True, arguments=topology.work_queue_arguments()
    )


async def delete_topology(channel: UserChannel, topology: QueueTopology) -> None:
    """Delete every queue of ``topology`` (their messages are lost; for tests and tooling).

    Args:
        channel: an open aio-pika channel.
        topology: the queue set.
    """
    ours = await user_channel(channel)
    for name in topology.all_queues:
        await ours.delete_queue(name)


# -- bring your own queue --------------------------------------------------------------

_LEARN_ROUNDS = 16
"""Redeclares at most, to learn an adopted queue's arguments (RabbitMQ compares ~15)."""


@dataclass(frozen=True)
class QueueCheck:
    """What [`prepare_topology`][reliable_mq.topology.prepare_topology] found.

    Attributes:
        queue: the work queue.
        messages: messages ready in the work queue when it was checked.
        consumers: consumers the work queue had when it was checked.
        adopted: the work queue already existed with other arguments than the
            consumer would declare, and is used as it is.
        difference: the broker's reason for the difference (``""`` unless adopted).
        missing: what the adopted queue's own arguments do not give, in one
            sentence (``""`` when nothing is known to be missing).
        arguments: the adopted queue's own ``x-`` arguments, as far as RabbitMQ
            compares them on a redeclare (learnt from its refusals); ``None``
            if not adopted or not learnt. Policies never show here.
    """

    queue: str
    messages: int = 0
    consumers: int = 0
    adopted: bool = False
    difference: str = ""
    missing: str = ""
    arguments: dict[str, Any] | None = field(default=None, hash=False)

    def warning(self, topology: QueueTopology) -> str:
        """The one warning to log for an adopted queue (``""`` if not adopted)."""
        if not self.adopted:
            return ""
        text = (
            f"queue {self.queue!r} exists with other arguments and is used as it is "
            f"(broker: {self.difference}). Retries ({', '.join(topology.retry_queues)}) and "
            f"dead letters ({topology.dead_letter_queue}) still work: they are published "
            "with confirms, and reliable_mq never rejects a message of this queue (when a "
            "copy cannot be published, the message is requeued later instead)."
        )
        return f"{text} Missing: {self.missing}" if self.missing else text


@dataclass
class _Learnt:
    """An adopted work queue's declaration, as learnt from the broker's refusals."""

    arguments: dict[str, Any]
    durable: bool = True
    auto_delete: bool = False
    complete: bool = False


async def _learn_queue(connection: ChannelOpener, topology: QueueTopology, fault: Fault) -> _Learnt:
    """Redeclare with each value a refusal names until the broker accepts the declaration.

    A 406 names one differing argument at a time, with the queue's value. An
    accepted redeclare is a no-op on an existing queue, and then every argument
    RabbitMQ compares is known. Passive declares say nothing about arguments,
    and policies show in neither.
    """
    learnt = _Learnt(dict(topology.work_queue_arguments()))
    for _ in range(_LEARN_ROUNDS):
        found = inequivalence(fault)
        if found is None:
            return learnt
        if found.argument in ("durable", "auto_delete"):
            setattr(learnt, found.argument, bool(found.value))
        elif not found.present:
            learnt.arguments.pop(found.argument, None)
        else:
            learnt.arguments[found.argument] = found.value
        _, refused = await _declare_one(
            connection,
            topology.queue,
            arguments=learnt.arguments,
            durable=learnt.durable,
            auto_delete=learnt.auto_delete,
        )
        if refused is None:
            learnt.complete = True
            return learnt
        if refused.reply_code != 406:
            return learnt
        fault = refused
    return learnt


def _policy_hint(topology: QueueTopology) -> str:
    dlq = topology.dead_letter_queue
    policy = (
        f"rabbitmqctl set_policy {topology.queue}-dlx '^{re.escape(topology.queue)}$' "
        f'\'{{"dead-letter-exchange":"","dead-letter-routing-key":"{dlq}"}}\' --apply-to queues'
    )
    return (
        f"Add one without redeclaring the queue with a policy: {policy} (a policy does not "
        "show in a declaration, so this check cannot see it: the warning stays after that)"
    )


def _missing_safety_net(learnt: _Learnt, fault: Fault, topology: QueueTopology) -> str:
    if not learnt.complete:
        return _first_difference(fault, topology)
    arguments, dlq = learnt.arguments, topology.dead_letter_queue
    missing = []
    exchange = arguments.get("x-dead-letter-exchange")
    if exchange is None:
        losses = ["another client rejects without requeue"]
        limited = "x-max-length" in arguments or "x-max-length-bytes" in arguments
        if limited and arguments.get("x-overflow", "drop-head") == "drop-head":
            losses.append("its length limit pushes out")
        if "x-message-ttl" in arguments:
            losses.append("outlives its x-message-ttl")
        missing.append(
            f"it has no dead-letter exchange, so a message that {' or '.join(losses)} is "
            f"dropped instead of reaching {dlq}. " + _policy_hint(topology)
        )
    elif (exchange, arguments.get("x-dead-letter-routing-key")) != ("", dlq):
        key = arguments.get("x-dead-letter-routing-key")
        where = f"exchange {exchange!r}" + (f" with routing key {key!r}" if key else "")
        missing.append(
            f"it dead-letters to {where}, so messages rejected without requeue go there, "
            f"not to {dlq}"
        )
    if not learnt.durable:
        missing.append("it is not durable: it and its messages are lost when the broker restarts")
    kind = arguments.get("x-queue-type", QueueType.CLASSIC.value)
    if kind != topology.queue_type.value:
        missing.append(f"its type is {kind}, not {topology.queue_type.value}")
    return "; ".join(missing)


def _first_difference(fault: Fault, topology: QueueTopology) -> str:
    """What the one argument the refusal names does not give (when the rest is unknown)."""
    found = inequivalence(fault)
    if found is None:
        return ""
    argument, current = found.argument, found.text
    dlq = topology.dead_letter_queue
    if argument == "x-dead-letter-exchange" and current == "none":
        return (
            "it has no dead-letter exchange, so a message another client rejects without "
            f"requeue is dropped instead of reaching {dlq}. " + _policy_hint(topology)
        )
    if argument in ("x-dead-letter-exchange", "x-dead-letter-routing-key"):
        return (
            f"its {argument} is {current}, so messages rejected without requeue go there, "
            f"not to {dlq}"
        )
    if argument == "durable":
        return "it is not durable: it and its messages are lost when the broker restarts"
    if argument == "x-queue-type":
        return f"its type is {current}, not {topology.queue_type.value}"
    return ""


async def _declare_one(
    connection: ChannelOpener,
    name: str,
    *,
    passive: bool = False,
    arguments: dict[str, Any] | None = None,
    durable: bool = True,
    auto_delete: bool = False,
) -> tuple[tuple[int, int] | None, Fault | None]:
    """Declare ``name`` on a channel of its own: ((messages, consumers), None) or (None, refusal)."""
    channel = await connection.channel()
    try:
        info = await channel.declare_queue(
            name, durable=durable, auto_delete=auto_delete, passive=passive, arguments=arguments
        )
    except AMQP_ERRORS as exc:
        fault = classify(exc)
        if fault is None or not fault.refusal:
            raise
        return None, fault
    finally:
        await channel.close()
    return (info.messages, info.consumers), None


async def prepare_topology(
    connection: Link | UserConnection,
    topology: QueueTopology,
    *,
    declare: bool = True,
    queue_only: bool = False,
) -> QueueCheck:
    """Make ``topology`` ready to consume, using a work queue that exists as it is.

    With ``declare`` (the consumer's default) the DLQ and the retry queues are
    declared, then the work queue. A work queue that already exists with other
    arguments (declared by another application, without the dead-letter
    arguments) is not an error: it is checked with a passive declare and used
    as it is. Its own arguments are then learnt by redeclaring it with the
    value each refusal names, until the broker accepts (a no-op on an existing
    queue), and the result says what they do not give
    ([`QueueCheck.warning`][reliable_mq.topology.QueueCheck.warning]). Retry
    queues dead-letter back to it through the default exchange whatever its
    arguments are. Policies are invisible to declarations: a dead-letter
    exchange given by a policy is not seen.

    Without ``declare`` nothing is created: every queue of the set must exist
    (passive declares), or this raises. Without retry queues and a DLQ a failing
    handler's message would have nowhere to go.

    With ``queue_only`` only the work queue is checked, passively: it is
    consumed as it is, with no retry queues or DLQ.

    Every declaration runs on a channel of its own (a refusal closes it).

    Args:
        connection: an open aio-pika connection (or one of reliable_mq's own).
        topology: the queue set.
        declare: declare what is missing (else only check that it exists).
        queue_only: only check, passively, that the work queue exists.

    Raises:
        ConsumerError: a queue is missing (``declare=False``), a retry queue or the
            DLQ exists with other arguments, or the broker refused a declaration;
            the message names the queue and what to do.
    """
    opener = connection if isinstance(connection, Link) else user_connection(connection)
    if queue_only:
        counts, fault = await _declare_one(opener, topology.queue, passive=True)
        if fault is not None or counts is None:
            if fault is not None and fault.kind is not FaultKind.NOT_FOUND:
                raise ConsumerError(f"cannot check queue {topology.queue!r}: {fault.describe()}")
            raise ConsumerError(f"queue {topology.queue!r} does not exist")
        return QueueCheck(topology.queue, *counts)
    if not declare:
        return await _check_existing(opener, topology)
    side = [(topology.dead_letter_queue, topology.dead_letter_queue_arguments())] + [
        (topology.retry_queue(d), topology.retry_queue_arguments(d))
        for d in sorted(set(topology.retry_delays))
    ]
    for name, arguments in side:
        _, fault = await _declare_one(opener, name, arguments=arguments)
        if fault is not None:
            raise ConsumerError(
                f"cannot declare {name!r}, a queue of {topology.queue!r}'s set: "
                f"{fault.describe()}. It exists with other arguments: declared with other "
                "retry delays, queue type or DLQ name? Delete it (`reliable-mq topology "
                f"{topology.queue} --delete`) or use the same settings"
            )
    counts, fault = await _declare_one(
        opener, topology.queue, arguments=topology.work_queue_arguments()
    )
    if fault is None:
        assert counts is not None
        return QueueCheck(topology.queue, *counts)
    if fault.reply_code != 406:
        raise ConsumerError(f"cannot declare queue {topology.queue!r}: {fault.describe()}")
    counts, passive_fault = await _declare_one(opener, topology.queue, passive=True)
    if passive_fault is not None or counts is None:
        reason = passive_fault.describe() if passive_fault else fault.describe()
        raise ConsumerError(f"cannot use queue {topology.queue!r}: {reason}")
    learnt = await _learn_queue(opener, topology, fault)
    return QueueCheck(
        topology.queue,
        *counts,
        adopted=True,
        difference=fault.reply_text.removeprefix("PRECONDITION_FAILED - "),
        missing=_missing_safety_net(learnt, fault, topology),
        arguments=learnt.arguments if learnt.complete else None,
    )


async def _check_existing(connection: ChannelOpener, topology: QueueTopology) -> QueueCheck:
    counts: tuple[int, int] | None = None
    missing: list[str] = []
    for name in topology.all_queues:
        found, fault = await _declare_one(connection, name, passive=True)
        if fault is not None and fault.kind is not FaultKind.NOT_FOUND:
            raise ConsumerError(f"cannot check queue {name!r}: {fault.describe()}")
        if found is None:
            missing.append(name)
        elif name == topology.queue:
            counts = found
    if topology.queue in missing:
        raise ConsumerError(
            f"queue {topology.queue!r} does not exist (declare=False): create it, or let the "
            "consumer declare it (declare=True)"
        )
    if missing:
        delays = ",".join(f"{d:g}" for d in topology.retry_delays)
        raise ConsumerError(
            f"declare=False, but {', '.join(missing)} do(es) not exist: a failing message "
            f"of {topology.queue!r} would have nowhere to go. Declare them first with "
            f"`reliable-mq topology {topology.queue} --retry-delays {delays}` (or "
            "declare_topology()), or let the consumer declare them (declare=True)"
        )
    assert counts is not None
    return QueueCheck(topology.queue, *counts)


@contextlib.asynccontextmanager
async def _connection(settings: str | ConnectionSettings) -> AsyncIterator[Link]:
    settings = ConnectionSettings.of(settings)
    supervisor = ConnectionSupervisor(
        settings, role="topology", metrics=Metrics.on(CollectorRegistry())
    )
    await supervisor.start()
    try:
        yield await supervisor.wait_connected()
    finally:
        await supervisor.close()
