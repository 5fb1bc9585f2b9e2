"""The reference model of the consumer fuzz tier: what should become of one message.

Written from the documented semantics (``docs/failure-semantics.md``, the
``AckPolicy`` and ``Delivery`` docstrings), not from ``reliable_mq._consume.settle``, so
the fuzz checks the library against what it promises. Pure: no I/O.

A message's handler behaviour is a *script*: one `Action` per attempt (the
last one repeats), so "fail twice, then succeed" is ``[raise, raise, return]``.
`predict` walks the attempts the way the docs say the consumer will, and
returns the handler runs it expects (their attempt numbers), the counters it
expects in ``stats()`` and where the message must end (`Terminal`).
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

from reliable_mq.handlers import AckPolicy
from reliable_mq.headers import DeadLetterReason

__all__ = (
    "ERRORS",
    "REJECT_REASONS",
    "RETRY_DELAYS",
    "Act",
    "Action",
    "Annotation",
    "BodyKind",
    "Config",
    "End",
    "MessageSpec",
    "Prediction",
    "Terminal",
    "UNDECODABLE",
    "initial_attempt",
    "json_body",
    "outcome_of",
    "predict",
)


class Annotation(enum.StrEnum):
    """The handler's body annotation (one per run): it picks the decoder."""

    MODEL = "model"  # a pydantic model whose validator raises KeyError for n == 13
    DICT = "dict"
    OPAQUE = "opaque"  # pydantic cannot build a validator: plain json.loads
    STR = "str"
    BYTES = "bytes"
    DELIVERY = "delivery"  # the handler takes only the Delivery


_JSON_ANNOTATIONS = frozenset({Annotation.MODEL, Annotation.DICT, Annotation.OPAQUE})


class BodyKind(enum.StrEnum):
    """What a body is, which says whether each annotation can decode it."""

    ITEM = "item"  # {"n": k, "tags": [...]}, k != 13
    ITEM13 = "item13"  # {"n": 13}: the model's validator raises KeyError
    OBJECT = "object"  # a random JSON object with no "n"
    ARRAY = "array"  # a random JSON array
    BAD_JSON = "bad_json"
    NON_UTF8 = "non_utf8"
    DEEP = "deep"  # a JSON array nested 100,000 deep
    EMPTY = "empty"
    HUGE = "huge"  # a valid item padded past the consumer's own max_message_size


# Which body kinds each JSON annotation decodes (str: UTF-8; bytes/delivery: all).
_DECODES: dict[Annotation, frozenset[BodyKind]] = {
    Annotation.MODEL: frozenset({BodyKind.ITEM, BodyKind.HUGE}),
    Annotation.DICT: frozenset({BodyKind.ITEM, BodyKind.ITEM13, BodyKind.OBJECT, BodyKind.HUGE}),
    Annotation.OPAQUE: frozenset(
        {BodyKind.ITEM, BodyKind.ITEM13, BodyKind.OBJECT, BodyKind.ARRAY, BodyKind.HUGE}
    ),
}


def decodes(annotation: Annotation, body: BodyKind, content_type: str | None) -> bool:
    """True if the handler's annotation accepts this body (else: the DLQ, invalid_body)."""
    if annotation in (Annotation.BYTES, Annotation.DELIVERY):
        return True
    if annotation is Annotation.STR:
        return body is not BodyKind.NON_UTF8
    if content_type is not None and "json" not in content_type.lower():
        return False
    return body in _DECODES[annotation]


class Act(enum.StrEnum):
    """One thing a handler does on one attempt."""

    RETURN = "return"
    RAISE = "raise"  # Action.error names what
    RETRY = "retry"  # raise Retry
    REJECT = "reject"  # raise Reject
    SLEEP = "sleep"  # past handler_timeout: cancelled by the watchdog
    SLEEP_SWALLOW = "sleep_swallow"  # past handler_timeout, swallows the cancel, returns
    ACK = "ack"  # delivery.ack(), return
    ACK_TWICE = "ack_twice"
    ACK_THEN_RAISE = "ack_then_raise"
    ACK_THEN_SLEEP = "ack_then_sleep"  # ack, then sleep past the timeout
    RETRY_THEN_RETURN = "retry_then_return"  # delivery.retry(), return
    REJECT_THEN_NACK = "reject_then_nack"  # delivery.reject(), delivery.nack()
    NACK_DROP = "nack_drop"  # delivery.nack(requeue=False): the broker dead-letters it
    NACK_THEN = "nack_then"  # 1st delivery of an attempt: nack(requeue=True); redelivered: `then`


# What another client can send that AMQP forbids and the broker lets through (a
# string not UTF-8, a timestamp in microseconds) -> the DLQ's error type.
UNDECODABLE: dict[str, str] = {
    "message_id": "UnicodeDecodeError",
    "content_type": "UnicodeDecodeError",
    "header_name": "UnicodeDecodeError",
    "timestamp": "ValueError",
}

