"""Handler registration, body decoding by annotation, ack policies and handler signals.

A handler is an ``async def`` taking the decoded body, optionally followed by the
[`Delivery`][reliable_mq.delivery.Delivery]:

```python
@router.handler("orders")
async def on_order(order: Order, delivery: Delivery) -> None: ...
```

It may also be a plain ``def`` with the same signatures: the consumer runs it in
a bounded thread pool of its own (see `reliable_mq._consume.threads`). A plain ``def``
cannot use ``AckPolicy.MANUAL``: it steers the outcome by returning or raising.

The body's annotation picks the decoder: a pydantic model (JSON, validated),
``dict``/``list`` or any other type pydantic can validate (JSON), ``str``
(UTF-8), ``bytes`` or no annotation (raw). A body that fails to decode is
dead-lettered at once with the error in its headers; the handler never runs.
That holds whatever the decoder raises (a validator's own ``KeyError``, JSON
nested too deeply); only a ``MemoryError`` is retried instead.

A batch handler (`Router.batch_handler`) takes a list instead: ``list[Model]``,
``list[bytes]``, ``list[Delivery]``, or ``(bodies, deliveries)``; it fails single
messages of its batch by raising `BatchFailed`.

Handlers steer the outcome by raising `Retry` (delayed retry) or
`Reject` (dead-letter now). These are control-flow signals, not errors:
they do not derive from [`ReliableMQError`][reliable_mq.errors.ReliableMQError].
"""

from __future__ import annotations

import enum
import inspect
import json
import math
import typing
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypedDict, TypeVar, Unpack

from pydantic import BaseModel, TypeAdapter, ValidationError

from .dedup.base import DedupStore
from .delivery import Delivery
from .topology import QueueType

__all__ = (
    "AckPolicy",
    "AsyncHandlerFunc",
    "BatchFailed",
    "BatchOptions",
    "BodyDecodeError",
    "HandlerDedup",
    "HandlerFunc",
    "HandlerOptions",
    "HandlerSpec",
    "Reject",
    "Retry",
    "Router",
    "SyncHandlerFunc",
    "USE_CONSUMER_DEDUP",
    "UseConsumerDedup",
    "decoder_for",
)

AsyncHandlerFunc = Callable[..., Awaitable[None]]
"""An ``async def`` handler: ``(body)``, ``(body, delivery)`` or ``(delivery)``."""

SyncHandlerFunc = Callable[..., None]
"""A plain ``def`` handler, with the same signatures; it runs in a thread of the consumer."""

HandlerFunc = AsyncHandlerFunc | SyncHandlerFunc
"""Either kind of handler."""


_F = TypeVar("_F", bound=HandlerFunc)


class UseConsumerDedup(enum.Enum):
    """The type of `USE_CONSUMER_DEDUP`."""

    TOKEN = "use-consumer-dedup"

    def __repr__(self) -> str:
        return "USE_CONSUMER_DEDUP"


USE_CONSUMER_DEDUP = UseConsumerDedup.TOKEN
"""A handler's ``dedup`` default: use the consumer's store (``None`` turns it off)."""

HandlerDedup = DedupStore | None | UseConsumerDedup


class Retry(Exception):
    """Raise in a handler to retry the message later (delayed, counted as an attempt).

    Args:
        reason: recorded in the logs and, if attempts run out, in the DLQ headers.
        delay: seconds; overrides the configured delay for this attempt (rounded
            to the nearest declared retry queue).

    Raises:
        TypeError: ``delay`` is not a number (the handler then fails with it,
            and is retried as for any error).
    """

    def __init__(self, reason: str = "retry requested", *, delay: float | None = None) -> None:
        if delay is not None and (isinstance(delay, bool) or not isinstance(delay, (int, float))):
            raise TypeError(f"Retry delay must be a number of seconds, not {delay!r:.50}")
        super().__init__(reason)
        self.reason = reason
        self.delay = delay


class Reject(Exception):
    """Raise in a handler to dead-letter the message now, without retries.

    Args:
        reason: recorded in the DLQ headers.
    """

    def __init__(self, reason: str = "rejected by handler") -> None:
        super().__init__(reason)
        self.reason = reason


