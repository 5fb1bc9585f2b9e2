"""The one classifier of lower-layer errors, tested as a table."""

from __future__ import annotations

import asyncio

import aiormq
import pytest
from pamqp.exceptions import UnmarshalingException

from reliable_mq._amqp.faults import (
    Fault,
    FaultKind,
    classify,
    classify_close,
    consumer_timeout_of,
    reader_error,
)

E = aiormq.exceptions

CONSUMER_TIMEOUT_TEXT = (
    "PRECONDITION_FAILED - delivery acknowledgement on channel 1 timed out. Timeout value "
    "used: 4000 ms. This timeout value can be configured, see consumers doc guide to learn more"
)
"""RabbitMQ 3.10.8's text, as a private node with ``consumer_timeout = 4000`` sent it."""

TABLE: list[tuple[BaseException, FaultKind, int | None, bool]] = [
    (
        E.ChannelNotFoundEntity("NOT_FOUND - no exchange 'x' in vhost '/'"),
        FaultKind.NOT_FOUND,
        404,
        False,
    ),
    (
        E.ChannelAccessRefused(
            "ACCESS_REFUSED - cannot publish to internal exchange 'i' in vhost '/'"
        ),
        FaultKind.REFUSED,
        403,
        False,
    ),
    (
        E.ChannelPreconditionFailed("PRECONDITION_FAILED - invalid expiration"),
        FaultKind.REFUSED,
        406,
        False,
    ),
    (E.ChannelPreconditionFailed(CONSUMER_TIMEOUT_TEXT), FaultKind.CONSUMER_TIMEOUT, 406, False),
    (
        E.ChannelClosed(
            406, "PRECONDITION_FAILED - delivery acknowledgement on channel 7 timed out"
        ),
        FaultKind.CONSUMER_TIMEOUT,
        406,
        False,
    ),
    (E.ChannelLockedResource("RESOURCE_LOCKED - exclusive"), FaultKind.REFUSED, 405, False),
    (E.ChannelClosed(None, None), FaultKind.CHANNEL_LOST, None, False),
    (E.ChannelClosed(320, "CONNECTION_FORCED"), FaultKind.CHANNEL_LOST, 320, False),
    (E.ChannelClosed(530, "NOT_ALLOWED"), FaultKind.REFUSED, 530, False),
    (E.ChannelInvalidStateError("closed"), FaultKind.CHANNEL_LOST, None, False),
    (
        E.ConnectionChannelError("CHANNEL_ERROR - expected 'channel.open'"),
        FaultKind.CONNECTION_LOST,
        504,
        True,
    ),
    (E.ConnectionInternalError("INTERNAL_ERROR"), FaultKind.REFUSED, 541, True),
    (E.ConnectionFrameError("FRAME_ERROR"), FaultKind.REFUSED, 501, True),
    (
        E.ConnectionClosed(320, "CONNECTION_FORCED - closed by test"),
        FaultKind.CONNECTION_LOST,
        320,
        True,
    ),
    (E.ConnectionClosed(403, "ACCESS_REFUSED - vhost"), FaultKind.AUTH_REFUSED, 403, True),
    (E.ProbableAuthenticationError("ACCESS_REFUSED"), FaultKind.AUTH_REFUSED, 403, True),
    (
        # aiormq's text for a connection.close in reply to connection.open (no such vhost)
        E.InvalidFrameError(
            "Expected one of ['Connection.OpenOk'], got <Connection.Close object at 0x7f3a>"
        ),
        FaultKind.VHOST_REFUSED,
        530,
        True,
    ),
    (
        E.InvalidFrameError("Expected one of ['Basic.QosOk'], got <x>"),
        FaultKind.CHANNEL_LOST,
        None,
        False,
    ),
    (E.AMQPConnectionError("reset"), FaultKind.CONNECTION_LOST, None, True),
    (ConnectionResetError("reset by peer"), FaultKind.CONNECTION_LOST, None, True),
    (OSError("unreachable"), FaultKind.CONNECTION_LOST, None, True),
    (TimeoutError(), FaultKind.TIMEOUT, None, False),
]


class TestClassify:
    @pytest.mark.parametrize(("exc", "kind", "code", "connection_level"), TABLE)
    def test_table(
        self, exc: BaseException, kind: FaultKind, code: int | None, connection_level: bool
    ) -> None:
        """Each lower-layer error maps to one fault kind, code and level."""
        fault = classify(exc)
        assert fault is not None
        assert (fault.kind, fault.reply_code, fault.connection_level) == (
            kind,
            code,
            connection_level,
        )

    def test_not_a_broker_error(self) -> None:
        """Programming errors are not faults: the caller re-raises them."""
        assert classify(KeyError("x")) is None
        assert classify(ValueError("x")) is None

    def test_entity_is_parsed_from_the_reply_text(self) -> None:
        """The exchange or queue a refusal names is available to match on."""
        fault = classify(E.ChannelNotFoundEntity("NOT_FOUND - no exchange 'a b' in vhost '/'"))
        assert fault is not None and fault.names("exchange", "a b")
        assert not fault.names("exchange", "a")

    def test_passwords_never_reach_the_text(self) -> None:
        """A URL quoted in an error keeps its password out of the fault."""
        fault = classify(OSError("cannot reach amqp://u:s3cret@host:5672/"))
        assert fault is not None and "s3cret" not in fault.reply_text

    def test_consumer_timeout_names_the_value_used(self) -> None:
        """The broker's consumer_timeout is read from its text; it is not a refusal."""
        fault = classify(E.ChannelPreconditionFailed(CONSUMER_TIMEOUT_TEXT))
        assert fault is not None and not fault.refusal
        assert consumer_timeout_of(fault) == 4.0
        older = classify(
            E.ChannelPreconditionFailed(
                "PRECONDITION_FAILED - delivery acknowledgement on channel 2 timed out"
            )
        )
        assert older is not None and older.kind is FaultKind.CONSUMER_TIMEOUT
        assert consumer_timeout_of(older) is None  # before 3.9 the text does not say
        refused = classify(E.ChannelPreconditionFailed("PRECONDITION_FAILED - invalid expiration"))
        assert refused is not None and consumer_timeout_of(refused) is None
        # Another reply code with those words is not the broker's consumer_timeout.
        other = classify(E.ChannelClosed(530, "delivery acknowledgement on channel 1 timed out"))
        assert other is not None and other.kind is FaultKind.REFUSED

    def test_refusal_and_broker_initiated(self) -> None:
        """Refusals are the 404 and 40x/50x answers to something we sent."""
        assert Fault(FaultKind.NOT_FOUND, 404).refusal
        assert not Fault(FaultKind.CHANNEL_LOST, 320).refusal
        assert Fault(FaultKind.CHANNEL_LOST, 320).broker_initiated
        assert not Fault(FaultKind.CONNECTION_LOST, None).broker_initiated


