"""Fuzz tier, consumer side: random handler behaviour and hostile messages against the real broker.

Each hypothesis example is one consumer run under random settings (ack policy,
MANUAL included; prefetch from 1 to 300; concurrency; batch acks; dedup;
``max_attempts``; tiny retry delays; a short ``handler_timeout``) and a batch
of messages published with raw aio-pika, as another application could send
them: random bodies (valid and invalid for the handler's annotation, deep
JSON, non-UTF-8, larger than the consumer may republish), hostile headers (an
``x-reliable-mq-attempt`` that is negative, a string, huge; odd
``x-delivery-count``; forged reason headers; a header table near
``frame_max``), missing, empty and duplicate message ids. Every message
carries a script of handler behaviour, one step per attempt: return; raise
anything (``RecursionError``, ``MemoryError``, ``CancelledError``,
``GeneratorExit``, a ``BaseException`` of its own, an exception whose
``__str__`` raises...); ``Retry``/``Reject``; sleep past the timeout (and
swallow the cancel); settle by hand twice or in odd orders.

After each run every queue of the topology is drained and
`tests.fuzz.consumer_model.predict` (written from the docs) is the oracle:

* every message ended in exactly one place: handled and acked (the handler's
  own record), the DLQ with the reason headers its script calls for, skipped
  as a duplicate of a handled id (dedup), or, only in runs cut short by
  design, still in the work queue or a retry queue; nothing lost;
* the handler ran at exactly the predicted attempts (a prefix of them when a
  run is cut short or a duplicate id was handled first);
* ``stats()``: every delivery settled exactly once (the settle counters add up
  to ``delivered``, and match the model), ``in_progress == 0``, and the
  consumer's channel reopened as often as the injected faults explain (0
  without faults; 1 for the proxy cut);
* a second manual settle returns False, and no run hangs (each is bounded).

KeyboardInterrupt and SystemExit end the process: they are tested in
``tests/test_consumer_exits.py``, in subprocesses.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import math
import os
import random
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import pytest
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, SecretStr, field_validator

from reliable_mq import ConnectionSettings, PublisherSettings
from reliable_mq.consumer import ConsumerStats, ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.handlers import AckPolicy, Reject, Retry
from reliable_mq.headers import (
    ATTEMPT_HEADER,
    ATTEMPTS_HEADER,
    DEATH_HEADER,
    DELIVERY_COUNT_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    ORIGINAL_EXCHANGE_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
    DeadLetterReason,
)
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology
from tests.fuzz.consumer_model import (
    ERRORS,
    REJECT_REASONS,
    RETRY_DELAYS,
    Act,
    Action,
    Annotation,
    BodyKind,
    Config,
    End,
    MessageSpec,
    Prediction,
    Terminal,
    initial_attempt,
    json_body,
    outcome_of,
    predict,
)

pytestmark = pytest.mark.rabbitmq

URL = "amqp://guest:guest@127.0.0.1:5672/"
COPY_LIMIT = 256 * 1024  # the consumer's publisher refuses copies larger than this
SLEEP = 30.0  # "past the timeout": the watchdog must cut it
RUN_BOUND = 60.0  # no run may take longer (a hang fails the example)
SLEEP_BUDGET = 2.5  # seconds of handler_timeout a run may spend, per handler slot


# -- what handlers raise --------------------------------------------------------------


class Item(BaseModel):
    n: int
    tags: list[str] = []

    @field_validator("n")
    @classmethod
    def _check(cls, value: int) -> int:
        if value == 13:
            raise KeyError("unlucky")  # not a ValueError: pydantic lets it through
        return value


class Opaque:
    """pydantic cannot build a validator for this: bodies fall back to json.loads."""


class FuzzError(Exception):
    """A custom exception."""


class Halt(BaseException):
    """A custom BaseException that is neither an exit nor a cancel."""


class BadStr(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class BadRepr(Exception):
    """An exception that cannot be shown by repr()."""

    def __repr__(self) -> str:
        raise RuntimeError("no repr for you")


_DELAYS: dict[str, Any] = {
    "": None,
    "zero": 0,
    "negative": -1.0,
    "nan": math.nan,
    "inf": math.inf,
    "huge": 1e308,
    "text": "soon",
}
_REASONS: dict[str, Any] = {
    "": "fuzz reject",
    "int": 123,
    "none": None,
    "control": "\x00\x1b[2J\r\n",
    "long": "r" * 5000,
    "badstr": BadStr(),
}
assert set(_DELAYS) == set(RETRY_DELAYS) and set(_REASONS) == set(REJECT_REASONS)


def _recurse(depth: int) -> int:
    return _recurse(depth + 1) + 1


def raise_error(name: str) -> None:
    match name:
        case "ValueError":
            raise ValueError("fuzz")
        case "KeyError":
            raise KeyError("fuzz")
        case "RecursionError":
            _recurse(0)
        case "MemoryError":
            raise MemoryError
        case "FuzzError":
            raise FuzzError("fuzz")
        case "CancelledError":
            raise asyncio.CancelledError("raised by the handler")
        case "GeneratorExit":
            raise GeneratorExit
        case "Halt":
            raise Halt("fuzz")
        case "BadStr":
            raise BadStr
        case "BadRepr":
            raise BadRepr("fuzz")
        case "HugeText":
            raise ValueError("x" * 1_000_000)
        case "ControlChars":
            raise ValueError("\x00\x1b[31mred\r\nnext\x07")
        case "StopIteration":
            raise StopIteration  # a coroutine turns it into RuntimeError (PEP 479)
        case "TimeoutError":
            raise TimeoutError("the handler's own")
        case "ExceptionGroup":
            raise ExceptionGroup("fuzz", [ValueError("a"), KeyError("b")])
    raise AssertionError(name)


# -- strategies -----------------------------------------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=8), c, max_size=3),
    max_leaves=10,
)
_header_values = st.recursive(  # what pamqp (under aio-pika) can send
    st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False, width=32)
    | st.text(max_size=30)
    | st.binary(max_size=30).map(bytearray),  # pamqp sends bytearray, not bytes
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=10), c, max_size=3),
    max_leaves=6,
)
_DEEP = b"[" * 100_000 + b"]" * 100_000


@st.composite
def bodies(draw: st.DrawFn) -> tuple[BodyKind, bytes]:
    kind = draw(
        st.sampled_from([BodyKind.ITEM] * 14 + [BodyKind.OBJECT] * 2 + list(BodyKind)),
    )
    match kind:
        case BodyKind.ITEM:
            n = draw(st.integers(-(2**31), 2**31).filter(lambda v: v != 13))
            body = json_body({"n": n, "tags": draw(st.lists(st.text(max_size=10), max_size=3))})
        case BodyKind.ITEM13:
            body = json_body({"n": 13})
        case BodyKind.OBJECT:
            keys = st.text(max_size=8).map(lambda k: "k" + k)
            body = json_body(draw(st.dictionaries(keys, _json, max_size=4)))
        case BodyKind.ARRAY:
            body = json_body(draw(st.lists(_json, max_size=4)))
        case BodyKind.BAD_JSON:
            body = ("{not json " + draw(st.text(max_size=40))).encode()
        case BodyKind.NON_UTF8:  # no BOM, no NUL up front: json.loads must not guess UTF-16
            body = b"\x80\xfe\x81\xff" + draw(st.binary(max_size=100))
        case BodyKind.DEEP:
            body = _DEEP
        case BodyKind.EMPTY:
            body = b""
        case BodyKind.HUGE:
            body = json_body({"n": 1, "tags": [], "pad": "x" * (COPY_LIMIT + 40_000)})
    return kind, body


_errors = st.sampled_from(sorted(ERRORS))


@st.composite
def actions(draw: st.DrawFn, *, nack: bool = True) -> Action:
    simple = [Act.RETURN] * 6 + [Act.RAISE] * 6 + [Act.RETRY, Act.REJECT, Act.ACK, Act.ACK_TWICE]
    odd = [
        Act.SLEEP,
        Act.SLEEP_SWALLOW,
        Act.ACK_THEN_RAISE,
        Act.ACK_THEN_SLEEP,
        Act.RETRY_THEN_RETURN,
        Act.REJECT_THEN_NACK,
        Act.NACK_DROP,
    ]
    kind = draw(st.sampled_from(simple + odd + ([Act.NACK_THEN] if nack else [])))
    if kind is Act.NACK_THEN:
        return Action(kind, then=draw(actions(nack=False)))
    if kind in (Act.RAISE, Act.ACK_THEN_RAISE):
        return Action(kind, error=draw(_errors))
    if kind in (Act.RETRY, Act.RETRY_THEN_RETURN):
        return Action(kind, arg=draw(st.sampled_from(RETRY_DELAYS)))
    if kind in (Act.REJECT, Act.REJECT_THEN_NACK):
        return Action(kind, arg=draw(st.sampled_from(REJECT_REASONS)))
    return Action(kind)


_attempt_values: list[Any] = [
    -5, 0, "abc", "3", "2", 2**62, bytearray(b"2"), 2.0, True, {"nested": 1}, "", -(2**63)
]  # fmt: skip
_delivery_count_values: list[Any] = [-1, "x", 10**9, 5, 0, bytearray(b"\x00")]
_attempt_headers = st.sampled_from(_attempt_values)
_delivery_counts = st.sampled_from(_delivery_count_values)
_content_types = st.sampled_from(
    [None] * 3 + ["application/json"] * 3 + ["text/plain", "APPLICATION/JSON; x=1"]
)


@st.composite
def messages(draw: st.DrawFn, index: int, earlier_ids: list[str]) -> MessageSpec:
    kind, body = draw(bodies())
    headers: dict[str, Any] = {}
    if draw(st.integers(0, 4)) == 0:
        headers[ATTEMPT_HEADER] = draw(_attempt_headers)
    if draw(st.integers(0, 5)) == 0:
        headers[DELIVERY_COUNT_HEADER] = draw(_delivery_counts)
    if draw(st.integers(0, 8)) == 0:
        headers[REASON_HEADER] = "forged"
        headers[QUEUE_HEADER] = "elsewhere"
    if draw(st.integers(0, 3)) == 0:
        junk = st.text(min_size=1, max_size=12).filter(lambda k: not k.startswith("x-"))
        headers.update(draw(st.dictionaries(junk, _header_values, max_size=4)))
    if draw(st.integers(0, 25)) == 0:
        headers["big"] = "b" * 130_000  # fits a frame; a copy with our headers may not
    id_kind = draw(st.sampled_from(["unique"] * 8 + ["none", "empty", "dup", "odd"]))
    message_id: str | None
    if id_kind == "dup" and earlier_ids:
        message_id = draw(st.sampled_from(earlier_ids))
    elif id_kind == "none":
        message_id = None
    elif id_kind == "empty":
        message_id = ""
    elif id_kind == "odd":
        message_id = "id\x1b[0m\n" + "i" * draw(st.integers(0, 240)) + uuid.uuid4().hex[:4]
    else:
        message_id = f"m{index}-{uuid.uuid4().hex[:8]}"
    script = draw(st.lists(actions(), min_size=1, max_size=3))
    if script[-1].kind is Act.NACK_THEN:  # the last step repeats: end it
        script[-1] = script[-1].then or Action(Act.RETURN)
    properties: dict[str, Any] = {}
    if draw(st.booleans()):
        properties["priority"] = draw(st.integers(0, 9))
        properties["app_id"] = draw(st.text(max_size=20))
        properties["type"] = draw(st.text(max_size=20))
        properties["reply_to"] = draw(st.text(max_size=20))
        properties["timestamp"] = dt.datetime(2020, 1, 1, tzinfo=dt.UTC)
    return MessageSpec(
        key=f"k{index}",
        body_kind=kind,
        body=body,
        content_type=draw(_content_types),
        message_id=message_id,
        headers=headers,
        script=script,
        properties=properties,
    )


@st.composite
def configs(draw: st.DrawFn, policy: AckPolicy | None, *, stop_early: bool = True) -> Config:
    prefetch = draw(st.sampled_from([1, 2, 3, 8, 50, 300]))
    return Config(
        policy=policy or draw(st.sampled_from(list(AckPolicy))),
        annotation=draw(st.sampled_from(list(Annotation))),
        prefetch=prefetch,
        concurrency=draw(st.none() | st.integers(1, 4)),
        batch_ack=draw(st.sampled_from([True, True, False])),  # on by default
        ack_batch_size=draw(st.sampled_from([1, 2, 50])),
        dedup=draw(st.sampled_from([True, True, False])),  # on by default
        max_attempts=draw(st.integers(1, 4)),
        retry_delays=draw(st.sampled_from([(0.05,), (0.05, 0.1), (0.1, 0.05)])),
        handler_timeout=draw(st.sampled_from([0.3, 0.5])),
        stop_early=draw(st.floats(0.0, 0.6))
        if stop_early and draw(st.integers(0, 3)) == 0
        else None,
        grace=draw(st.sampled_from([0.0, 0.2, 5.0])),
    )


class Run:
    """One fuzz example: the settings and the batch (a plain class: hypothesis prints
    dataclasses field by field, bodies included)."""

    def __init__(self, config: Config, batch: list[MessageSpec]) -> None:
        self.config = config
        self.batch = batch

    def __repr__(self) -> str:
        return "\n".join([repr(self.config), *(f"  {m!r}" for m in self.batch)])


def _sleeps(run: Run) -> float:
    """Seconds of handler_timeout the batch would spend, per handler slot."""
    steps = 0
    for message in run.batch:
        prediction = predict(message, run.config)
        first = initial_attempt(message.headers)
        for attempt in set(prediction.runs):
            action = message.script[min(attempt - first, len(message.script) - 1)]
            action = action.then or action
            steps += action.kind in (Act.SLEEP, Act.SLEEP_SWALLOW, Act.ACK_THEN_SLEEP)
    slots = min(run.config.prefetch, run.config.concurrency or run.config.prefetch)
    return steps * run.config.handler_timeout / slots


@st.composite
def runs(
    draw: st.DrawFn,
    policy: AckPolicy | None = None,
    *,
    size: tuple[int, int] = (4, 20),
    stop_early: bool = True,
) -> Run:
    config = draw(configs(policy, stop_early=stop_early))
    batch: list[MessageSpec] = []
    ids: list[str] = []
    for index in range(draw(st.integers(*size))):
        message = draw(messages(index, ids))
        batch.append(message)
        if message.message_id:
            ids.append(message.message_id)
    run = Run(config, batch)
    while _sleeps(run) > SLEEP_BUDGET:  # keep it bounded: turn sleeps into errors
        for message in batch:
            for i, action in enumerate(message.script):
                if (action.then or action).kind in (Act.SLEEP, Act.SLEEP_SWALLOW):
                    message.script[i] = Action(Act.RAISE, error="ValueError")
                    break
            else:
                continue
            break
        else:
            break
    return run


# -- the handler ----------------------------------------------------------------------


@dataclass
class Seen:
    """One handler run, as the handler saw it."""

    attempt: int
    redelivered: bool
    action: Action
    settles: tuple[bool, ...] = ()  # what each manual settle call returned


class Handler:
    """Runs each message's script; records every run."""

    def __init__(self, batch: list[MessageSpec]) -> None:
        self.specs = {m.key: m for m in batch}
        self.first = {m.key: initial_attempt(m.headers) for m in batch}
        self.seen: dict[str, list[Seen]] = collections.defaultdict(list)
        self.aliens: list[str] = []

    def function(self, annotation: Annotation) -> Any:
        if annotation is Annotation.DELIVERY:

            async def only(delivery: Delivery) -> None:
                await self.handle(None, delivery)

            only.__annotations__ = {"delivery": Delivery, "return": None}
            return only
        types: dict[Annotation, Any] = {
            Annotation.MODEL: Item,
            Annotation.DICT: dict,
            Annotation.OPAQUE: Opaque,
            Annotation.STR: str,
            Annotation.BYTES: bytes,
        }

        async def both(body: Any, delivery: Delivery) -> None:
            await self.handle(body, delivery)

        both.__annotations__ = {"body": types[annotation], "delivery": Delivery, "return": None}
        return both

    async def handle(self, body: Any, delivery: Delivery) -> None:
        key = delivery.correlation_id or ""
        spec = self.specs.get(key)
        if spec is None:
            self.aliens.append(repr(delivery))
            return
        script = spec.script
        action = script[min(delivery.attempt - self.first[key], len(script) - 1)]
        seen = Seen(delivery.attempt, delivery.redelivered, action)
        self.seen[key].append(seen)
        if action.kind is Act.NACK_THEN:
            if not delivery.redelivered:
                seen.settles = (await delivery.nack(requeue=True),)
                return
            assert action.then is not None
            action = seen.action = action.then
        await self.perform(action, delivery, seen)

    async def perform(self, action: Action, delivery: Delivery, seen: Seen) -> None:
        match action.kind:
            case Act.RETURN:
                return
            case Act.RAISE:
                raise_error(action.error)
            case Act.RETRY:
                raise Retry("fuzz retry", delay=_DELAYS[action.arg])
            case Act.REJECT:
                raise Reject(_REASONS[action.arg])
            case Act.SLEEP:
                await asyncio.sleep(SLEEP)
            case Act.SLEEP_SWALLOW:
                try:
                    await asyncio.sleep(SLEEP)
                except asyncio.CancelledError:
                    return
            case Act.ACK:
                seen.settles = (await delivery.ack(),)
            case Act.ACK_TWICE:
                seen.settles = (await delivery.ack(), await delivery.ack())
            case Act.ACK_THEN_RAISE:
                seen.settles = (await delivery.ack(),)
                raise_error(action.error)
            case Act.ACK_THEN_SLEEP:
                seen.settles = (await delivery.ack(),)
                await asyncio.sleep(SLEEP)
            case Act.RETRY_THEN_RETURN:
                delay = _DELAYS[action.arg]
                seen.settles = (await delivery.retry("fuzz manual retry", delay=delay),)
            case Act.REJECT_THEN_NACK:
                reason = _REASONS[action.arg]
                seen.settles = (await delivery.reject(reason), await delivery.nack())
            case Act.NACK_DROP:
                seen.settles = (await delivery.nack(requeue=False),)


