"""The settle decision and the copy ladder as tables (reliable_mq._consume.settle), and the copies built.

Pure logic, no broker: every (policy, outcome) pair, every (rung, fault) pair,
every publish error class. The consumer's real-broker tests
(`tests/consume/test_consumer_hardening.py`) prove the paths end to end.
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import pytest
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry

from reliable_mq._amqp.wire import encode_headers
from reliable_mq._consume.copies import COPIED_PROPERTIES, build_copy, copy_properties
from reliable_mq._consume.settle import (
    Cause,
    CopyFault,
    Decision,
    Outcome,
    Rung,
    copy_fault,
    decide,
    next_rung,
)
from reliable_mq.delivery import Delivery, Settle
from reliable_mq.errors import (
    ClosedError,
    ExchangeNotFound,
    InvalidBody,
    InvalidMessage,
    MessageTooLarge,
    PublishAborted,
    PublishError,
    PublishGaveUp,
    PublishRefused,
    PublishTimeout,
    PublishUnavailable,
    PublishUnroutable,
)
from reliable_mq.handlers import AckPolicy, Reject
from reliable_mq.headers import (
    ATTEMPT_HEADER,
    DEAD_LETTER_HEADERS,
    DROPPED_HEADERS_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    LAST_ERROR_HEADER,
    NO_CONTENT_TYPE_HEADER,
    ORIGINAL_EXPIRATION_HEADER,
    ORIGINAL_ROUTING_KEY_HEADER,
    ORIGINAL_USER_ID_HEADER,
    REASON_HEADER,
    SPARK_PARTITION_HEADER,
    DeadLetterReason,
)
from reliable_mq.topology import QueueTopology

R, D, A, M = (
    AckPolicy.RETRY_ON_ERROR,
    AckPolicy.DEAD_LETTER_ON_ERROR,
    AckPolicy.ACK_FIRST,
    AckPolicy.MANUAL,
)
O = Outcome  # noqa: E741 - short for the table

# Expected decision at attempt 1 of 5, per policy: R, D, A, M.
# "settle", "settle+done" (mark the id done before the ack), "settle:reason".
TABLE: dict[Outcome, tuple[str, str, str, str]] = {
    O.ACCEPTED: ("hold", "hold", "ack+done", "hold"),
    O.RETURNED: ("ack+done", "ack+done", "ack+done", "retry"),
    O.ACK_CALLED: ("ack+done", "ack+done", "ack+done", "ack+done"),
    O.RAISED: ("retry", "dead_letter:handler_error", "ack", "retry"),
    O.EXITED: ("retry", "dead_letter:handler_error", "ack", "retry"),
    O.CANCELLED: ("retry", "dead_letter:handler_error", "ack", "retry"),
    O.TIMED_OUT: ("retry", "dead_letter:handler_timeout", "ack", "retry"),
    O.CONSUMER_TIMEOUT: ("retry", "dead_letter:consumer_timeout", "ack", "retry"),
    O.RETRY_SIGNAL: ("retry", "retry", "ack", "retry"),
    O.REJECT_SIGNAL: ("dead_letter:rejected",) * 2 + ("ack", "dead_letter:rejected"),
    O.NACK_CALLED: ("requeue",) * 4,
    O.DROP_CALLED: ("reject",) * 4,
    O.INVALID_BODY: ("dead_letter:invalid_body",) * 4,
    O.UNDECODABLE: ("dead_letter:invalid_properties",) * 4,
    O.TOO_MANY_ATTEMPTS: ("dead_letter:max_attempts",) * 4,
    O.ALREADY_PROCESSED: ("duplicate+done",) * 4,
    O.DUPLICATE: ("duplicate",) * 4,
    O.BUSY: ("defer",) * 4,
    O.STORE_DOWN: ("defer",) * 4,
    O.WAITED: ("defer",) * 4,
    O.UNRECORDED: ("requeue",) * 4,
    O.SHUTDOWN: ("requeue",) * 4,
    O.CHANNEL_DEAD: ("stale",) * 4,
}


def _expected(text: str) -> Decision:
    done = text.endswith("+done")
    settle, _, reason = text.removesuffix("+done").partition(":")
    return Decision(Settle(settle), DeadLetterReason(reason) if reason else None, done)


class TestDecide:
    def test_every_outcome_has_a_row(self) -> None:
        """The table covers every outcome (a new one must be decided on purpose)."""
        assert set(TABLE) == set(Outcome)

    @pytest.mark.parametrize("outcome", list(Outcome))
    @pytest.mark.parametrize(
        "index", range(4), ids=["retry_on_error", "dlq_on_error", "ack_first", "manual"]
    )
    def test_first_attempt(self, outcome: Outcome, index: int) -> None:
        """Each (policy, outcome) at attempt 1 of 5 gives the table's decision."""
        policy = (R, D, A, M)[index]
        assert decide(policy, outcome, 1, 5) == _expected(TABLE[outcome][index])

    @pytest.mark.parametrize("outcome", list(Outcome))
    @pytest.mark.parametrize("policy", [R, D, A, M])
    def test_last_attempt_turns_retries_into_dead_letters(
        self, outcome: Outcome, policy: AckPolicy
    ) -> None:
        """At attempt 5 of 5 a retry becomes a dead letter (max_attempts); nothing else moves."""
        first = decide(policy, outcome, 1, 5)
        last = decide(policy, outcome, 5, 5)
        if first.settle is Settle.RETRY:
            assert last == Decision(Settle.DEAD_LETTER, DeadLetterReason.MAX_ATTEMPTS)
        else:
            assert last == first

    def test_only_effects_mark_done(self) -> None:
        """mark_done only with an ack-like settle, and only when the handler's effect happened."""
        for outcome in Outcome:
            for policy in (R, D, A, M):
                decision = decide(policy, outcome, 1, 5)
                if decision.mark_done:
                    assert decision.settle in (Settle.ACK, Settle.DUPLICATE)


