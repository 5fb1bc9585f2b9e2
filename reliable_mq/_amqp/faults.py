"""The one place that turns aiormq / aio-pika exceptions and close reasons into our outcomes.

Like httpx's ``map_httpcore_exceptions``: no other module lists aiormq
exception classes. Callers catch `AMQP_ERRORS` (or use
`classify()` on whatever they caught) and ``match`` on the
`FaultKind` of the resulting `Fault`.

Reply codes follow AMQP 0-9-1: 3xx are soft errors that close a channel or
mean "forced", 4xx close the channel (the command was refused), 5xx close the
whole connection (a frame the broker could not accept, or a broker fault).
"""

from __future__ import annotations

import asyncio
import enum
import re
from dataclasses import dataclass
from typing import Any

import aiormq
from aiormq.exceptions import (
    AMQPChannelError,
    AMQPConnectionError,
    AMQPError,
    AuthenticationError,
    ChannelAccessRefused,
    ChannelClosed,
    ChannelInvalidStateError,
    ChannelLockedResource,
    ChannelNotFoundEntity,
    ChannelPreconditionFailed,
    ConnectionChannelError,
    ConnectionClosed,
    ConnectionCommandInvalid,
    ConnectionFrameError,
    ConnectionInternalError,
    ConnectionNotAllowed,
    ConnectionNotImplemented,
    ConnectionResourceError,
    ConnectionSyntaxError,
    ConnectionUnexpectedFrame,
    IncompatibleProtocolError,
    InvalidFrameError,
    ProbableAuthenticationError,
)
from pamqp.exceptions import PAMQPException

from ..settings import redact_credentials

__all__ = (
    "AMQP_ERRORS",
    "REPLY_SUCCESS",
    "Fault",
    "FaultKind",
    "Inequivalence",
    "classify",
    "classify_close",
    "consumer_timeout_of",
    "inequivalence",
    "is_delivery_nack",
    "is_return",
    "reader_error",
)

AMQP_ERRORS: tuple[type[BaseException], ...] = (
    AMQPError,
    ChannelInvalidStateError,
    ConnectionError,
    OSError,
    TimeoutError,
)
"""Everything a call into aiormq / aio-pika can raise because of the broker or the network.

``ChannelInvalidStateError`` is a ``RuntimeError`` outside aiormq's own tree
(an operation on a channel that is already closed); it is listed here so that
nobody else has to catch ``RuntimeError`` wholesale.
"""

REPLY_SUCCESS = 200
"""The reply code of a normal, requested close."""

_CONNECTION_FORCED = 320

_CHANNEL_CODES: dict[type[BaseException], int] = {
    ChannelAccessRefused: 403,
    ChannelNotFoundEntity: 404,
    ChannelLockedResource: 405,
    ChannelPreconditionFailed: 406,
}
_CONNECTION_CODES: dict[type[BaseException], int] = {
    ConnectionFrameError: 501,
    ConnectionSyntaxError: 502,
    ConnectionCommandInvalid: 503,
    ConnectionChannelError: 504,
    ConnectionUnexpectedFrame: 505,
    ConnectionResourceError: 506,
    ConnectionNotAllowed: 530,
    ConnectionNotImplemented: 540,
    ConnectionInternalError: 541,
}

_ENTITY = re.compile(r"\b(exchange|queue) '(.*?)' in vhost '")
_PRECONDITION_FAILED = 406
_CONSUMER_TIMEOUT = re.compile(
    r"delivery acknowledgement on channel \d+ timed out(?:\. Timeout value used: (\d+) ms)?"
)
"""RabbitMQ's 406 text for a delivery left unacked past ``consumer_timeout`` (3.8.15+;
the value used is named since 3.9)."""

# aiormq answers a connection.close in reply to connection.open with this text
# (the close frame's own reply text is lost): the vhost was refused.
_OPEN_CLOSED = re.compile(r"Expected one of \['Connection\.OpenOk'\], got <Connection\.Close\b")