# -- one run against the broker -----------------------------------------------------


@dataclass
class Found:
    """One message taken out of a queue of the topology after the run."""

    where: End
    headers: dict[str, Any]


class Outcome:
    """What one run left behind."""

    def __init__(self) -> None:
        self.found: dict[str, list[Found]] = collections.defaultdict(list)
        self.strays: list[str] = []
        self.stats: ConsumerStats | None = None
        self.cuts = 0


async def _publish(channel: aio_pika.abc.AbstractChannel, queue: str, m: MessageSpec) -> None:
    message = aio_pika.Message(
        m.body,
        headers=m.headers,
        content_type=m.content_type,
        message_id=m.message_id,
        correlation_id=m.key,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        **m.properties,
    )
    await channel.default_exchange.publish(message, routing_key=queue)


async def _counts(channel: aio_pika.abc.AbstractChannel, queues: tuple[str, ...]) -> int:
    total = 0
    for name in queues:
        declared = await channel.declare_queue(name, passive=True)
        total += declared.declaration_result.message_count or 0
    return total


def _progress(stats: ConsumerStats) -> tuple[int, ...]:
    return (stats.delivered, stats.acked, stats.retried, stats.dead_lettered, stats.requeued)


async def _quiet(consumer: ReliableConsumer, channel: Any, queues: tuple[str, ...]) -> None:
    """Wait until nothing is queued or running, and nothing changed for a while."""
    last: tuple[int, ...] = ()
    calm = 0
    while calm < 3:
        await asyncio.sleep(0.1)
        stats = consumer.stats()
        queued = await _counts(channel, queues)
        now = _progress(stats)
        calm = calm + 1 if not queued and not stats.in_progress and now == last else 0
        last = now