class TestLadder:
    COPY_RUNGS = (Rung.FULL_COPY, Rung.TRIMMED_COPY)

    @pytest.mark.parametrize(
        ("rung", "fault", "expected"),
        [
            (Rung.FULL_COPY, CopyFault.INVALID, Rung.TRIMMED_COPY),
            (Rung.FULL_COPY, CopyFault.REFUSED, Rung.TRIMMED_COPY),
            (Rung.FULL_COPY, CopyFault.NACKED, Rung.BROKER_DEAD_LETTER),
            (Rung.FULL_COPY, CopyFault.UNROUTABLE, Rung.BROKER_DEAD_LETTER),
            (Rung.FULL_COPY, CopyFault.UNKNOWN, Rung.REQUEUE_LATER),
            (Rung.FULL_COPY, CopyFault.UNAVAILABLE, Rung.REQUEUE_LATER),
            (Rung.TRIMMED_COPY, CopyFault.INVALID, Rung.BROKER_DEAD_LETTER),
            (Rung.TRIMMED_COPY, CopyFault.REFUSED, Rung.BROKER_DEAD_LETTER),
            (Rung.TRIMMED_COPY, CopyFault.NACKED, Rung.BROKER_DEAD_LETTER),
            (Rung.TRIMMED_COPY, CopyFault.UNROUTABLE, Rung.BROKER_DEAD_LETTER),
            (Rung.TRIMMED_COPY, CopyFault.UNKNOWN, Rung.REQUEUE_LATER),
            (Rung.TRIMMED_COPY, CopyFault.UNAVAILABLE, Rung.REQUEUE_LATER),
        ],
    )
    def test_retry_copy_on_a_queue_with_dlx(
        self, rung: Rung, fault: CopyFault, expected: Rung
    ) -> None:
        """A retry copy: trim what the broker cannot take, then let the broker dead-letter it."""
        got = next_rung(
            rung, fault, purpose=Settle.RETRY, queue_has_dlx=True, copy_goes_to_dlx_target=False
        )
        assert got is expected

    @pytest.mark.parametrize("rung", COPY_RUNGS)
    @pytest.mark.parametrize("fault", list(CopyFault))
    def test_no_dlx_never_rejects(self, rung: Rung, fault: CopyFault) -> None:
        """Without a known DLX a reject would drop the message: never chosen."""
        for purpose in (Settle.RETRY, Settle.DEAD_LETTER, Settle.DEFER):
            got = next_rung(
                rung, fault, purpose=purpose, queue_has_dlx=False, copy_goes_to_dlx_target=False
            )
            assert got is not Rung.BROKER_DEAD_LETTER

    @pytest.mark.parametrize("fault", [CopyFault.NACKED, CopyFault.UNROUTABLE])
    def test_dlq_missing_or_full_is_not_dead_lettered_into(self, fault: CopyFault) -> None:
        """The DLQ itself refuses: the broker's dead-lettering there would drop it."""
        for rung in self.COPY_RUNGS:
            got = next_rung(
                rung,
                fault,
                purpose=Settle.DEAD_LETTER,
                queue_has_dlx=True,
                copy_goes_to_dlx_target=True,
            )
            assert got is Rung.REQUEUE_LATER

    @pytest.mark.parametrize("fault", list(CopyFault))
    def test_deferral_is_never_dead_lettered(self, fault: CopyFault) -> None:
        """A deferred delivery never ran its handler: it is requeued, never dead-lettered."""
        for rung in self.COPY_RUNGS:
            got = next_rung(
                rung, fault, purpose=Settle.DEFER, queue_has_dlx=True, copy_goes_to_dlx_target=False
            )
            assert got in (Rung.TRIMMED_COPY, Rung.REQUEUE_LATER)

    @pytest.mark.parametrize("purpose", [Settle.RETRY, Settle.DEAD_LETTER, Settle.DEFER])
    @pytest.mark.parametrize("dlx", [True, False])
    def test_the_ladder_always_ends(self, purpose: Settle, dlx: bool) -> None:
        """From the full copy, any sequence of faults ends on a terminal rung within two."""

        def walk(rung: Rung, failures: int) -> None:
            if rung not in self.COPY_RUNGS:
                return
            assert failures < 2
            for fault in CopyFault:
                after = next_rung(
                    rung,
                    fault,
                    purpose=purpose,
                    queue_has_dlx=dlx,
                    copy_goes_to_dlx_target=purpose is Settle.DEAD_LETTER,
                )
                assert after not in (Rung.FULL_COPY, rung)
                walk(after, failures + 1)

        walk(Rung.FULL_COPY, 0)

    def test_refuses_a_terminal_rung(self) -> None:
        with pytest.raises(ValueError):
            next_rung(
                Rung.REQUEUE_LATER,
                CopyFault.INVALID,
                purpose=Settle.RETRY,
                queue_has_dlx=True,
                copy_goes_to_dlx_target=False,
            )