class BatchFailed(Exception):
    """Raise in a batch handler to fail some messages of its batch; the rest are acked.

    Each failed message goes down the usual ladder on its own, by its exception:
    `Retry` and `Reject` as signals, any other exception as a handler error (a
    delayed retry, then the DLQ, per the ack policy).

    Args:
        failures: the failed messages, each by its index in the list the handler
            got (an ``int``) or by its ``message_id`` (a ``str``), with its exception.
            A key that names no message of the batch fails the whole batch (it
            cannot be known which message failed).
    """

    def __init__(self, failures: Mapping[int | str, BaseException]) -> None:
        self.failures = dict(failures)
        super().__init__(f"{len(self.failures)} message(s) of the batch failed")

    def __reduce__(self) -> tuple[type[BatchFailed], tuple[dict[int | str, BaseException]]]:
        return type(self), (self.failures,)


class BodyDecodeError(Exception):
    """The body does not match the handler's annotation (bad JSON, schema, content type)."""


class AckPolicy(enum.StrEnum):
    """What the consumer does with a delivery when its handler ends."""

    RETRY_ON_ERROR = "retry_on_error"
    """Default. Return: ack. Any exception (or a timeout): delayed retry, then the
    DLQ after ``max_attempts``. ``Reject``: the DLQ at once."""
    DEAD_LETTER_ON_ERROR = "dead_letter_on_error"
    """Return: ack. ``Retry``: delayed retry. Any other exception: the DLQ at once."""
    ACK_FIRST = "ack_first"
    """At-most-once: ack before the handler runs; a failure is only logged."""
    MANUAL = "manual"
    """The handler settles with ``delivery.ack()`` / ``retry()`` / ``reject()``;
    returning without settling is treated as a retry (with a warning), an
    exception as under ``RETRY_ON_ERROR``. ``async def`` handlers only: a plain
    ``def`` cannot await the settle (refused at registration with ``TypeError``)."""


_JSON_MARKERS = ("json",)


def _check_json_content_type(content_type: str | None) -> None:
    if content_type and not any(marker in content_type.lower() for marker in _JSON_MARKERS):
        raise BodyDecodeError(f"content type {content_type!r} is not JSON")


BodyDecoder = Callable[[bytes, "str | None"], Any]
"""``(body, content_type) -> value``; raises `BodyDecodeError`."""


def _decode_bytes(body: bytes, content_type: str | None) -> Any:
    return body


def _decode_str(body: bytes, content_type: str | None) -> Any:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BodyDecodeError(f"body is not UTF-8: {exc}") from None


def _model_decoder(model: type[BaseModel]) -> BodyDecoder:
    validate = model.model_validate_json

    def decode(body: bytes, content_type: str | None) -> Any:
        _check_json_content_type(content_type)
        try:
            return validate(body)
        except ValidationError as exc:
            raise BodyDecodeError(_describe_validation(exc)) from None

    return decode


def _adapter_decoder(annotation: Any) -> BodyDecoder:
    adapter: TypeAdapter[Any] = TypeAdapter(annotation)
    validate = adapter.validate_json

    def decode(body: bytes, content_type: str | None) -> Any:
        _check_json_content_type(content_type)
        try:
            return validate(body)
        except ValidationError as exc:
            raise BodyDecodeError(_describe_validation(exc)) from None

    return decode


def _json_decoder(body: bytes, content_type: str | None) -> Any:
    _check_json_content_type(content_type)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BodyDecodeError(f"invalid JSON: {exc}") from None
    except RecursionError:
        raise BodyDecodeError("invalid JSON: nested too deeply") from None


