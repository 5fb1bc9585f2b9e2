"""Every touch of a private part of aiormq or pamqp: named hooks, each verified.

The fast paths (`reliable_mq._amqp.confirm`, `reliable_mq._amqp.inbound`) sit
below aiormq's public API: they replace three frame handlers of a publisher's
channel and the delivery handler of a consumer's, read a channel's frame
queue, put coalesced frames on the connection's write queue, decode a
connection's frames with our own decoder, and build pamqp's frame objects
without their constructors. None of that is aiormq's or pamqp's public API, so
an upgrade may move it. This module is the only one that touches those parts,
each through a `Hook` that names it, and `verify` checks every hook (its
attribute exists, is a coroutine function with the expected parameters, and
behaves as the fast path relies on) before a fast path is used:

* ``"on"``: a failed check raises `UnsupportedDependency` naming the
  dependency, its installed version and the supported range;
* ``"auto"`` (the default): a failed check logs one warning per process
  (``fast_path_unavailable``: the hook, the dependency, its version, the
  supported range, and what the plain path lacks), and the plain path is used;
* ``"off"``: the plain path, unchecked.

The checks run once per process (the classes), and again for each connection
and channel (the objects: the frame receiver found, the channel's queues of
the expected kinds). A fast path is never half-installed: either every hook it
needs is verified, or it is not used.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import struct
import types
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib import metadata
from typing import Any, TypeVar

import aiormq
import aiormq.abc
import aiormq.connection
import pamqp.frame
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from ..errors import UnsupportedDependency
from ..log import get_logger
from ..settings import FastPath

__all__ = (
    "HOOKS",
    "SUPPORTED",
    "Hook",
    "HookFailure",
    "PreEncodedProperties",
    "channel_frames",
    "check_channel",
    "find_receiver",
    "frame_clock",
    "frame_factory",
    "install_confirm_handlers",
    "install_deliver_handler",
    "install_frame_decoder",
    "new_frame",
    "plain_lacks",
    "queue_deques",
    "resolve",
    "stream_buffer",
    "verify",
    "write_frames",
)

_T = TypeVar("_T")

SUPPORTED: dict[str, str] = {
    "aio-pika": ">=10.2.0,<11",
    "aiormq": ">=7.2.4,<8",
    "pamqp": ">=4.0.1,<5",
}
"""The ranges CI tests (newest and lowest), as declared in pyproject.toml."""


def installed(dependency: str) -> str:
    """The installed version of ``dependency`` ("unknown" if it has no metadata)."""
    try:
        return metadata.version(dependency)
    except metadata.PackageNotFoundError:
        return "unknown"


@dataclass(frozen=True)
class HookFailure:
    """A hook that did not verify: which, in which dependency, and what is wrong."""

    hook: str
    dependency: str
    problem: str

    def describe(self) -> str:
        return (
            f"{self.hook} ({self.dependency} {installed(self.dependency)} installed, "
            f"supported {SUPPORTED[self.dependency]}): {self.problem}"
        )


@dataclass(frozen=True)
class Hook:
    """One private part of a dependency that a fast path relies on.

    Attributes:
        name: the part, as a dotted path (``aiormq.Channel._on_confirm_frame``).
        dependency: the distribution it belongs to.
        use: what the fast path does with it.
        check: returns None when the part is as expected, else what is wrong.
    """

    name: str
    dependency: str
    use: str
    check: Callable[[], str | None]

    def verify(self) -> HookFailure | None:
        try:
            problem = self.check()
        except Exception as exc:  # a check that cannot even run has failed
            problem = f"cannot be checked: {type(exc).__name__}: {exc}"
        return None if problem is None else HookFailure(self.name, self.dependency, problem)


# -- the checks ---------------------------------------------------------------------


def _coroutine(owner: Any, attribute: str, parameters: tuple[str, ...]) -> str | None:
    """None if ``owner.attribute`` is a coroutine function with ``parameters``."""
    function = inspect.getattr_static(owner, attribute, None)
    if function is None:
        return "missing"
    if not inspect.iscoroutinefunction(function):
        return "not a coroutine function"
    names = tuple(inspect.signature(function).parameters)
    if names != parameters:
        return f"parameters {names}, expected {parameters}"
    return None


def _dispatches(owner: Any, caller: str, call: str) -> str | None:
    """None if the source of ``owner.caller`` contains ``call`` (how it reaches a hook)."""
    function = inspect.getattr_static(owner, caller, None)
    if function is None:
        return f"{caller} is missing"
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return f"the source of {caller} is not available to check"
    if call not in source:
        return f"{caller} no longer calls {call}"
    return None


def _first(*problems: str | None) -> str | None:
    return next((problem for problem in problems if problem is not None), None)


def _handler(
    name: str, parameters: tuple[str, ...] = ("self", "frame")
) -> Callable[[], str | None]:
    def check() -> str | None:
        return _first(
            _coroutine(aiormq.Channel, name, parameters),
            _dispatches(aiormq.Channel, "_reader", f"self.{name}("),
        )

    return check


class _FramesStub:
    """Stands in for a channel to see what ``Channel._get_frame`` takes off ``frames``."""

    def __init__(self, item: Any) -> None:
        self.frames: asyncio.Queue[Any] = asyncio.Queue()
        self.frames.put_nowait(item)


def _run_now(coroutine: Coroutine[Any, Any, Any]) -> Any:
    """The result of a coroutine that completes without suspending (else an error)."""
    try:
        coroutine.send(None)
    except StopIteration as stop:
        return stop.value
    coroutine.close()
    raise RuntimeError("it waited for something")


def _check_frames() -> str | None:
    problem = _coroutine(aiormq.Channel, "_get_frame", ("self",))
    if problem is not None:
        return problem
    sentinel = object()
    got = _run_now(aiormq.Channel._get_frame(_FramesStub((0, sentinel))))  # type: ignore[arg-type]
    if got is not sentinel:
        return "frames no longer holds (weight, frame) pairs"
    return None


def _check_write_queue() -> str | None:
    frame = aiormq.abc.ChannelFrame(payload=b"probe", should_close=False)
    if frame.payload != b"probe" or frame.should_close or frame.should_drain:
        return "ChannelFrame(payload=..., should_close=False) is not a plain payload"
    return _dispatches(
        aiormq.connection.Connection,
        "_Connection__writer",
        "writer.write(channel_frame.payload)",
    )


def _check_content_header() -> str | None:
    return _coroutine(aiormq.Channel, "_Channel__get_content_header", ("self",)) or _coroutine(
        aiormq.Channel, "_read_content", ("self", "frame", "header")
    )


def _check_receiver() -> str | None:
    receiver_class = getattr(aiormq.connection, "FrameReceiver", None)
    if not isinstance(receiver_class, type):
        return "aiormq.connection.FrameReceiver is missing"
    problem = _coroutine(receiver_class, "get_frame", ("self",))
    if problem is not None:
        return f"FrameReceiver.get_frame: {problem}"
    reader = inspect.getattr_static(aiormq.connection.Connection, "_Connection__reader", None)
    if not inspect.iscoroutinefunction(reader):
        return "Connection.__reader is missing"
    if "frame_receiver" not in inspect.signature(reader).parameters:
        return "Connection.__reader no longer takes the frame_receiver"
    # Our get_frame, set on the instance, must be what the reader's loop calls.
    receiver = receiver_class(object())  # its reader is not used here
    sentinel = object()

    async def get_frame() -> Any:
        return sentinel

    receiver.get_frame = get_frame
    if _run_now(receiver.__anext__()) is not sentinel:
        return "FrameReceiver.__anext__ no longer calls the instance's get_frame"
    return None


_PROPERTY_NAMES = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "message_type",
    "user_id",
    "app_id",
    "cluster_id",
)
"""pamqp's ``Basic.Properties`` slots, in wire order (the decoder fills them in this order)."""