def _publish_error(cls: type[PublishError], **extra: Any) -> PublishError:
    return cls("x", message_id="m", attempts=1, **extra)


class TestCopyFault:
    @pytest.mark.parametrize(
        ("error", "fault"),
        [
            (InvalidMessage("header value is NaN"), CopyFault.INVALID),
            (InvalidBody("cannot encode"), CopyFault.INVALID),
            (_publish_error(MessageTooLarge), CopyFault.INVALID),
            (_publish_error(PublishRefused, reply_code=406, reply_text="x"), CopyFault.REFUSED),
            (
                _publish_error(ExchangeNotFound, reply_code=404, reply_text="x"),
                CopyFault.UNROUTABLE,
            ),
            (
                PublishUnroutable(
                    message_id="m",
                    attempts=1,
                    exchange="",
                    routing_key="q",
                    reply_code=312,
                    reply_text="NO_ROUTE",
                ),
                CopyFault.UNROUTABLE,
            ),
            (_publish_error(PublishGaveUp), CopyFault.NACKED),
            (_publish_error(PublishTimeout), CopyFault.UNKNOWN),
            (_publish_error(PublishAborted), CopyFault.UNKNOWN),
            (_publish_error(PublishUnavailable), CopyFault.UNAVAILABLE),
            (ClosedError("closing"), CopyFault.UNAVAILABLE),
            (TypeError("unencodable header"), CopyFault.INVALID),
            (RecursionError(), CopyFault.INVALID),
        ],
    )
    def test_classification(self, error: BaseException, fault: CopyFault) -> None:
        """Every error a copy's publish can raise maps to one fault."""
        assert copy_fault(error) is fault


def _delivery(headers: dict[str, Any], content_type: str | None = "application/json") -> Delivery:
    return Delivery(
        body=b'{"a": 1}',
        message_id="m-1",
        headers=headers,
        redelivered=False,
        attempt=2,
        queue="orders",
        exchange="ex",
        routing_key="orders.new",
        content_type=content_type,
    )


TOPOLOGY = QueueTopology("orders", retry_delays=(1.0, 5.0))