async def _drain(channel: aio_pika.abc.AbstractChannel, name: str) -> list[Any]:
    queue = await channel.get_queue(name, ensure=True)
    out = []
    while (message := await queue.get(no_ack=True, fail=False)) is not None:
        out.append(message)
    return out


def _where(message: Any, topology: QueueTopology, name: str) -> End:
    if name == topology.queue:
        return End.WORK
    if name != topology.dead_letter_queue:
        return End.RETRY
    for death in message.headers.get(DEATH_HEADER) or []:
        if death.get("queue") == topology.queue and death.get("reason") == "rejected":
            return End.BROKER_DLQ
    return End.DLQ


async def _collect(topology: QueueTopology, outcome: Outcome) -> None:
    """Drain retry and work queues until a pass finds nothing (TTLs move messages), then the DLQ."""
    connection = await aio_pika.connect(URL)
    async with connection:
        channel = await connection.channel()
        names = [*topology.retry_queues, topology.queue]
        empty_passes = 0
        while empty_passes < 2:
            got = 0
            for name in names:
                for message in await _drain(channel, name):
                    got += 1
                    _record(outcome, message, _where(message, topology, name))
            empty_passes = 0 if got else empty_passes + 1
            await asyncio.sleep(0.15)  # longer than any retry delay
        for message in await _drain(channel, topology.dead_letter_queue):
            _record(outcome, message, _where(message, topology, topology.dead_letter_queue))