Decode = Callable[[bytes, bytes], tuple[int, int, Any]]
"""The fast decoder (`reliable_mq._amqp.inbound.decode_frame`), handed to `verify`
(inbound imports this module, so this one does not import inbound)."""


def _check_pamqp_objects(decode: Decode) -> str | None:
    if tuple(Basic.Properties.__slots__) != _PROPERTY_NAMES:
        return f"Basic.Properties.__slots__ is {Basic.Properties.__slots__!r}"
    flags = [Basic.Properties.flags[name] for name in _PROPERTY_NAMES]
    if flags != [1 << bit for bit in range(15, 1, -1)]:
        return "Basic.Properties.flags are not the AMQP property bits"
    # The decoder builds frames without their constructors: ours must equal pamqp's.
    sample = _sample_frames()
    for raw in sample:
        head, rest = raw[:7], raw[7:]
        ours = decode(head, rest)[2]
        theirs = _unmarshal(raw)
        if _fields(ours) != _fields(theirs):
            return f"our decoding of a {type(theirs).__name__} differs from pamqp's"
    return None


_DELIVER_FIELDS = ("consumer_tag", "delivery_tag", "redelivered", "exchange", "routing_key")
_HEADER_FIELDS = ("class_id", "weight", "body_size")


def _fields(frame: Any) -> dict[str, Any]:
    """What the decoder sets on a deliver frame or a content header."""
    if isinstance(frame, Basic.Deliver):
        return {name: getattr(frame, name) for name in _DELIVER_FIELDS}
    values = {name: getattr(frame, name) for name in _HEADER_FIELDS}
    values.update({name: getattr(frame.properties, name) for name in _PROPERTY_NAMES})
    return values