_VHOST_REFUSED_TEXT = (
    "NOT_ALLOWED - the broker closed the connection at connection.open: the vhost does "
    "not exist, this user has no access to it, or its connection limit is reached"
)


class FaultKind(enum.StrEnum):
    """What a lower-layer error means for the caller."""

    CONNECTION_LOST = "connection_lost"
    """The connection is gone (network, heartbeat, broker shutdown, forced close): reconnect."""
    CHANNEL_LOST = "channel_lost"
    """The channel is gone for a reason that is not a refusal of our command: reopen."""
    NOT_FOUND = "not_found"
    """404: the exchange or queue named in `Fault.entity` does not exist."""
    REFUSED = "refused"
    """The broker refused a command we sent (403, 405, 406, 530, 540 or a 50x frame error).

    Sending the same thing again gets the same answer: never retry it blindly.
    """
    AUTH_REFUSED = "auth_refused"
    """The broker refused our credentials at connection time."""
    VHOST_REFUSED = "vhost_refused"
    """The broker refused to open the vhost at connection time (530 ``NOT_ALLOWED``):
    no such vhost, no access to it for this user, or its connection limit reached."""
    TIMEOUT = "timeout"
    """An operation ran out of time (the link may be stuck)."""
    CONSUMER_TIMEOUT = "consumer_timeout"
    """406 ``delivery acknowledgement on channel N timed out``: a delivery stayed
    unacked past the broker's ``consumer_timeout``. The broker closed the channel
    and requeued every delivery unacked on it (not a refusal: reopen; see
    `consumer_timeout_of` for the value the broker used)."""


@dataclass(frozen=True, slots=True)
class Fault:
    """One classified lower-layer error.

    Attributes:
        kind: what it means.
        reply_code: the AMQP reply code, when the broker sent one.
        reply_text: the broker's text (or the exception's), never containing a password.
        connection_level: the whole connection closed, not just a channel.
        entity: ``("exchange" | "queue", name)`` when the reply text names one.
    """

    kind: FaultKind
    reply_code: int | None = None
    reply_text: str = ""
    connection_level: bool = False
    entity: tuple[str, str] | None = None

    @property
    def broker_initiated(self) -> bool:
        """True when the broker itself closed the channel or connection (it sent a code)."""
        return self.reply_code is not None and self.reply_code != REPLY_SUCCESS

    @property
    def refusal(self) -> bool:
        """True when the broker refused something we sent (retrying would repeat it)."""
        return self.kind in (FaultKind.NOT_FOUND, FaultKind.REFUSED)

    def names(self, kind: str, name: str) -> bool:
        """True if the reply text names ``kind`` (``"exchange"``/``"queue"``) ``name``."""
        return self.entity == (kind, name)

    def describe(self) -> str:
        """``"404 NOT_FOUND - no exchange 'x' in vhost '/'"``-style one-liner."""
        code = f"{self.reply_code} " if self.reply_code is not None else ""
        return f"{code}{self.reply_text or self.kind.value}"[:500]


def _entity(text: str) -> tuple[str, str] | None:
    match = _ENTITY.search(text)
    return (match.group(1), match.group(2)) if match else None


def _text(exc: BaseException) -> str:
    if isinstance(exc, AMQPError) and exc.args:
        parts = [str(part) for part in exc.args if part is not None]
        # ChannelClosed / ConnectionClosed carry (code, text); others carry (text,).
        if len(parts) > 1 and parts[0].isdigit():
            parts = parts[1:]
        text = " ".join(parts)
    else:
        text = str(exc) or type(exc).__name__
    return redact_credentials(text)