# Errors a handler raises: name -> the type name the DLQ headers must show.
ERRORS: dict[str, str] = {
    "ValueError": "ValueError",
    "KeyError": "KeyError",
    "RecursionError": "RecursionError",  # real recursion
    "MemoryError": "MemoryError",
    "FuzzError": "FuzzError",  # a custom Exception subclass
    "CancelledError": "CancelledError",  # raised by the handler itself
    "GeneratorExit": "GeneratorExit",
    "Halt": "Halt",  # a custom BaseException subclass
    "BadStr": "BadStr",  # its __str__ raises
    "BadRepr": "BadRepr",  # its __repr__ raises
    "HugeText": "ValueError",  # a 1 MB message
    "ControlChars": "ValueError",  # NUL, ESC, newlines in the message
    "Surrogate": "ValueError",  # a lone surrogate in the message: not UTF-8, written escaped
    "StopIteration": "RuntimeError",  # PEP 479: a coroutine raising StopIteration
    "TimeoutError": "TimeoutError",  # the handler's own, not the watchdog's
    "ExceptionGroup": "ExceptionGroup",
}


RETRY_DELAYS = ("", "zero", "negative", "nan", "inf", "huge", "text")
"""``Retry(delay=...)`` variants ("": none); "text" is not a number: ``TypeError``."""

REJECT_REASONS = ("", "int", "none", "control", "long", "badstr", "surrogate")
"""``Reject(reason)`` variants ("": a plain string)."""


@dataclass(frozen=True)
class Action:
    kind: Act
    error: str = ""  # for RAISE and ACK_THEN_RAISE: a key of ERRORS
    then: Action | None = None  # for NACK_THEN
    arg: str = ""  # retries: a key of RETRY_DELAYS; rejects: of REJECT_REASONS

    def __repr__(self) -> str:
        if self.kind is Act.NACK_THEN:
            return f"nack_then({self.then!r})"
        detail = self.error or self.arg
        return f"{self.kind.value}({detail})" if detail else self.kind.value


class End(enum.StrEnum):
    """Where a message ends."""

    HANDLED = "handled"  # acked after the handler's effect (ACK_FIRST: acked, handler ran)
    DLQ = "dlq"  # our copy in the DLQ, with reason headers
    BROKER_DLQ = "broker_dlq"  # rejected onto the work queue's DLX: x-death, no reason headers
    SKIPPED = "skipped"  # acked unhandled: its message id was done (dedup)
    WORK = "work"  # still in the work queue (only when a run is cut short)
    RETRY = "retry"  # still in a retry queue (only when a run is cut short)


@dataclass(frozen=True)
class Terminal:
    end: End
    reason: str = ""  # DLQ: x-reliable-mq-reason
    error_type: str = ""  # DLQ: x-reliable-mq-error-type
    attempts: int = 0  # DLQ: x-reliable-mq-attempts


@dataclass
class Config:
    """One fuzz run's consumer settings and handler annotation."""

    policy: AckPolicy
    annotation: Annotation
    prefetch: int
    concurrency: int | None
    batch_ack: bool
    ack_batch_size: int
    dedup: bool
    max_attempts: int
    retry_delays: tuple[float, ...]
    handler_timeout: float
    stop_early: float | None = None  # seconds after start to stop (None: run to the end)
    grace: float = 5.0

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in vars(self).items())
        return f"Config({fields})"


@dataclass
class MessageSpec:
    """One message, published raw; ``key`` (its correlation id) finds its script."""

    key: str
    body_kind: BodyKind
    body: bytes
    content_type: str | None
    message_id: str | None
    headers: dict[str, Any]
    script: list[Action]
    properties: dict[str, Any] = field(default_factory=dict)
    undecodable: str | None = None  # one of UNDECODABLE: sent as raw bytes pamqp cannot decode

    @property
    def big_header(self) -> bool:
        return any(isinstance(v, str) and len(v) > 10_000 for v in self.headers.values())

    def __repr__(self) -> str:
        headers = {k: f"{v!r:.40}" for k, v in self.headers.items()}
        return (
            f"Msg({self.key}, {self.body_kind.value}[{len(self.body)}], ct={self.content_type!r}, "
            f"id={self.message_id!r:.40}, headers={headers}, props={self.properties}, "
            f"script={self.script}, undecodable={self.undecodable})"
        )


@dataclass
class Prediction:
    """What the docs say happens to one message, run to the end."""

    runs: list[int]  # the attempt number of each handler run, in order
    terminal: Terminal
    delivered: int = 0
    acked: int = 0
    retried: int = 0
    dead_lettered: int = 0
    requeued: int = 0
    rejected: int = 0
    fallbacks: int = 0
    on_arrival: bool = False  # ended at its first delivery without a dedup claim

    @property
    def attempts(self) -> set[int]:
        return set(self.runs)


def initial_attempt(headers: dict[str, Any]) -> int:
    """The attempt a raw message runs as: a sane int header, else 1 (docs: hostile headers)."""
    value = headers.get("x-reliable-mq-attempt")
    number: int | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, (str, bytes)):
        try:
            number = int(value)
        except ValueError:
            number = None
    return max(number or 1, 1)