def _record(outcome: Outcome, message: Any, where: End) -> None:
    key = message.correlation_id
    if key is None:
        outcome.strays.append(f"{where}: {message!r:.200}")
        return
    outcome.found[key].append(Found(where, dict(message.headers)))


async def _run(run: Run, *, cuts: int = 0) -> tuple[Handler, Outcome, QueueTopology]:
    config = run.config
    handler = Handler(run.batch)
    outcome = Outcome()
    queue = f"fuzz-consumer-{uuid.uuid4().hex[:10]}"
    topology = QueueTopology(queue, retry_delays=config.retry_delays)
    proxy = TCPProxy("127.0.0.1", 5672) if cuts else None
    try:
        async with asyncio.timeout(RUN_BOUND):
            if proxy is not None:
                await proxy.start()
            url = f"amqp://guest:guest@127.0.0.1:{proxy.port}/" if proxy else URL
            await declare_topology(URL, topology)
            consumer = ReliableConsumer(
                ConnectionSettings(
                    url=SecretStr(url),
                    connection_name=f"fuzz-consumer-{queue[-10:]}",
                    reconnect_initial_delay=0.05,
                    reconnect_max_delay=0.2,
                ),
                publisher_settings=PublisherSettings(
                    max_message_size=COPY_LIMIT, publish_timeout=20
                ),
                registry=CollectorRegistry(),
                dedup="memory" if config.dedup else None,
                prefetch=config.prefetch,
                concurrency=config.concurrency,
                batch_ack=config.batch_ack,
                ack_batch_size=config.ack_batch_size,
                max_attempts=config.max_attempts,
                retry_delays=config.retry_delays,
                handler_timeout=config.handler_timeout,
                shutdown_grace=config.grace,
                republish_timeout=10.0,
                fallback_delay=0.05,
                fallback_max_delay=0.2,
            )
            consumer.add_handler(
                queue, handler.function(config.annotation), ack_policy=config.policy
            )
            connection = await aio_pika.connect(URL)
            async with connection:
                channel = await connection.channel()
                half = len(run.batch) // 2
                for message in run.batch[:half]:  # waiting for the consumer
                    await _publish(channel, queue, message)
                await consumer.start()
                try:
                    for message in run.batch[half:]:  # arriving while it runs
                        await _publish(channel, queue, message)
                    if cuts:
                        await asyncio.sleep(random.Random(queue).uniform(0.05, 0.4))
                        for _ in range(cuts):
                            await proxy.cut()  # type: ignore[union-attr]
                            outcome.cuts += 1
                    if config.stop_early is not None:
                        await asyncio.sleep(config.stop_early)
                    else:
                        await _quiet(consumer, channel, (queue, *topology.retry_queues))
                finally:
                    await consumer.stop()
                await asyncio.sleep(0)  # let the last settles' tasks finish
                outcome.stats = consumer.stats()
            await _collect(topology, outcome)
    finally:
        connection = await aio_pika.connect(URL)
        async with connection:
            await delete_topology(await connection.channel(), topology)
        if proxy is not None:
            await proxy.close()
    return handler, outcome, topology