def _unmarshal(raw: bytes) -> Any:
    return pamqp.frame.unmarshal(raw)[2]


def _sample_frames() -> list[bytes]:
    properties = Basic.Properties(
        content_type="text/plain",
        content_encoding="utf-8",
        headers={"a": 1, "b": "two", "c": [1.5, True]},
        delivery_mode=2,
        priority=3,
        correlation_id="c",
        reply_to="r",
        expiration="1000",
        message_id="m",
        message_type="t",
        user_id="guest",
        app_id="app",
    )
    deliver = Basic.Deliver(
        consumer_tag="ctag", delivery_tag=7, redelivered=True, exchange="ex", routing_key="key"
    )
    header = ContentHeader(0, 3, properties)
    return [pamqp.frame.marshal(deliver, 1), pamqp.frame.marshal(header, 1)]


def _check_pre_encoded() -> str | None:
    encoded = struct.pack(">H", 1 << 15) + b"\x04text"
    header = ContentHeader(0, 5, PreEncodedProperties(encoded, "m"))
    raw = pamqp.frame.marshal(header, 1)
    if not raw.endswith(encoded + b"\xce"):
        return "ContentHeader no longer marshals its properties with their marshal()"
    return None


HOOKS: dict[str, Hook] = {
    hook.name: hook
    for hook in (
        Hook(
            "aiormq.Channel._on_confirm_frame",
            "aiormq",
            "settles a range of delivery tags per ack or nack, without a future per publish",
            _handler("_on_confirm_frame"),
        ),
        Hook(
            "aiormq.Channel._on_return_frame",
            "aiormq",
            "reports a basic.return by message id",
            _handler("_on_return_frame"),
        ),
        Hook(
            "aiormq.Channel._on_close_frame",
            "aiormq",
            "stops our writes the moment the broker closes the channel (before close-ok)",
            _handler("_on_close_frame"),
        ),
        Hook(
            "aiormq.Channel._Channel__get_content_header",
            "aiormq",
            "reads the content of a returned message",
            _check_content_header,
        ),
        Hook(
            "aiormq.Connection.write_queue",
            "aiormq",
            "writes every message of one loop iteration as one item (one socket write)",
            _check_write_queue,
        ),
        Hook(
            "aiormq.Channel._on_deliver_frame",
            "aiormq",
            "hands each delivery straight to the dispatcher, in tag order, without a task",
            _handler("_on_deliver_frame"),
        ),
        Hook(
            "aiormq.Channel._get_frame",
            "aiormq",
            "takes a delivery's header and body off the channel's frame queue",
            _check_frames,
        ),
        Hook(
            "aiormq.connection.FrameReceiver",
            "aiormq",
            "decodes the connection's frames with our decoder: deliveries pamqp cannot "
            "decode (strings not UTF-8, timestamps past the year 9999) are dead-lettered "
            "instead of closing the connection, and timestamps after 2106 are read as "
            "seconds",
            _check_receiver,
        ),
    )
}

_PLAIN_PUBLISH = Hook(
    "pamqp.header.ContentHeader.marshal",
    "pamqp",
    "the plain path sends the properties as we encoded them",
    _check_pre_encoded,
)

_PAMQP_OBJECTS = "pamqp.commands.Basic.Properties"


def _decoder_hook(decode: Decode) -> Hook:
    return Hook(
        _PAMQP_OBJECTS,
        "pamqp",
        "builds pamqp's frame objects without their constructors",
        lambda: _check_pamqp_objects(decode),
    )


_verified: dict[str, HookFailure | None] = {}


def verify(decode: Decode) -> list[HookFailure]:
    """Every hook checked (once per process), ``decode``'s frames against pamqp's; the failures."""
    if not _verified:
        for hook in (*HOOKS.values(), _decoder_hook(decode)):
            _verified[hook.name] = hook.verify()
    return [failure for failure in _verified.values() if failure is not None]