_ACKS = frozenset({Act.ACK, Act.ACK_TWICE, Act.ACK_THEN_RAISE, Act.ACK_THEN_SLEEP})
_RETRIES = frozenset({Act.RETRY, Act.RETRY_THEN_RETURN})
_REJECTS = frozenset({Act.REJECT, Act.REJECT_THEN_NACK})


def outcome_of(action: Action, policy: AckPolicy) -> str:
    """What one handler run asks for: ack, retry, dlq, drop or requeue."""
    return _outcome(action, policy)[0]


def _outcome(action: Action, policy: AckPolicy) -> tuple[str, str, str]:
    """(what, dlq reason, error type) of one handler run (what: see `outcome_of`)."""
    kind = action.kind
    on_error = policy is AckPolicy.DEAD_LETTER_ON_ERROR
    if kind in _ACKS:
        return "ack", "", ""
    if kind is Act.RETURN:
        if policy is AckPolicy.MANUAL:  # returned without settling: a retry
            return "retry", "", ""
        return "ack", "", ""
    if kind in _RETRIES:
        if action.arg == "text":  # Retry(delay="soon") raises TypeError in the handler
            return _outcome(Action(Act.RAISE, error="TypeError"), policy)
        return "retry", "", "Retry"
    if kind in _REJECTS:
        return "dlq", DeadLetterReason.REJECTED, "Reject"
    if kind is Act.NACK_DROP:
        return "drop", "", ""
    if kind is Act.NACK_THEN:  # the run that nacked with requeue (its redelivery runs `then`)
        return "requeue", "", ""
    if kind in (Act.SLEEP, Act.SLEEP_SWALLOW):
        if on_error:
            return "dlq", DeadLetterReason.HANDLER_TIMEOUT, "TimeoutError"
        return "retry", "", "TimeoutError"
    assert kind is Act.RAISE, action
    error_type = ERRORS.get(action.error, action.error)
    if on_error:
        return "dlq", DeadLetterReason.HANDLER_ERROR, error_type
    return "retry", "", error_type


def predict(message: MessageSpec, config: Config) -> Prediction:
    """Where ``message`` ends under ``config``, if nothing cuts the run short."""
    attempt = first = initial_attempt(message.headers)
    huge = message.body_kind is BodyKind.HUGE  # no copy of it can be published
    p = Prediction(runs=[], terminal=Terminal(End.HANDLED))

    def copy_or_broker(end: Terminal) -> Terminal:
        if huge:  # full copy refused, trimmed copy refused: the broker dead-letters it
            p.fallbacks += 2
            p.dead_lettered += 1
            return Terminal(End.BROKER_DLQ)
        if end.end is End.DLQ:
            p.dead_lettered += 1
        else:
            p.retried += 1
        return end

    p.delivered += 1
    if message.undecodable is not None:  # before anything else: the handler never runs
        p.on_arrival = True
        p.terminal = copy_or_broker(
            Terminal(
                End.DLQ,
                DeadLetterReason.INVALID_PROPERTIES,
                UNDECODABLE[message.undecodable],
                attempt,
            )
        )
        return p
    if attempt > config.max_attempts:
        p.on_arrival = True
        p.terminal = copy_or_broker(
            Terminal(End.DLQ, DeadLetterReason.MAX_ATTEMPTS, "max_attempts", attempt)
        )
        return p
    if not decodes(config.annotation, message.body_kind, message.content_type):
        p.terminal = copy_or_broker(Terminal(End.DLQ, DeadLetterReason.INVALID_BODY, "", attempt))
        return p
    if config.policy is AckPolicy.ACK_FIRST:  # acked before the handler: at most once
        p.runs.append(attempt)
        p.acked += 1
        return p
    while True:
        action = message.script[min(attempt - first, len(message.script) - 1)]
        if action.kind is Act.NACK_THEN:
            assert action.then is not None
            p.runs.append(attempt)
            p.requeued += 1
            p.delivered += 1
            action = action.then
        p.runs.append(attempt)
        what, reason, error_type = _outcome(action, config.policy)
        if what == "ack":
            p.acked += 1
            p.terminal = Terminal(End.HANDLED)
            return p
        if what == "drop":
            p.rejected += 1
            p.terminal = Terminal(End.BROKER_DLQ)
            return p
        if what == "dlq":
            p.terminal = copy_or_broker(Terminal(End.DLQ, reason, error_type, attempt))
            return p
        if attempt >= config.max_attempts:
            p.terminal = copy_or_broker(
                Terminal(
                    End.DLQ, DeadLetterReason.MAX_ATTEMPTS, error_type or "max_attempts", attempt
                )
            )
            return p
        terminal = copy_or_broker(Terminal(End.RETRY))
        if terminal.end is End.BROKER_DLQ:
            p.terminal = terminal
            return p
        attempt += 1
        p.delivered += 1


def json_body(value: Any) -> bytes:
    return json.dumps(value).encode()