# -- the oracle -----------------------------------------------------------------------


def _observed(
    message: MessageSpec, seen: list[Seen], found: list[Found], config: Config
) -> list[Terminal]:
    """Where the message ended, as the broker and the handler's own record tell."""
    if found:
        ends = []
        for item in found:
            headers = item.headers
            if item.where is End.DLQ:
                ends.append(
                    Terminal(
                        End.DLQ,
                        str(headers.get(REASON_HEADER, "")),
                        str(headers.get(ERROR_TYPE_HEADER, "")),
                        int(headers.get(ATTEMPTS_HEADER, 0) or 0),
                    )
                )
            else:
                ends.append(Terminal(item.where))
        return ends
    if seen and (
        config.policy is AckPolicy.ACK_FIRST or outcome_of(seen[-1].action, config.policy) == "ack"
    ):
        return [Terminal(End.HANDLED)]
    return [Terminal(End.SKIPPED)]  # nowhere and not handled: skipped (or lost)


def _same(expected: Terminal, got: Terminal, message: MessageSpec, config: Config) -> bool:
    if expected.end is not got.end:
        return False
    if got.end is not End.DLQ:
        return True
    if (expected.reason, expected.attempts) != (got.reason, got.attempts):
        return False
    if expected.reason == DeadLetterReason.INVALID_BODY:
        if message.body_kind is BodyKind.ITEM13 and config.annotation is Annotation.MODEL:
            return got.error_type == "KeyError"
        return bool(got.error_type)
    return expected.error_type == got.error_type