def _received(**values: Any) -> Basic.Properties:
    """Properties as a delivery's decoder makes them: any value, none checked
    (pamqp's constructor refuses a cluster_id, reserved in AMQP 0-9-1; RabbitMQ
    passes one through)."""
    props = Basic.Properties()
    for name, value in values.items():
        setattr(props, name, value)
    return props


class TestCopies:
    def test_full_retry_copy(self) -> None:
        """A retry copy keeps every header but x-delivery-count and adds attempt and error."""
        delivery = _delivery({"app": "x" * 5000, "x-delivery-count": 3}, content_type=None)
        copy = build_copy(
            delivery,
            TOPOLOGY,
            1.0,
            Decision(Settle.RETRY),
            Cause(Outcome.RAISED, ValueError("boom")),
        )
        assert copy.queue == "orders.retry.5s" and copy.delay == 5.0
        assert copy.headers["app"] == "x" * 5000
        assert "x-delivery-count" not in copy.headers
        assert copy.headers[ATTEMPT_HEADER] == 3
        assert copy.headers[LAST_ERROR_HEADER] == "ValueError: boom"
        assert NO_CONTENT_TYPE_HEADER not in copy.headers  # no content type: none on the copy
        assert copy.properties["content_type"] is None
        assert copy.headers[ORIGINAL_ROUTING_KEY_HEADER] == "orders.new"
        assert not copy.trimmed

    def test_trimmed_dead_letter_copy(self) -> None:
        """A trimmed copy keeps small wire-contract headers and names what it dropped."""
        headers = {
            "app": "x" * 5000,
            "trace": 1,
            SPARK_PARTITION_HEADER: 4,
            ORIGINAL_ROUTING_KEY_HEADER: "first.key",
            LAST_ERROR_HEADER: "y" * 5000,
        }
        copy = build_copy(
            _delivery(headers),
            TOPOLOGY,
            1.0,
            Decision(Settle.DEAD_LETTER, DeadLetterReason.REJECTED),
            Cause(Outcome.REJECT_SIGNAL, Reject("bad order"), "bad order"),
            trimmed=True,
        )
        assert copy.queue == "orders.dlq" and copy.trimmed
        assert set(DEAD_LETTER_HEADERS) <= set(copy.headers)
        assert copy.headers[REASON_HEADER] == "rejected"
        assert copy.headers[ERROR_TYPE_HEADER] == "Reject"
        assert copy.headers[ERROR_MESSAGE_HEADER] == "bad order"
        assert copy.headers[SPARK_PARTITION_HEADER] == 4
        assert copy.headers[ORIGINAL_ROUTING_KEY_HEADER] == "first.key"
        assert copy.headers[DROPPED_HEADERS_HEADER] == f"app,trace,{LAST_ERROR_HEADER}"
        assert "app" not in copy.headers and "trace" not in copy.headers

    def test_max_attempts_detail(self) -> None:
        """A delivery over max_attempts names why in the error message."""
        copy = build_copy(
            _delivery({}),
            TOPOLOGY,
            1.0,
            Decision(Settle.DEAD_LETTER, DeadLetterReason.MAX_ATTEMPTS),
            Cause(Outcome.TOO_MANY_ATTEMPTS, note="delivered 9 times, max_attempts=5"),
        )
        assert copy.headers[ERROR_TYPE_HEADER] == "max_attempts"
        assert copy.headers[ERROR_MESSAGE_HEADER] == "delivered 9 times, max_attempts=5"

    def test_text_headers_are_always_utf8(self) -> None:
        """What a handler raised or said, lone surrogates included, is written escaped:
        the publisher would refuse the copy otherwise (and the ladder would skip a retry)."""
        retry = build_copy(
            _delivery({}),
            TOPOLOGY,
            1.0,
            Decision(Settle.RETRY),
            Cause(Outcome.RAISED, ValueError("bad \udfff")),
        )
        assert retry.headers[LAST_ERROR_HEADER] == "ValueError: bad \\udfff"
        dead = build_copy(
            _delivery({}),
            TOPOLOGY,
            1.0,
            Decision(Settle.DEAD_LETTER, DeadLetterReason.HANDLER_ERROR),
            Cause(Outcome.RAISED, ValueError("\ud800" + "x" * 2000)),
        )
        assert dead.headers[ERROR_MESSAGE_HEADER] == "\\ud800" + "x" * 996 + "..."
        reject = build_copy(
            _delivery({}),
            TOPOLOGY,
            1.0,
            Decision(Settle.DEAD_LETTER, DeadLetterReason.REJECTED),
            Cause(Outcome.REJECT_SIGNAL, Reject("no \ud800"), "no \ud800"),
        )
        assert reject.headers[ERROR_MESSAGE_HEADER] == "no \\ud800"
        for copy in (retry, dead, reject):
            encode_headers(copy.headers)  # encodable as they are

    @pytest.mark.parametrize("trimmed", [False, True])
    @pytest.mark.parametrize("decision", [Settle.RETRY, Settle.DEAD_LETTER, Settle.DEFER])
    def test_every_property_is_kept(self, decision: Settle, trimmed: bool) -> None:
        """Retry, DLQ and deferred copies, full or trimmed, carry every property as it
        came (empty strings and absent ones included), but expiration (in a header)."""
        props = _received(
            content_type="",
            content_encoding="gzip",
            headers={"h": 1},
            delivery_mode=1,
            priority=9,
            correlation_id="c",
            reply_to="",
            expiration="64002",
            message_id="m-1",
            timestamp=dt.datetime(2200, 1, 1, tzinfo=dt.UTC),
            message_type="t",
            user_id="guest",
            app_id=None,
            cluster_id="cl",
        )
        delivery = _delivery({"h": 1})
        delivery.properties = props
        copy = build_copy(
            delivery,
            TOPOLOGY,
            1.0,
            Decision(decision, DeadLetterReason.REJECTED),
            Cause(Outcome.RAISED, ValueError("boom")),
            trimmed=trimmed,
            user="guest",
        )
        assert copy.properties == {name: getattr(props, name) for name in COPIED_PROPERTIES} | {
            "user_id": "guest"
        }
        assert "expiration" not in copy.properties
        assert copy.headers[ORIGINAL_EXPIRATION_HEADER] == "64002"
        assert ORIGINAL_USER_ID_HEADER not in copy.headers

    @pytest.mark.parametrize(
        ("user_id", "user", "kept", "recorded"),
        [
            ("guest", "guest", "guest", None),
            ("bob", "guest", None, "bob"),
            ("", "guest", None, ""),
            ("guest", None, None, "guest"),  # auth=external: the broker's name is unknown
            (None, "guest", None, None),
        ],
    )
    def test_user_id_only_as_the_publishing_user(
        self, user_id: str | None, user: str | None, kept: str | None, recorded: str | None
    ) -> None:
        """A user_id the broker would refuse (406) moves to x-reliable-mq-original-user-id."""
        headers: dict[str, Any] = {}
        properties = copy_properties(_received(user_id=user_id), headers, user=user)
        assert properties.get("user_id") == kept
        assert headers.get(ORIGINAL_USER_ID_HEADER) == recorded

    @pytest.mark.parametrize(
        ("message_id", "cluster_id", "want_id", "want_cluster"),
        [("m", "c", "m", "c"), ("", "", None, None), (None, "", None, None)],
    )
    def test_ids_the_publisher_needs(
        self,
        message_id: str | None,
        cluster_id: str,
        want_id: str | None,
        want_cluster: str | None,
    ) -> None:
        """No (or an empty) message_id is None: the publisher gives the copy one (a
        basic.return is matched by it). pamqp reads an absent cluster_id as "": absent."""
        properties = copy_properties(
            _received(message_id=message_id, cluster_id=cluster_id), {}, user="guest"
        )
        assert (properties["message_id"], properties["cluster_id"]) == (want_id, want_cluster)

    def test_deferral_keeps_the_attempt(self) -> None:
        """A deferred copy goes round the first retry queue with the same attempt."""
        copy = build_copy(_delivery({}), TOPOLOGY, 1.0, Decision(Settle.DEFER), Cause(O.BUSY))
        assert (copy.queue, copy.headers[ATTEMPT_HEADER]) == ("orders.retry.1s", 2)