def _describe_validation(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors(include_input=False, include_url=False)[:5]:
        loc = ".".join(str(p) for p in error["loc"]) or "(body)"
        parts.append(f"{loc}: {error['msg']}")
    return f"{exc.error_count()} validation error(s): " + "; ".join(parts)


def decoder_for(annotation: Any) -> BodyDecoder:
    """Pick the body decoder for a parameter annotation (see module docstring)."""
    if annotation in (inspect.Parameter.empty, bytes, Any, object):
        return _decode_bytes
    if annotation is str:
        return _decode_str
    if inspect.isclass(annotation) and issubclass(annotation, BaseModel):
        return _model_decoder(annotation)
    if annotation in (dict, list):
        return _adapter_decoder(annotation)
    try:
        return _adapter_decoder(annotation)
    except Exception:  # pydantic cannot build a validator: fall back to plain JSON
        return _json_decoder


class HandlerOptions(TypedDict, total=False):
    """Options of one handler, for ``handler()``, ``add_handler()`` and ``HandlerSpec.build()``.

    Attributes:
        ack_policy: what to do with the handler's outcome (default
            ``AckPolicy.RETRY_ON_ERROR``); a string value is accepted.
        queue_type: the queue type to declare (default classic); a string is accepted.
        declare: declare the queue, its retry queues and DLQ on start (default True).
            Only a work queue the consumer declared with its own arguments is known
            to dead-letter to its DLQ, which the last-resort fallback for a copy
            that cannot be published needs (see `docs/failure-semantics.md`).
        queue_arguments: extra ``x-`` arguments for the work queue declaration.
        dedup: this handler's de-duplication store, ``None`` for none, or
            `USE_CONSUMER_DEDUP` (default: the consumer's ``dedup``).
        queue_only: consume the queue alone, as it is (default False): nothing is
            declared, only the queue's existence is checked (no retry queues, no
            DLQ), and every delivery reaches the handler as it came (no attempt
            limit, no de-duplication, no deferral). Needs ``AckPolicy.MANUAL``:
            the handler settles each delivery with ``ack()`` or ``nack()``. For
            tools that read someone else's queue (``reliable-mq consume`` is one).
    """

    ack_policy: AckPolicy | str
    queue_type: QueueType | str
    declare: bool
    queue_arguments: dict[str, Any] | None
    dedup: HandlerDedup
    queue_only: bool


@dataclass(frozen=True, slots=True)
class BatchOptions:
    """How a batch handler's batches are made.

    Attributes:
        max_size: the most deliveries in one batch.
        max_wait: seconds a batch waits for more deliveries after its first
            arrived; then it runs with what it has.
    """

    max_size: int = 100
    max_wait: float = 0.05

    def __post_init__(self) -> None:
        size, wait = self.max_size, self.max_wait
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"max_size must be an int >= 1, not {size!r:.50}")
        if isinstance(wait, bool) or not isinstance(wait, (int, float)):
            raise ValueError(f"max_wait must be a number of seconds, not {wait!r:.50}")
        if not 0 <= wait < math.inf:
            raise ValueError(f"max_wait must be >= 0 and finite, not {wait!r:.50}")


@dataclass(frozen=True)
class HandlerSpec:
    """One registered handler and how to call it.

    Attributes:
        queue: the queue it consumes.
        func: the user function.
        decode: turns the body into the handler's first argument (None: the
            handler takes only the delivery).
        wants_delivery: whether the delivery is passed.
        ack_policy: what to do with the outcome.
        queue_type: the queue type to declare with the topology helper.
        declare: declare the queue, its retry queues and DLQ on start.
        queue_arguments: extra arguments for the work queue declaration.
        dedup: this handler's de-duplication store, ``None`` for none, or
            `USE_CONSUMER_DEDUP` (the consumer's ``dedup``).
        sync: ``func`` is a plain ``def``: the consumer runs it in its thread pool.
        queue_only: the queue is consumed alone, as it is (see `HandlerOptions`).
        batch: set for a batch handler: ``func`` takes a list of what ``decode``
            makes of each body (of deliveries, if None), and with ``wants_delivery``
            a second list, of the deliveries (see `Router.batch_handler`).
    """

    queue: str
    func: HandlerFunc
    decode: BodyDecoder | None
    wants_delivery: bool
    ack_policy: AckPolicy = AckPolicy.RETRY_ON_ERROR
    queue_type: QueueType = QueueType.CLASSIC
    declare: bool = True
    queue_arguments: dict[str, Any] = field(default_factory=dict)
    dedup: HandlerDedup = USE_CONSUMER_DEDUP
    sync: bool = False
    queue_only: bool = False
    batch: BatchOptions | None = None

    @property
    def queue_has_dlx(self) -> bool:
        """True if the consumer declares the work queue dead-lettering to its DLQ.

        Only then may a delivery be rejected without requeue as a last resort: a
        queue declared elsewhere may have no dead-letter exchange (the broker would
        drop the message), and a user-given one may route nowhere.
        """
        overridden = {"x-dead-letter-exchange", "x-dead-letter-routing-key"}
        return self.declare and not self.queue_only and not overridden & self.queue_arguments.keys()

    @classmethod
    def build(cls, queue: str, func: HandlerFunc, **options: Unpack[HandlerOptions]) -> HandlerSpec:
        """Inspect ``func`` and build its spec.

        Raises:
            TypeError: ``func`` is not an ``async def`` or a plain ``def`` with a
                supported signature, or is a plain ``def`` under ``AckPolicy.MANUAL``.
        """
        if not queue:
            raise ValueError("queue name must not be empty")
        ack_policy = AckPolicy(options.get("ack_policy", AckPolicy.RETRY_ON_ERROR))
        queue_only = bool(options.get("queue_only", False))
        if queue_only:
            _check_queue_only(queue, ack_policy, options.get("dedup", USE_CONSUMER_DEDUP))
        sync = not inspect.iscoroutinefunction(func)
        if sync:
            _check_plain_def(func, ack_policy)
        annotations = _annotations(func, "(body), (body, delivery) or (delivery)")
        decode: BodyDecoder | None
        if len(annotations) == 1 and annotations[0] is Delivery:
            decode, wants_delivery = None, True
        else:
            decode = decoder_for(annotations[0])
            wants_delivery = len(annotations) == 2
        return cls(
            queue=queue,
            func=func,
            decode=decode,
            wants_delivery=wants_delivery,
            ack_policy=ack_policy,
            queue_type=QueueType(options.get("queue_type", QueueType.CLASSIC)),
            declare=options.get("declare", True),
            queue_arguments=dict(options.get("queue_arguments") or {}),
            dedup=None if queue_only else options.get("dedup", USE_CONSUMER_DEDUP),
            sync=sync,
            queue_only=queue_only,
        )

    @classmethod
    def build_batch(
        cls, queue: str, func: HandlerFunc, batch: BatchOptions, **options: Unpack[HandlerOptions]
    ) -> HandlerSpec:
        """Inspect a batch handler and build its spec.

        Raises:
            TypeError: ``func`` does not take ``(bodies)``, ``(bodies, deliveries)``
                or ``(deliveries)`` as lists, or asks for ``queue_only``.
        """
        if options.get("queue_only"):
            raise TypeError(f"a batch handler ({queue!r}) cannot consume a queue alone")
        spec = cls.build(queue, func, **options)  # the checks every handler gets
        what = "(bodies), (bodies, deliveries) or (deliveries), each a list"
        items = [_item_type(a, func, what) for a in _annotations(func, what)]
        if len(items) == 2 and items[1] is not Delivery:
            raise TypeError(f"batch handler {func.__qualname__}: its second list is of Delivery")
        decode = None if items == [Delivery] else decoder_for(items[0])
        return replace(spec, decode=decode, wants_delivery=len(items) == 2, batch=batch)