def _our_copy(found: Found, attempts: list[int]) -> bool:
    """A retry-queue copy we made after the last run: the next attempt (a deferral: the same)."""
    headers = found.headers
    if ORIGINAL_EXCHANGE_HEADER not in headers or not attempts:
        return False
    return headers.get(ATTEMPT_HEADER) in (attempts[-1], attempts[-1] + 1)


def _prefix(short: list[int], long: list[int]) -> bool:
    return long[: len(short)] == short


class Verdict:
    """Collects every broken promise of one run (one assertion at the end)."""

    def __init__(self, run: Run, handler: Handler, outcome: Outcome) -> None:
        self.run, self.handler, self.outcome = run, handler, outcome
        self.problems: list[str] = []

    def fail(self, text: str) -> None:
        self.problems.append(text)

    def check(self, *, faults: int = 0) -> None:
        run, handler, outcome = self.run, self.handler, self.outcome
        config = run.config
        cut_short = config.stop_early is not None
        id_counts = collections.Counter(m.message_id or "" for m in run.batch if m.message_id)
        predictions = {m.key: predict(m, config) for m in run.batch}
        handled_ids: set[str] = set()
        skipped = 0
        for message in run.batch:
            seen = handler.seen.get(message.key, [])
            ends = _observed(message, seen, outcome.found.get(message.key, []), config)
            if any(e.end is End.HANDLED for e in ends) and message.message_id:
                handled_ids.add(message.message_id)
        for message in run.batch:
            prediction = predictions[message.key]
            seen = handler.seen.get(message.key, [])
            found = outcome.found.get(message.key, [])
            ends = _observed(message, seen, found, config)
            attempts = [s.attempt for s in seen]
            grouped = config.dedup and id_counts[message.message_id or ""] > 1
            tag = f"{message!r}\n    predicted {prediction.terminal} runs {prediction.runs}"
            tag += f"\n    got {ends} runs {attempts}"
            self._settles(message, seen)
            if faults:
                self._after_faults(message, prediction, ends, attempts, tag)
                continue
            if len(ends) != 1:
                self.fail(f"ended in {len(ends)} places: {tag}")
                continue
            end = ends[0]
            if _same(prediction.terminal, end, message, config):
                if attempts != prediction.runs and not (
                    grouped and _prefix(attempts, prediction.runs)
                ):
                    self.fail(f"runs differ: {tag}")
                continue
            if end.end is End.SKIPPED and config.dedup and not prediction.on_arrival:
                skipped += 1
                if not grouped or message.message_id not in handled_ids:
                    self.fail(f"lost (or skipped with no handled twin): {tag}")
                elif not _prefix(attempts, prediction.runs):
                    self.fail(f"runs differ before the skip: {tag}")
                continue
            if cut_short and end.end in (End.WORK, End.RETRY):
                if not _prefix(attempts, prediction.runs):
                    self.fail(f"runs differ before the stop: {tag}")
                elif end.end is End.RETRY and not _our_copy(found[0], attempts):
                    self.fail(f"a retry queue holds something that is not our next copy: {tag}")
                continue
            self.fail(f"wrong end: {tag}")
        self._effects()
        self._stats(predictions, skipped, faults)
        self._dlq_headers()
        if handler.aliens or outcome.strays:
            self.fail(f"unknown messages: {handler.aliens} {outcome.strays}")
        assert not self.problems, f"{config!r}\n" + "\n".join(self.problems)

    def _after_faults(
        self,
        message: MessageSpec,
        prediction: Prediction,
        ends: list[Terminal],
        attempts: list[int],
        tag: str,
    ) -> None:
        """At least once: every copy ends where the script says; duplicates allowed."""
        config = self.run.config
        if not set(attempts) <= prediction.attempts:
            self.fail(f"ran at an attempt the script never reaches: {tag}")
        for end in ends:
            if _same(prediction.terminal, end, message, config):
                continue
            if end.end is End.SKIPPED and config.dedup:
                continue  # handled before the cut, then redelivered and skipped
            self.fail(f"wrong end after a fault: {tag}")

    def _effects(self) -> None:
        """De-duplication: at most one handler run per message id had its effect acked."""
        config = self.run.config
        if not config.dedup:
            return
        effects: collections.Counter[str] = collections.Counter()
        for message in self.run.batch:
            if not message.message_id:
                continue
            for run in self.handler.seen.get(message.key, []):
                acked = config.policy is AckPolicy.ACK_FIRST
                if acked or outcome_of(run.action, config.policy) == "ack":
                    effects[message.message_id] += 1
        twice = {mid: n for mid, n in effects.items() if n > 1}
        if twice:
            self.fail(f"effects applied more than once under dedup: {twice}")

    def _settles(self, message: MessageSpec, seen: list[Seen]) -> None:
        """A manual settle returns True once (never under ACK_FIRST), then False."""
        for run in seen:
            if not run.settles:
                continue
            if self.run.config.policy is AckPolicy.ACK_FIRST:
                expected = tuple(False for _ in run.settles)
            else:
                expected = (True, *(False for _ in run.settles[1:]))
            if run.settles != expected:
                self.fail(f"manual settles returned {run.settles}, not {expected}: {message!r}")

    def _stats(self, predictions: dict[str, Prediction], skipped: int, faults: int) -> None:
        stats = self.outcome.stats
        assert stats is not None
        if stats.in_progress:
            self.fail(f"in_progress {stats.in_progress} after stop: {stats}")
        if stats.channel_reopens != faults:
            self.fail(f"channel reopened {stats.channel_reopens} times, {faults} faults: {stats}")
        settled = (
            stats.acked
            + stats.retried
            + stats.dead_lettered
            + stats.requeued
            + stats.rejected
            + stats.stale
            + stats.duplicates
            + stats.deferred
        )
        if not faults and settled != stats.delivered:
            self.fail(f"{stats.delivered} deliveries but {settled} settles: {stats}")
        config = self.run.config
        exact = not faults and config.stop_early is None
        if not exact:
            return
        grouped = config.dedup and any(
            n > 1
            for n in collections.Counter(
                m.message_id for m in self.run.batch if m.message_id
            ).values()
        )
        if stats.duplicates != skipped:
            self.fail(f"{skipped} skipped but duplicates={stats.duplicates}: {stats}")
        if grouped:
            return
        want = {
            "delivered": sum(p.delivered for p in predictions.values()),
            "acked": sum(p.acked for p in predictions.values()),
            "retried": sum(p.retried for p in predictions.values()),
            "dead_lettered": sum(p.dead_lettered for p in predictions.values()),
            "requeued": sum(p.requeued for p in predictions.values()),
            "rejected": sum(p.rejected for p in predictions.values()),
            "stale": 0,
            "deferred": 0,
        }
        got = {name: getattr(stats, name) for name in want}
        if got != want:
            self.fail(f"stats differ from the model: want {want}, got {got}")
        fallbacks = sum(p.fallbacks for p in predictions.values())
        big = any(m.big_header for m in self.run.batch)
        if stats.fallbacks < fallbacks or (stats.fallbacks != fallbacks and not big):
            self.fail(f"fallbacks {stats.fallbacks}, model {fallbacks} (big headers: {big})")

    def _dlq_headers(self) -> None:
        """Our DLQ copies: our reason (never a forged one), no broker delivery count, bounded text."""
        for key, found in self.outcome.found.items():
            for item in found:
                if item.where is not End.DLQ:
                    continue
                headers = item.headers
                if DELIVERY_COUNT_HEADER in headers:
                    self.fail(f"{key}: a DLQ copy kept x-delivery-count")
                if headers.get(QUEUE_HEADER) == "elsewhere":
                    self.fail(f"{key}: a forged queue header survived")
                if len(str(headers.get(ERROR_MESSAGE_HEADER, ""))) > 1000:
                    self.fail(f"{key}: an error message over 1,000 characters")