class _Channel:
    """Records frames; closed on demand."""

    def __init__(self) -> None:
        self.frames: list[tuple[str, int]] = []
        self.is_closed = False

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool = False) -> None:
        self.frames.append(("ack_multiple" if multiple else "ack", tag))

    async def basic_nack(
        self, tag: int, *, multiple: bool, requeue: bool, wait: bool = False
    ) -> None:
        self.frames.append(("nack_requeue" if requeue else "nack_drop", tag))


def _session(policy: AckPolicy = R) -> tuple[Any, _Channel]:
    from types import SimpleNamespace

    from reliable_mq._consume.session import Session, Shared
    from reliable_mq.metrics import Metrics
    from reliable_mq.settings import ConsumerSettings

    channel = _Channel()
    route = SimpleNamespace(
        metrics=Metrics.on(CollectorRegistry()).for_queue("q"),
        dedup=None,
        queue="q",
        spec=SimpleNamespace(ack_policy=policy),
        queue_has_dlx=True,
        topology=TOPOLOGY,
    )
    shared = Shared(ConsumerSettings(batch_ack=False))
    return Session(shared, route, channel), channel  # type: ignore[arg-type]


def _ticket(session: Any, tag: int) -> Any:
    ticket = session.admit(tag, None)
    ticket.delivery = Delivery(
        body=b"x",
        message_id=f"m{tag}",
        headers={},
        redelivered=False,
        attempt=1,
        queue="q",
        exchange="",
        routing_key="q",
        content_type=None,
        delivery_tag=tag,
        settler=ticket,
    )
    return ticket