def classify(exc: BaseException) -> Fault | None:  # noqa: PLR0911, PLR0912 (a classifier: one case per aiormq error)
    """Classify ``exc``; ``None`` if it is not a broker or network error (a bug: re-raise it)."""
    text = _text(exc)
    match exc:
        case ChannelClosed() if _CONSUMER_TIMEOUT.search(text) and _code_of(exc) in (
            None,
            _PRECONDITION_FAILED,
        ):
            return Fault(FaultKind.CONSUMER_TIMEOUT, _PRECONDITION_FAILED, text)
        case AuthenticationError() | ProbableAuthenticationError():
            return Fault(FaultKind.AUTH_REFUSED, 403, text, connection_level=True)
        case InvalidFrameError() if _OPEN_CLOSED.search(text):
            return Fault(FaultKind.VHOST_REFUSED, 530, _VHOST_REFUSED_TEXT, connection_level=True)
        case IncompatibleProtocolError():
            return Fault(FaultKind.REFUSED, None, text, connection_level=True)
        case ChannelNotFoundEntity():
            return Fault(FaultKind.NOT_FOUND, 404, text, entity=_entity(text))
        case AMQPChannelError() if type(exc) in _CHANNEL_CODES:
            channel_code = _CHANNEL_CODES[type(exc)]
            return Fault(FaultKind.REFUSED, channel_code, text, entity=_entity(text))
        case ChannelClosed():
            code = _code_arg(exc)
            kind = FaultKind.REFUSED if code is not None and code >= 400 else FaultKind.CHANNEL_LOST
            return Fault(kind, code, text, entity=_entity(text))
        case ConnectionClosed() if type(exc) in _CONNECTION_CODES:
            connection_code = _CONNECTION_CODES[type(exc)]
            kind = FaultKind.CONNECTION_LOST if connection_code == 504 else FaultKind.REFUSED
            return Fault(kind, connection_code, text, connection_level=True, entity=_entity(text))
        case ConnectionClosed():
            code = _code_arg(exc)
            if code == 403:
                return Fault(FaultKind.AUTH_REFUSED, code, text, connection_level=True)
            return Fault(FaultKind.CONNECTION_LOST, code, text, connection_level=True)
        case AMQPConnectionError() | ConnectionError():
            return Fault(FaultKind.CONNECTION_LOST, None, text, connection_level=True)
        case TimeoutError():
            return Fault(FaultKind.TIMEOUT, None, text)
        case OSError():
            return Fault(FaultKind.CONNECTION_LOST, None, text, connection_level=True)
        case ChannelInvalidStateError():
            return Fault(FaultKind.CHANNEL_LOST, None, text)
        case AMQPError():
            return Fault(FaultKind.CHANNEL_LOST, None, text)
    return None


def classify_close(
    reply_code: int | None, reply_text: str | None, *, connection_level: bool
) -> Fault:
    """Classify a ``channel.close`` / ``connection.close`` frame the broker sent."""
    text = redact_credentials(reply_text or "")
    entity = _entity(text)
    if reply_code is None or reply_code in (REPLY_SUCCESS, _CONNECTION_FORCED):
        kind = FaultKind.CONNECTION_LOST if connection_level else FaultKind.CHANNEL_LOST
    elif reply_code == 404:
        kind = FaultKind.NOT_FOUND
    elif reply_code == _PRECONDITION_FAILED and _CONSUMER_TIMEOUT.search(text):
        kind = FaultKind.CONSUMER_TIMEOUT
    elif reply_code == 504:
        kind = FaultKind.CONNECTION_LOST
    elif reply_code >= 400:
        kind = FaultKind.REFUSED
    else:
        kind = FaultKind.CONNECTION_LOST if connection_level else FaultKind.CHANNEL_LOST
    return Fault(kind, reply_code, text, connection_level=connection_level, entity=entity)


def consumer_timeout_of(fault: Fault) -> float | None:
    """The broker's ``consumer_timeout`` in seconds, as its close text names it (3.9+).

    None if ``fault`` is not `FaultKind.CONSUMER_TIMEOUT` or the text does not say.
    """
    if fault.kind is not FaultKind.CONSUMER_TIMEOUT:
        return None
    match = _CONSUMER_TIMEOUT.search(fault.reply_text)
    if match is None or match.group(1) is None:
        return None
    return int(match.group(1)) / 1000


def _code_of(exc: BaseException) -> int | None:
    """The reply code of a channel error: its class's, or its first argument."""
    return _CHANNEL_CODES.get(type(exc)) or _code_arg(exc)


