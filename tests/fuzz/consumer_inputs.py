"""Inputs of the consumer fuzz tier: runs, messages, handler scripts, and how a handler plays them.

A `Run` is one consumer's settings and a batch of messages published raw. The
strategies draw them; `catalogue` builds one by hand with every error, action,
body and hostile header once. `Handler` is the handler under test: it finds a
message's script by its correlation id and plays the step of its attempt,
recording every run (`Seen`).
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import math
import uuid
from dataclasses import dataclass, replace
from typing import Any

from hypothesis import strategies as st
from pydantic import BaseModel, field_validator

from reliable_mq.delivery import Delivery
from reliable_mq.handlers import AckPolicy, Reject, Retry
from reliable_mq.headers import (
    ATTEMPT_HEADER,
    DELIVERY_COUNT_HEADER,
    QUEUE_HEADER,
    REASON_HEADER,
)
from tests.fuzz.consumer_model import (
    ERRORS,
    REJECT_REASONS,
    RETRY_DELAYS,
    UNDECODABLE,
    Act,
    Action,
    Annotation,
    BodyKind,
    Config,
    MessageSpec,
    initial_attempt,
    json_body,
    predict,
)
from tests.support.amqp import MARK, PLACEHOLDER_TIME

__all__ = (
    "COPY_LIMIT",
    "Handler",
    "Run",
    "Seen",
    "catalogue",
    "runs",
)

COPY_LIMIT = 256 * 1024  # the consumer's publisher refuses copies larger than this
SLEEP = 30.0  # "past the timeout": the watchdog must cut it
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
    "surrogate": "lone \udfff surrogate",
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
        case "Surrogate":
            raise ValueError("lone \ud800 surrogate")
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
    message = MessageSpec(
        key=f"k{index}",
        body_kind=kind,
        body=body,
        content_type=draw(_content_types),
        message_id=message_id,
        headers=headers,
        script=script,
        properties=properties,
    )
    if draw(st.integers(0, 12)) == 0:
        return spoil(message, draw(st.sampled_from(list(UNDECODABLE))))
    return message


def spoil(message: MessageSpec, what: str) -> MessageSpec:
    """``message`` with ``what`` (a key of `UNDECODABLE`) as bytes pamqp cannot decode.

    Its id is made unique (it never goes through de-duplication, so a duplicate
    of it would be handled, not skipped).
    """
    message_id = f"u{message.key}-{uuid.uuid4().hex[:8]}"
    headers, properties = dict(message.headers), dict(message.properties)
    content_type = message.content_type
    match what:
        case "message_id":
            message_id = f"{message_id}-{MARK}"
        case "content_type":
            content_type = MARK
        case "header_name":
            headers[MARK] = 1
        case "timestamp":
            properties["timestamp"] = PLACEHOLDER_TIME
    return replace(
        message,
        message_id=message_id,
        headers=headers,
        properties=properties,
        content_type=content_type,
        undecodable=what,
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
        if message.message_id and message.undecodable is None:
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
    for what in UNDECODABLE:
        add([Action(Act.RETURN)])
        batch[-1] = spoil(batch[-1], what)
    add([Action(Act.RETURN)], body_kind=BodyKind.HUGE, body=samples[BodyKind.HUGE])
    batch[-1] = spoil(batch[-1], "header_name")  # no copy: the broker dead-letters it as is
    return Run(config, batch)