class TestApply:
    async def test_settles_once_whoever_asks(self, caplog: pytest.LogCaptureFixture) -> None:
        """The handler's ack, then the consumer's and a shutdown's settles: one frame."""
        session, channel = _session()
        ticket = _ticket(session, 1)
        assert await ticket.delivery.ack()
        with caplog.at_level("WARNING"):
            assert not await ticket.delivery.nack()
        assert not await ticket.settle(Cause(Outcome.RETURNED))
        assert not await ticket.settle(Cause(Outcome.SHUTDOWN))
        assert channel.frames == [("ack", 1)]
        assert ticket.delivery.outcome is Settle.ACK
        assert "delivery_already_settled" in caplog.text

    async def test_a_forgotten_delivery_answers_without_its_ticket(
        self, caplog: pytest.LogCaptureFixture
    ) -> None:
        """Once its processing ends, a settled delivery no longer holds its ticket (no
        cycle for the garbage collector), and answers a late settle as the ticket did."""
        session, channel = _session()
        ticket = _ticket(session, 1)
        delivery = ticket.delivery
        assert await delivery.ack()
        session.forget(ticket)
        assert delivery._settler is not ticket
        assert delivery.outcome is Settle.ACK and delivery.settled
        with caplog.at_level("WARNING"):
            assert not await delivery.nack()
            assert not await delivery.retry("late")
            assert not await delivery.reject("late")
            assert not await delivery.ack()
        assert channel.frames == [("ack", 1)]
        assert caplog.text.count("delivery_already_settled") == 4
        other = _ticket(session, 2)
        assert await other.delivery.ack()
        session.forget(other)
        assert other.delivery._settler is delivery._settler  # one stand-in per outcome

    async def test_a_delivery_forgotten_unsettled_or_mid_settle_keeps_its_ticket(self) -> None:
        """Its outcome is not final yet: the ticket stays its settler."""
        session, channel = _session()
        unsettled = _ticket(session, 1)
        session.forget(unsettled)
        assert unsettled.delivery._settler is unsettled
        assert await unsettled.delivery.ack()
        assert channel.frames == [("ack", 1)]
        settling = _ticket(session, 2)
        settling._outcome, settling.settling = Settle.ACK, True
        session.forget(settling)
        assert settling.delivery._settler is settling

    async def test_hold_leaves_it_open(self) -> None:
        """ACCEPTED under a policy that does not ack first settles nothing."""
        session, channel = _session()
        ticket = _ticket(session, 1)
        assert not await ticket.settle(Cause(Outcome.ACCEPTED))
        assert not ticket.settled and channel.frames == []
        assert await ticket.settle(Cause(Outcome.NACK_CALLED))
        assert channel.frames == [("nack_requeue", 1)]

    async def test_dead_channel_is_stale(self) -> None:
        """A settle for a dead channel writes nothing and counts as stale."""
        session, channel = _session()
        ticket = _ticket(session, 1)
        channel.is_closed = True
        assert await ticket.settle(Cause(Outcome.RETURNED))
        assert channel.frames == []
        assert session.route.metrics.stale == 1

    async def test_a_bug_in_the_settle_still_requeues(self) -> None:
        """If carrying out the decision raises, the delivery is requeued (after the hold)."""
        session, channel = _session()
        session.shared.stopping = True  # no hold
        session.route.next_requeue_delay = lambda delivery: 0.0
        ticket = _ticket(session, 1)

        async def broken(*args: Any) -> Settle:
            raise RuntimeError("bug")

        session._carry_out = broken
        assert await ticket.settle(Cause(Outcome.RETURNED))
        assert channel.frames == [("nack_requeue", 1)]
        assert ticket.outcome is Settle.REQUEUE

    async def test_retry_without_publisher_requeues_later(self) -> None:
        """No publisher (closing): the copy is UNAVAILABLE, so requeue after the hold."""
        session, channel = _session()
        session.route.next_requeue_delay = lambda delivery: 0.01
        session.route.copy_published = lambda delivery: None
        ticket = _ticket(session, 1)
        assert await ticket.settle(Cause(Outcome.RAISED, ValueError("x")))
        await asyncio.sleep(0)
        assert channel.frames == [("nack_requeue", 1)]
        assert ticket.outcome is Settle.REQUEUE
        assert session.route.metrics.fallback_count == 1