def _annotations(func: Any, signatures: str) -> list[Any]:
    """The annotations of ``func``'s one or two positional parameters (``Delivery`` resolved).

    Raises:
        TypeError: another signature than ``signatures``, or an unresolvable annotation.
    """
    signature = inspect.signature(func)
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # unresolvable forward references: use the raw annotations
        hints = {}
    params = [
        p
        for p in signature.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    required_extra = [
        p
        for p in signature.parameters.values()
        if p.kind is p.KEYWORD_ONLY and p.default is p.empty
    ]
    if required_extra or not 1 <= len(params) <= 2:
        raise TypeError(f"handler {func.__qualname__} must take {signatures}")
    annotations = [hints.get(p.name, p.annotation) for p in params]
    for index, annotation in enumerate(annotations):
        if isinstance(annotation, str):
            if annotation.rsplit(".", 1)[-1] == "Delivery":
                annotations[index] = Delivery
            else:
                raise TypeError(
                    f"handler {func.__qualname__}: cannot resolve the annotation "
                    f"{annotation!r}; define the type at module level"
                )
    return annotations


def _item_type(annotation: Any, func: Any, signatures: str) -> Any:
    """What a batch handler's list holds: ``list[X]`` / ``Sequence[X]`` gives X (bytes if bare)."""
    if annotation in (inspect.Parameter.empty, list, Sequence):
        return bytes
    if typing.get_origin(annotation) in (list, Sequence):
        (item,) = typing.get_args(annotation) or (bytes,)
        return item
    raise TypeError(f"batch handler {func.__qualname__} must take {signatures}")


def _check_queue_only(queue: str, policy: AckPolicy, dedup: HandlerDedup) -> None:
    """A queue consumed alone has no retry queue or DLQ: only the handler can settle."""
    if policy is not AckPolicy.MANUAL:
        raise TypeError(
            f"queue_only=True ({queue!r}) needs ack_policy=AckPolicy.MANUAL: without retry "
            "queues or a DLQ the consumer cannot settle a delivery for the handler"
        )
    if dedup is not USE_CONSUMER_DEDUP and dedup is not None:
        raise TypeError(
            f"queue_only=True ({queue!r}) runs the handler for every delivery: no dedup store"
        )


def _check_plain_def(func: Any, policy: AckPolicy) -> None:
    """Refuse what would run as a plain ``def`` but never do the handler's work.

    A generator function, or a sync wrapper around an ``async def`` (a decorator
    without ``markcoroutinefunction``), would return an object nobody runs, and
    every message would be acked unhandled. ``AckPolicy.MANUAL`` needs
    ``await delivery.ack()``, which a thread cannot do.
    """
    name = getattr(func, "__qualname__", None) or repr(func)
    if not callable(func):
        raise TypeError(f"handler {func!r} is not callable")
    if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
        raise TypeError(f"handler {name} must be an async def or a plain def, not a generator")
    if inspect.isfunction(func) or inspect.ismethod(func):
        inner = inspect.unwrap(func)  # a functools.wraps decorator's wrapped function
    else:
        inner = type(func).__call__  # a callable object
    if inspect.iscoroutinefunction(inner):
        raise TypeError(
            f"handler {name} returns a coroutine but is not an async def itself "
            "(a decorator around an async def?): declare it async def"
        )
    if policy is AckPolicy.MANUAL:
        raise TypeError(
            f"handler {name} is a plain def: it cannot use AckPolicy.MANUAL (a Delivery "
            "settles on the consumer's event loop, not from the handler's thread); return "
            "to ack, raise Retry or Reject, or make it an async def"
        )


class Router:
    """Collects handlers; a `ReliableConsumer` is one.

    Build handlers in a module with a router, then
    ``consumer.include_router(router)``.
    """

    def __init__(self) -> None:
        self._specs: dict[str, HandlerSpec] = {}

    @property
    def handlers(self) -> tuple[HandlerSpec, ...]:
        return tuple(self._specs.values())

    def add_handler(
        self, queue: str, func: HandlerFunc, **options: Unpack[HandlerOptions]
    ) -> HandlerSpec:
        """Register ``func`` for ``queue`` (one handler per queue).

        ``dedup`` overrides the consumer's de-duplication store for this
        handler: a `DedupStore`, or ``None`` to run
        every copy of a message.

        Raises:
            ValueError: ``queue`` already has a handler.
            TypeError: ``func`` has an unsupported signature.
        """
        if queue in self._specs:
            raise ValueError(f"queue {queue!r} already has a handler")
        spec = HandlerSpec.build(queue, func, **options)
        self._add_spec(spec)
        return spec

    def _add_spec(self, spec: HandlerSpec) -> None:
        if spec.queue in self._specs:
            raise ValueError(f"queue {spec.queue!r} already has a handler")
        self._specs[spec.queue] = spec

    def handler(self, queue: str, **options: Unpack[HandlerOptions]) -> Callable[[_F], _F]:
        """Decorator form of `add_handler`; returns the function unchanged."""

        def register(func: _F) -> _F:
            self.add_handler(queue, func, **options)
            return func

        return register

    def add_batch_handler(
        self,
        queue: str,
        func: HandlerFunc,
        *,
        max_size: int = 100,
        max_wait: float = 0.05,
        **options: Unpack[HandlerOptions],
    ) -> HandlerSpec:
        """Register a batch handler for ``queue``: ``func`` takes lists.

        ``func`` takes ``(bodies)``, ``(bodies, deliveries)`` or ``(deliveries)``,
        each a ``list[...]`` (``list[Model]``, ``list[bytes]``, ``list[Delivery]``...);
        each body is decoded by the list's item type as for a single handler. It
        gets up to ``max_size`` deliveries at once: as many as arrived within
        ``max_wait`` seconds of the first. Returning acks them all; raising
        `BatchFailed` fails those it names (each down the retry/DLQ ladder on
        its own) and acks the rest; raising anything else fails every one.

        Raises:
            ValueError: ``queue`` already has a handler; ``max_size`` or ``max_wait``
                is out of range.
            TypeError: ``func`` has an unsupported signature.
        """
        batch = BatchOptions(max_size=max_size, max_wait=max_wait)
        spec = HandlerSpec.build_batch(queue, func, batch, **options)
        self._add_spec(spec)
        return spec

    def batch_handler(
        self,
        queue: str,
        *,
        max_size: int = 100,
        max_wait: float = 0.05,
        **options: Unpack[HandlerOptions],
    ) -> Callable[[_F], _F]:
        """Decorator form of `add_batch_handler`; returns the function unchanged."""

        def register(func: _F) -> _F:
            self.add_batch_handler(queue, func, max_size=max_size, max_wait=max_wait, **options)
            return func

        return register

    def include_router(self, router: Router) -> None:
        """Add every handler of ``router``.

        Raises:
            ValueError: a queue already has a handler.
        """
        for spec in router.handlers:
            self._add_spec(spec)