def plain_lacks() -> str:
    """What the plain path does not have (said in the fallback warning and the docs)."""
    return (
        "the plain path publishes through aiormq's Channel.basic_publish (a future and a "
        "lock per message: slower) and consumes through basic_consume (a task per "
        "delivery). It lacks two protections: a publish racing the broker's channel.close "
        "(a refused message, a deleted exchange) can reach the broker after close-ok, which "
        "closes the whole connection (504; the publisher reconnects and republishes, "
        "nothing is lost, but the connection's other channels drop); and frames are "
        "decoded by pamqp: a delivery whose strings are not UTF-8 or whose timestamp is "
        "past the year 9999 closes the connection (the broker redelivers it, and the "
        "consumer reconnects again and again) instead of being dead-lettered, and a "
        "timestamp after 2106 reads as milliseconds"
    )


_warned = False


def resolve(mode: FastPath, failures: list[HookFailure]) -> bool:
    """Whether to use the fast path, given the checks' ``failures``.

    Raises:
        UnsupportedDependency: ``mode`` is ``"on"`` and a check failed.
    """
    global _warned  # noqa: PLW0603 (one warning per process)
    if mode is FastPath.OFF:
        return False
    if not failures:
        return True
    first = failures[0]
    if mode is FastPath.ON:
        raise UnsupportedDependency(
            first.dependency,
            installed(first.dependency),
            SUPPORTED[first.dependency],
            "; ".join(failure.describe() for failure in failures),
        )
    if not _warned:
        _warned = True
        get_logger(__name__).warning(
            "fast_path_unavailable",
            hook=first.hook,
            dependency=first.dependency,
            installed=installed(first.dependency),
            supported=SUPPORTED[first.dependency],
            problems=[failure.describe() for failure in failures],
            plain_path=plain_lacks(),
            hint="reliable_mq falls back to its plain path; install a supported version, "
            "or set RELIABLE_MQ_FAST_PATH=off to choose the plain path (no warning)",
        )
    return False


def check_plain() -> None:
    """The plain path's own requirement: refuse if pamqp no longer meets it.

    Raises:
        UnsupportedDependency: the properties could not be sent as encoded.
    """
    failure = _PLAIN_PUBLISH.verify()
    if failure is not None:
        raise UnsupportedDependency(
            "pamqp", installed("pamqp"), SUPPORTED["pamqp"], failure.describe()
        )


# -- the hooks, used ----------------------------------------------------------------


def find_receiver(connection: Any) -> tuple[Any, HookFailure | None]:
    """aiormq's ``FrameReceiver`` of ``connection``: the receiver its reader task reads from.

    aiormq makes it in ``Connection.connect`` and hands it to the reader
    coroutine only: we take it from that coroutine's arguments, after checking
    that the task runs aiormq's ``Connection.__reader``.
    """
    name = "aiormq.connection.FrameReceiver"

    def failed(problem: str) -> tuple[Any, HookFailure]:
        return None, HookFailure(name, "aiormq", problem)

    task = getattr(connection, "_reader_task", None)
    task = getattr(task, "task", task)  # aiormq wraps it in a TaskWrapper
    if not isinstance(task, asyncio.Task):
        return failed("the connection's reader task was not found")
    if task.done():
        return failed("the connection's reader task has ended")
    coroutine = task.get_coro()
    reader = inspect.getattr_static(aiormq.connection.Connection, "_Connection__reader", None)
    if not isinstance(coroutine, types.CoroutineType) or reader is None:
        return failed("the reader task does not run a coroutine")
    if coroutine.cr_code is not reader.__code__ or coroutine.cr_frame is None:
        return failed("the reader task does not run aiormq's Connection.__reader")
    receiver = coroutine.cr_frame.f_locals.get("frame_receiver")
    if not isinstance(receiver, aiormq.connection.FrameReceiver) or not isinstance(
        getattr(receiver, "reader", None), asyncio.StreamReader
    ):
        return failed("the reader's frame_receiver is not a FrameReceiver over a StreamReader")
    return receiver, None


def install_frame_decoder(receiver: Any, get_frame: Callable[[], Any]) -> None:
    """``receiver`` decodes with ``get_frame`` from now on (verified by `find_receiver`)."""
    receiver.get_frame = get_frame


def check_channel(channel: aiormq.Channel) -> HookFailure | None:
    """The per-channel shapes the fast paths rely on."""
    queue = getattr(channel, "frames", None)
    if not isinstance(queue, asyncio.Queue):
        return HookFailure("aiormq.Channel._get_frame", "aiormq", "channel.frames is no Queue")
    write_queue = getattr(channel, "write_queue", None)
    if not isinstance(write_queue, asyncio.Queue) or write_queue is not getattr(
        channel.connection, "write_queue", None
    ):
        return HookFailure(
            "aiormq.Connection.write_queue",
            "aiormq",
            "channel.write_queue is not the connection's write queue",
        )
    return None