def _code_arg(exc: BaseException) -> int | None:
    if exc.args and isinstance(exc.args[0], int):
        return exc.args[0]
    return None


def is_delivery_nack(exc: BaseException) -> bool:
    """True for aiormq's error for a ``basic.nack`` of a publish."""
    return isinstance(exc, aiormq.exceptions.DeliveryError) and not is_return(exc)


def is_return(exc: BaseException) -> bool:
    """True for aiormq's error for a ``basic.return`` of a mandatory publish."""
    return isinstance(exc, aiormq.exceptions.PublishError)


def reader_error(exc: BaseException) -> BaseException | None:  # noqa: PLR0911 (one case per error aiormq's reader raises)
    """The error aiormq's frame reader raises for ``exc`` (None: raise ``exc`` itself).

    For a frame reader of ours that stands in for aiormq's on a connection
    (`reliable_mq._amqp.inbound`): a socket read that failed, or bytes pamqp cannot
    decode, end the connection with the same error as aiormq's own reader.
    """
    match exc:
        case asyncio.IncompleteReadError():
            return AMQPConnectionError(
                "Server connection unexpectedly closed. "
                f"Read {len(exc.partial)} bytes but {exc.expected} bytes expected"
            )
        case ConnectionRefusedError():
            return AMQPConnectionError(f"Server connection refused: {exc!r}")
        case ConnectionResetError():
            return AMQPConnectionError(f"Server connection reset: {exc!r}")
        case ConnectionError():
            return AMQPConnectionError(f"Server connection error: {exc!r}")
        case OSError():
            return AMQPConnectionError(f"Server communication error: {exc!r}")
        case PAMQPException():
            return InvalidFrameError(str(exc))
    return None


_INEQUIVALENT = re.compile(r"inequivalent arg '([^']+)'.*?received (.*?) but current is (.*)$")
_TYPED_VALUE = re.compile(r"the value '(.*)' of type '(\w+)'$")
_FLAGS = ("durable", "auto_delete", "exclusive")


@dataclass(frozen=True, slots=True)
class Inequivalence:
    """A 406 ``inequivalent arg`` refusal of a redeclare, read.

    RabbitMQ refuses a redeclare that differs from the queue in one compared
    argument or flag at a time, naming it with the queue's own value, e.g.
    ``inequivalent arg 'x-max-length' for queue 'q' in vhost '/': received the
    value '5' of type 'long' but current is the value '10' of type 'long'``.

    Attributes:
        argument: the argument (``x-...``) or flag (``durable``, ``auto_delete``) named.
        present: the queue has a value for it (False: ``current is none``).
        value: the queue's own value (None when not ``present``): a bool for a
            flag or a ``bool`` argument, an int or float for numbers, else the text.
        text: the broker's own words for that value (``'quorum'``, ``none``, ...).
    """

    argument: str
    present: bool
    value: Any
    text: str


def inequivalence(fault: Fault) -> Inequivalence | None:  # noqa: PLR0911 (a parser: one return per kind of value)
    """The argument a 406 ``inequivalent arg`` refusal names, and the queue's own value.

    None when the refusal is of another kind, or its value's type is not one
    this parser reads (then nothing can be learnt from it).
    """
    match = _INEQUIVALENT.search(fault.reply_text)
    if match is None:
        return None
    argument, _received, current = match.groups()
    current = current.strip()
    if current == "none":
        return Inequivalence(argument, False, None, current)
    typed = _TYPED_VALUE.match(current)
    if typed is None:  # 'quorum', or 'false' for durable
        text = current.strip("'")
        value: Any = (text == "true") if argument in _FLAGS else text
        return Inequivalence(argument, True, value, current)
    text, kind = typed.groups()
    if kind == "longstr":
        return Inequivalence(argument, True, text, current)
    if kind == "bool":
        return Inequivalence(argument, True, text == "true", current)
    try:
        number = float(text) if kind in ("float", "double", "decimal") else int(text)
    except ValueError:
        return None
    return Inequivalence(argument, True, number, current)