RANDOM = bool(os.environ.get("FUZZ_RANDOM"))
"""CI runs a fixed set of examples; ``FUZZ_RANDOM=1`` explores new ones."""


Test = Callable[..., None]


def _fuzz(examples: int, fixed_seed: int) -> Callable[[Test], Test]:
    """Hypothesis settings of this tier, and (unless FUZZ_RANDOM) a fixed seed.

    A seed per test rather than ``derandomize``: ``derandomize`` seeds from the
    test function, which would give every policy the same draws.
    """
    fixed: dict[str, Any] = {} if RANDOM else {"database": None}
    configured = settings(
        max_examples=examples,
        deadline=None,
        phases=[Phase.explicit, Phase.reuse, Phase.generate],  # no shrinking: a run is big
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        print_blob=True,
        **fixed,
    )

    def apply(test: Test) -> Test:
        return configured(test if RANDOM else seed(fixed_seed)(test))

    return apply


DRY = collections.Counter[str]() if os.environ.get("FUZZ_CONSUMER_DRY") else None
"""``FUZZ_CONSUMER_DRY=1``: only draw the examples and count what they cover (no broker)."""


def _dry(run: Run) -> bool:
    if DRY is None:
        return False
    config = run.config
    ids = collections.Counter(m.message_id for m in run.batch if m.message_id)
    for label in (
        f"policy={config.policy.value}",
        f"annotation={config.annotation.value}",
        f"dedup={config.dedup}",
        f"batch_ack={config.batch_ack}",
        f"stop_early={config.stop_early is not None}",
        f"duplicate_ids={any(n > 1 for n in ids.values())}",
        f"prefetch={config.prefetch}",
        f"max_attempts={config.max_attempts}",
    ):
        DRY[label] += 1
    for message in run.batch:
        terminal = predict(message, config).terminal
        DRY[f"end={terminal.end.value}:{terminal.reason}"] += 1
        prediction = predict(message, config)
        first = initial_attempt(message.headers)
        for attempt in sorted(set(prediction.runs)):  # the steps a run reaches
            action = message.script[min(attempt - first, len(message.script) - 1)]
            DRY[f"reached={action.then or action!r}"] += 1
    print("\n".join(f"{k}: {v}" for k, v in sorted(DRY.items())), end="\n\n")  # noqa: T201
    return True