class TestClassifyClose:
    @pytest.mark.parametrize(
        ("code", "connection_level", "kind"),
        [
            (200, False, FaultKind.CHANNEL_LOST),
            (320, True, FaultKind.CONNECTION_LOST),
            (404, False, FaultKind.NOT_FOUND),
            (403, False, FaultKind.REFUSED),
            (406, False, FaultKind.REFUSED),
            (504, True, FaultKind.CONNECTION_LOST),
            (541, True, FaultKind.REFUSED),
            (None, False, FaultKind.CHANNEL_LOST),
        ],
    )
    def test_table(self, code: int | None, connection_level: bool, kind: FaultKind) -> None:
        """Close frames classify by reply code and level."""
        assert classify_close(code, "x", connection_level=connection_level).kind is kind

    def test_consumer_timeout(self) -> None:
        """A 406 close with the broker's consumer_timeout text is a fault of its own."""
        fault = classify_close(406, CONSUMER_TIMEOUT_TEXT, connection_level=False)
        assert fault.kind is FaultKind.CONSUMER_TIMEOUT
        assert consumer_timeout_of(fault) == 4.0


@pytest.mark.unit
class TestCodeBoundaries:
    """A reply code at the edge between a lost channel (below 400) and a refusal (400 up)."""

    @pytest.mark.parametrize(
        ("code", "kind"),
        [
            (399, FaultKind.CHANNEL_LOST),
            (400, FaultKind.REFUSED),
            (403, FaultKind.REFUSED),
            (406, FaultKind.REFUSED),
            (499, FaultKind.REFUSED),
            (500, FaultKind.REFUSED),
            (541, FaultKind.REFUSED),
        ],
    )
    def test_a_plain_channel_closed(self, code: int, kind: FaultKind) -> None:
        """aiormq's plain ``ChannelClosed(code, text)`` (no subclass for the code):
        every 4xx and 5xx code is a refusal, a lower one a lost channel."""
        fault = classify(E.ChannelClosed(code, "TEXT - x"))
        assert fault is not None
        assert (fault.kind, fault.reply_code, fault.connection_level) == (kind, code, False)

    @pytest.mark.parametrize(
        ("code", "kind"),
        [(399, FaultKind.CHANNEL_LOST), (400, FaultKind.REFUSED), (505, FaultKind.REFUSED)],
    )
    def test_a_close_frame(self, code: int, kind: FaultKind) -> None:
        """A ``channel.close`` frame's code, at the same edge."""
        assert classify_close(code, "x", connection_level=False).kind is kind


@pytest.mark.unit
class TestReaderError:
    """`reader_error`: what our frame reader raises, as aiormq's own reader would."""

    @pytest.mark.parametrize(
        ("exc", "text"),
        [
            (
                asyncio.IncompleteReadError(b"abc", 7),
                "Server connection unexpectedly closed. Read 3 bytes but 7 bytes expected",
            ),
            (
                ConnectionRefusedError(111, "refused"),
                "Server connection refused: ConnectionRefusedError(111, 'refused')",
            ),
            (
                ConnectionResetError(104, "reset"),
                "Server connection reset: ConnectionResetError(104, 'reset')",
            ),
            (BrokenPipeError(32, "pipe"), "Server connection error: BrokenPipeError(32, 'pipe')"),
            (OSError(113, "no route"), "Server communication error: OSError(113, 'no route')"),
        ],
    )
    def test_a_failed_read_ends_the_connection(self, exc: BaseException, text: str) -> None:
        """A read that failed is aiormq's ``AMQPConnectionError``, with aiormq's text
        (a lost connection: `classify` says reconnect)."""
        mapped = reader_error(exc)
        assert type(mapped) is E.AMQPConnectionError
        assert str(mapped.args[0]) == text
        fault = classify(mapped)
        assert fault is not None and fault.kind is FaultKind.CONNECTION_LOST

    def test_a_frame_pamqp_cannot_decode(self) -> None:
        """pamqp's error is aiormq's ``InvalidFrameError``, with pamqp's text."""
        mapped = reader_error(UnmarshalingException("Basic.Deliver", "bad data"))
        assert type(mapped) is E.InvalidFrameError
        assert str(mapped) == str(UnmarshalingException("Basic.Deliver", "bad data"))

    @pytest.mark.parametrize("exc", [ValueError("bug"), KeyError("x"), StopAsyncIteration()])
    def test_anything_else_is_raised_as_is(self, exc: BaseException) -> None:
        """Not a read or decode error (a bug, the end of the stream): None, raise it."""
        assert reader_error(exc) is None