def _route(**settings: Any) -> Any:
    from reliable_mq._consume.route import Route
    from reliable_mq.consumer import ReliableConsumer
    from reliable_mq.metrics import Metrics
    from reliable_mq.settings import ConsumerSettings

    consumer = ReliableConsumer("amqp://guest:guest@127.0.0.1/", registry=CollectorRegistry())

    @consumer.handler("q")
    async def handler(body: bytes) -> None: ...

    return Route(
        consumer.handlers[0],
        ConsumerSettings(**settings),
        Metrics.on(CollectorRegistry()).for_queue("q"),
        "test",
    )


def _held(message_id: str, body: bytes = b"x") -> Delivery:
    return Delivery(
        body=body,
        message_id=message_id,
        headers={},
        redelivered=True,
        attempt=1,
        queue="q",
        exchange="",
        routing_key="q",
        content_type=None,
    )


class TestRequeueLaterHolds:
    def test_a_hopeless_message_backs_off_while_others_copy_fine(self) -> None:
        """Other messages' published copies do not reset one message's own doubling."""
        route = _route(fallback_delay=1.0, fallback_max_delay=30.0)
        poison, other = _held("poison"), _held("other")
        delays = []
        for _ in range(6):
            delays.append(route.next_requeue_delay(poison))
            route.copy_published(other)  # the rest of the traffic is fine
        assert delays == [1, 2, 4, 8, 16, 30]
        route.copy_published(poison)  # a copy of it went through at last: it starts over
        assert route.next_requeue_delay(poison) == 1

    def test_every_copy_failing_grows_across_messages(self) -> None:
        """With no copy published at all, new messages' holds grow as well (the route's
        streak); one published copy ends the streak."""
        route = _route(fallback_delay=0.5, fallback_max_delay=4.0)
        delays = [route.next_requeue_delay(_held(f"m{i}")) for i in range(5)]
        assert delays == [0.5, 1, 2, 4, 4]
        route.copy_published(_held("m9"))
        assert route.next_requeue_delay(_held("m10")) == 0.5
        assert route.next_requeue_delay(_held("m0")) == 1  # its own second hold

    def test_messages_without_id_are_told_apart_by_body(self) -> None:
        """No message id: the body identifies a message across its redeliveries."""
        route = _route(fallback_delay=1.0)
        first, second = _held("", b"a"), _held("", b"b")
        assert [route.next_requeue_delay(first) for _ in range(3)] == [1, 2, 4]
        route.copy_published(_held("x"))
        assert route.next_requeue_delay(second) == 1
        assert route.next_requeue_delay(_held("", b"a")) == 8

    def test_the_memory_is_bounded(self) -> None:
        """Only the most recently held HELD_MESSAGES are remembered."""
        from reliable_mq._consume.route import HELD_MESSAGES

        route = _route(fallback_delay=1.0)
        route.next_requeue_delay(_held("first"))
        for index in range(HELD_MESSAGES):
            route.next_requeue_delay(_held(f"m{index}"))
            route.copy_published(_held("other"))
        assert len(route._held) == HELD_MESSAGES
        assert route.next_requeue_delay(_held("first")) == 1  # forgotten: starts over