def catalogue(policy: AckPolicy) -> Run:
    """Every error, action (with each hostile argument), body and hostile header, once.

    Run as an explicit example for each policy, so that CI always covers the
    whole catalogue whatever the seeded draws reach.
    """
    config = Config(
        policy=policy,
        annotation=Annotation.MODEL,
        prefetch=8,
        concurrency=None,
        batch_ack=True,
        ack_batch_size=3,
        dedup=True,
        max_attempts=2,
        retry_delays=(0.05,),
        handler_timeout=0.3,
    )
    item = json_body({"n": 1, "tags": ["a"]})
    scripts: list[list[Action]] = [[Action(Act.RAISE, error=e), Action(Act.RETURN)] for e in ERRORS]
    scripts += [[Action(Act.ACK_THEN_RAISE, error=e)] for e in ("CancelledError", "BadRepr")]
    scripts += [[Action(Act.RETRY, arg=a), Action(Act.RETURN)] for a in RETRY_DELAYS]
    scripts += [[Action(Act.RETRY_THEN_RETURN, arg=a)] for a in RETRY_DELAYS]
    scripts += [[Action(Act.REJECT, arg=a)] for a in REJECT_REASONS]
    scripts += [[Action(Act.REJECT_THEN_NACK, arg=a)] for a in REJECT_REASONS]
    scripts += [
        [Action(kind)]
        for kind in (
            Act.RETURN,
            Act.SLEEP,
            Act.SLEEP_SWALLOW,
            Act.ACK,
            Act.ACK_TWICE,
            Act.ACK_THEN_SLEEP,
            Act.NACK_DROP,
        )
    ]
    scripts.append([Action(Act.NACK_THEN, then=Action(Act.RETURN))])
    batch: list[MessageSpec] = []

    def add(script: list[Action], **fields: Any) -> None:
        index = len(batch)
        message = MessageSpec(
            key=f"k{index}",
            body_kind=fields.pop("body_kind", BodyKind.ITEM),
            body=fields.pop("body", item),
            content_type=fields.pop("content_type", "application/json"),
            message_id=fields.pop("message_id", f"c{index}-{uuid.uuid4().hex[:8]}"),
            headers=fields.pop("headers", {}),
            script=script,
        )
        batch.append(message)

    for script in scripts:
        add(script)
    samples = {
        BodyKind.ITEM13: json_body({"n": 13}),
        BodyKind.OBJECT: json_body({"k": [1, {"x": None}]}),
        BodyKind.ARRAY: json_body([1, "two", 3.0]),
        BodyKind.BAD_JSON: b"{not json",
        BodyKind.NON_UTF8: b"\x80\xfe\x81\xff\x00",
        BodyKind.DEEP: _DEEP,
        BodyKind.EMPTY: b"",
        BodyKind.HUGE: json_body({"n": 1, "pad": "x" * (COPY_LIMIT + 40_000)}),
    }
    for kind, body in samples.items():
        add([Action(Act.RAISE, error="ValueError"), Action(Act.RETURN)], body_kind=kind, body=body)
    add([Action(Act.RETURN)], content_type="text/plain")
    add([Action(Act.RETURN)], content_type=None)
    for value in _attempt_values:
        add([Action(Act.RETRY), Action(Act.RETURN)], headers={ATTEMPT_HEADER: value})
    for value in _delivery_count_values:
        add([Action(Act.RETRY), Action(Act.RETURN)], headers={DELIVERY_COUNT_HEADER: value})
    add([Action(Act.REJECT)], headers={REASON_HEADER: "forged", QUEUE_HEADER: "elsewhere"})
    add([Action(Act.RAISE, error="HugeText")], headers={"big": "b" * 130_000})
    add([Action(Act.RETURN)], message_id=None)
    add([Action(Act.RETURN)], message_id="")
    add([Action(Act.RAISE, error="KeyError"), Action(Act.RETURN)], message_id="twin")
    add([Action(Act.RETURN)], message_id="twin")
    return Run(config, batch)


SEEDS: dict[AckPolicy | None, int] = {
    AckPolicy.RETRY_ON_ERROR: 1,
    AckPolicy.DEAD_LETTER_ON_ERROR: 2,
    AckPolicy.ACK_FIRST: 3,
    AckPolicy.MANUAL: 4,
    None: 5,  # the proxy cut
}


class TestFuzzConsumer:
    @pytest.mark.parametrize("policy", list(AckPolicy))
    def test_every_message_ends_in_one_place(self, broker_url: str, policy: AckPolicy) -> None:
        """Random settings, scripts and hostile messages: each ends where the docs say, once.

        One hypothesis run per ack policy, so that each one is always covered.
        """

        @_fuzz(int(os.environ.get("FUZZ_CONSUMER_EXAMPLES", "4")), SEEDS[policy])
        @example(run=catalogue(policy))
        @given(run=runs(policy))
        def one(run: Run) -> None:
            if _dry(run):
                return
            handler, outcome, _ = asyncio.run(_run(run))
            Verdict(run, handler, outcome).check()

        one()

    @_fuzz(int(os.environ.get("FUZZ_CONSUMER_CUT_EXAMPLES", "3")), SEEDS[None])
    @given(run=runs(size=(8, 20), stop_early=False))
    def test_a_proxy_cut_loses_nothing(self, broker_url: str, run: Run) -> None:
        """The consumer's link is cut mid-run: reopens == cuts, nothing lost, ends as scripted."""
        if _dry(run):
            return
        handler, outcome, _ = asyncio.run(_run(run, cuts=1))
        Verdict(run, handler, outcome).check(faults=outcome.cuts)