def channel_frames(channel: aiormq.Channel) -> tuple[asyncio.Queue[Any], Callable[[], Any]]:
    """A channel's frame queue (``(weight, frame)`` pairs) and its ``_get_frame``."""
    return channel.frames, channel._get_frame


def install_deliver_handler(channel: aiormq.Channel, handler: Callable[[Any], Any]) -> None:
    channel._on_deliver_frame = handler  # type: ignore[method-assign,assignment]


def queue_deques(queue: asyncio.Queue[Any]) -> tuple[deque[Any], deque[Any]] | None:
    """An asyncio queue's items and waiting getters (None: another shape), for the
    direct path's idle check (`reliable_mq._amqp.direct.DirectChannel.idle`)."""
    items, getters = getattr(queue, "_queue", None), getattr(queue, "_getters", None)
    if isinstance(items, deque) and isinstance(getters, deque):
        return items, getters
    return None


def stream_buffer(reader: Any) -> tuple[bytearray, Callable[[], None]] | None:
    """A ``StreamReader``'s buffer and its method resuming a transport paused for a
    full buffer (None: another shape), for frames taken out of the buffer at once."""
    buffer, resume = (
        getattr(reader, "_buffer", None),
        getattr(reader, "_maybe_resume_transport", None),
    )
    if isinstance(buffer, bytearray) and callable(resume):
        return buffer, resume
    return None


def frame_clock(connection: Any) -> Callable[[], None] | None:
    """Notes that a frame arrived, as aiormq's reader does for each (its heartbeat ends
    a connection that received none for too long); None: aiormq keeps no such time."""
    name = "_Connection__last_frame_time"
    if not isinstance(getattr(connection, name, None), float):
        return None
    loop = asyncio.get_running_loop()

    def stamp() -> None:
        setattr(connection, name, loop.time())

    return stamp


def install_confirm_handlers(
    channel: aiormq.Channel,
    *,
    on_confirm: Callable[[Any], Any],
    on_return: Callable[[Any], Any],
    on_close: Callable[[Any], None],
) -> None:
    """Replace ``channel``'s confirm, return and close handlers.

    ``on_return(frame)`` gets the ``basic.return`` and reads its content with
    `read_returned`; ``on_close(frame)`` is called before aiormq's own handler
    queues the close-ok.
    """
    original_close = channel._on_close_frame

    async def close(frame: Any) -> None:
        on_close(frame)
        await original_close(frame)

    channel._on_confirm_frame = on_confirm  # type: ignore[method-assign,assignment]
    channel._on_return_frame = on_return  # type: ignore[method-assign,assignment]
    channel._on_close_frame = close  # type: ignore[method-assign]


async def read_returned(channel: aiormq.Channel, frame: Basic.Return) -> Basic.Properties:
    """The properties of a returned message (its content read off the channel)."""
    header = await channel._Channel__get_content_header()  # type: ignore[attr-defined]
    message = await channel._read_content(frame, header)
    properties: Basic.Properties = message.header.properties
    return properties


def write_frames(channel: aiormq.Channel) -> Callable[[bytes], bool]:
    """A function that puts raw frames on the connection's write queue (False: full)."""
    queue = channel.write_queue
    frame = aiormq.abc.ChannelFrame

    def write(data: bytes) -> bool:
        if queue.full():
            return False
        queue.put_nowait(frame(payload=data, should_close=False))
        return True

    return write


def new_frame(cls: type[_T]) -> _T:
    """An instance of a pamqp frame class, its fields to be set by the decoder."""
    return cls.__new__(cls)


def frame_factory(cls: type[_T]) -> Callable[[], _T]:
    """`new_frame` for one class, as a function of no arguments (one call less per
    frame on the consumer's hot path)."""
    return functools.partial(cls.__new__, cls)


class PreEncodedProperties(Basic.Properties):
    """Properties already encoded by `reliable_mq._amqp.wire`: pamqp sends them as they are.

    The plain path publishes through aiormq's ``basic_publish``, which encodes
    the properties with their ``marshal()``: pamqp's own encoding would send
    floats in headers as 32-bit, drop empty strings, and refuse ``bytes``
    values. ``message_id`` is set (aiormq maps returns by it).
    """

    def __init__(self, encoded: bytes, message_id: str) -> None:
        super().__init__(message_id=message_id)
        self._encoded = encoded

    def marshal(self) -> bytes:
        return self._encoded
