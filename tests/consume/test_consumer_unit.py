"""Consumer pieces that need no broker: handler specs, decoding, settings, topology, Delivery."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from pydantic import BaseModel

from reliable_mq import InvalidSettings, ReliableMQError
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery, Settle
from reliable_mq.handlers import (
    AckPolicy,
    BodyDecodeError,
    HandlerSpec,
    Reject,
    Retry,
    Router,
    decoder_for,
)
from reliable_mq.settings import ConsumerSettings
from reliable_mq.topology import QueueTopology, QueueType


class Order(BaseModel):
    id: int
    item: str


class TestDecoders:
    def test_model_validates_json(self) -> None:
        """A pydantic annotation decodes and validates JSON."""
        decode = decoder_for(Order)
        assert decode(b'{"id": 1, "item": "x"}', "application/json") == Order(id=1, item="x")

    def test_model_schema_error(self) -> None:
        """A body missing a field fails with the field named."""
        with pytest.raises(BodyDecodeError, match="item"):
            decoder_for(Order)(b'{"id": 1}', None)

    def test_bad_json(self) -> None:
        """Malformed JSON fails to decode."""
        with pytest.raises(BodyDecodeError):
            decoder_for(dict)(b"{nope", None)

    def test_wrong_content_type(self) -> None:
        """A JSON handler refuses a body declared as something else."""
        with pytest.raises(BodyDecodeError, match="not JSON"):
            decoder_for(dict)(b"{}", "text/plain")

    def test_dict_list_str_bytes(self) -> None:
        """dict/list decode JSON (type-checked), str is UTF-8, bytes pass through."""
        assert decoder_for(dict)(b'{"a": 1}', None) == {"a": 1}
        assert decoder_for(list)(b"[1, 2]", None) == [1, 2]
        with pytest.raises(BodyDecodeError):
            decoder_for(dict)(b"[1, 2]", None)
        assert decoder_for(str)("héllo".encode(), "text/plain") == "héllo"
        with pytest.raises(BodyDecodeError):
            decoder_for(str)(b"\xff\xfe", None)
        assert decoder_for(bytes)(b"\x00", "x/y") == b"\x00"

    def test_generic_annotation(self) -> None:
        """Any type pydantic can validate works, e.g. list[Order]."""
        decoded = decoder_for(list[Order])(b'[{"id": 1, "item": "a"}]', "application/json")
        assert decoded == [Order(id=1, item="a")]


class TestHandlerSpec:
    def test_body_and_delivery(self) -> None:
        """(body, delivery) handlers get both."""

        async def handler(order: Order, delivery: Delivery) -> None: ...

        spec = HandlerSpec.build("q", handler)
        assert spec.wants_delivery
        assert spec.decode is not None

    def test_delivery_only(self) -> None:
        """A single Delivery-annotated parameter means no body decoding."""

        async def handler(delivery: Delivery) -> None: ...

        spec = HandlerSpec.build("q", handler)
        assert spec.decode is None
        assert spec.wants_delivery

    def test_body_only(self) -> None:
        """A single body parameter gets only the body."""

        async def handler(body: bytes) -> None: ...

        assert not HandlerSpec.build("q", handler).wants_delivery

    def test_sync_function_refused_under_manual(self) -> None:
        """A plain def is accepted (run in threads), except under AckPolicy.MANUAL.

        More in tests/sync/test_sync_handlers.py.
        """

        def handler(body: bytes) -> None: ...

        assert HandlerSpec.build("q", handler).sync
        with pytest.raises(TypeError, match="MANUAL"):
            HandlerSpec.build("q", handler, ack_policy=AckPolicy.MANUAL)

    def test_bad_arity_refused(self) -> None:
        """Three positional parameters are refused."""

        async def handler(a: Any, b: Any, c: Any) -> None: ...

        with pytest.raises(TypeError):
            HandlerSpec.build("q", handler)

    def test_router_refuses_two_handlers_per_queue(self) -> None:
        """One handler per queue, also across included routers."""
        router = Router()

        @router.handler("q")
        async def first(body: bytes) -> None: ...

        consumer = ReliableConsumer("amqp://guest:guest@127.0.0.1/")
        consumer.include_router(router)
        with pytest.raises(ValueError, match="already"):

            @consumer.handler("q")
            async def second(body: bytes) -> None: ...

        assert consumer.handlers[0].func is first

    def test_policy_from_string(self) -> None:
        """Policies and queue types accept their string values."""

        async def handler(body: bytes) -> None: ...

        spec = HandlerSpec.build("q", handler, ack_policy=AckPolicy.MANUAL, queue_type="quorum")
        assert spec.ack_policy is AckPolicy.MANUAL
        assert spec.queue_type is QueueType.QUORUM


class TestSignals:
    def test_signals_are_not_errors(self) -> None:
        """Retry and Reject are control flow, outside the ReliableMQError tree."""
        assert not issubclass(Retry, ReliableMQError)
        assert not issubclass(Reject, ReliableMQError)
        assert Retry("x", delay=2).delay == 2
        assert Reject("bad").reason == "bad"


class TestConsumerSettings:
    def test_defaults(self) -> None:
        """prefetch 200, batched acks on."""
        settings = ConsumerSettings()
        assert settings.prefetch == 200
        assert settings.batch_ack
        assert settings.effective_concurrency is None

    @pytest.mark.parametrize("prefetch", [-1, 65536])
    def test_prefetch_range(self, prefetch: int) -> None:
        """prefetch outside 0..65535 is refused, naming the field."""
        with pytest.raises(InvalidSettings, match="prefetch"):
            ConsumerSettings(prefetch=prefetch)

    def test_unlimited_needs_opt_in(self) -> None:
        """prefetch=0 (unlimited) only with allow_unlimited_prefetch."""
        with pytest.raises(InvalidSettings, match="allow_unlimited_prefetch"):
            ConsumerSettings(prefetch=0)
        assert ConsumerSettings(prefetch=0, allow_unlimited_prefetch=True).prefetch == 0

    def test_retry_delays(self) -> None:
        """Delays must be positive; the last one repeats."""
        with pytest.raises(InvalidSettings):
            ConsumerSettings(retry_delays=(1.0, 0.0))
        settings = ConsumerSettings(retry_delays=(1.0, 5.0))
        assert [settings.retry_delay(n) for n in (1, 2, 3, 9)] == [1.0, 5.0, 5.0, 5.0]

    def test_env(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """RELIABLE_MQ_CONSUMER_* variables are read."""
        monkeypatch.setenv("RELIABLE_MQ_CONSUMER_PREFETCH", "42")
        monkeypatch.setenv("RELIABLE_MQ_CONSUMER_RETRY_DELAYS", "[0.5, 2]")
        settings = ConsumerSettings()
        assert settings.prefetch == 42
        assert settings.retry_delays == (0.5, 2.0)

    def test_concurrency_below_prefetch(self) -> None:
        """concurrency only matters below prefetch."""
        assert ConsumerSettings(prefetch=10, concurrency=3).effective_concurrency == 3
        assert ConsumerSettings(prefetch=10, concurrency=30).effective_concurrency is None

    def test_consumer_overrides(self) -> None:
        """Keyword overrides replace single fields of the settings."""
        consumer = ReliableConsumer(
            "amqp://guest:guest@127.0.0.1/",
            settings=ConsumerSettings(max_attempts=7),
            prefetch=17,
        )
        assert consumer.settings.prefetch == 17
        assert consumer.settings.max_attempts == 7
        with pytest.raises(InvalidSettings):
            ReliableConsumer("amqp://guest:guest@127.0.0.1/", prefetch=0)


class TestTopology:
    def test_names_and_arguments(self) -> None:
        """Retry queues TTL and dead-letter back to the work queue."""
        topo = QueueTopology("orders", retry_delays=(1, 5, 30))
        assert topo.retry_queues == ("orders.retry.1s", "orders.retry.5s", "orders.retry.30s")
        assert topo.dead_letter_queue == "orders.dlq"
        assert topo.retry_queue_for(1) == ("orders.retry.1s", 1)
        assert topo.retry_queue_for(7) == ("orders.retry.30s", 30)
        args = topo.retry_queue_arguments(5)
        assert args == {
            "x-message-ttl": 5000,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": "orders",
        }
        assert topo.work_queue_arguments()["x-dead-letter-routing-key"] == "orders.dlq"

    def test_quorum_arguments(self) -> None:
        """Quorum retry queues dead-letter at-least-once."""
        topo = QueueTopology("orders", queue_type=QueueType.QUORUM, retry_delays=(0.25,))
        args = topo.retry_queue_arguments(0.25)
        assert args["x-queue-type"] == "quorum"
        assert args["x-dead-letter-strategy"] == "at-least-once"
        assert args["x-overflow"] == "reject-publish"
        assert topo.retry_queues == ("orders.retry.0.25s",)

    def test_nearest_retry_queue(self) -> None:
        """A Retry(delay=...) goes to the declared queue nearest that delay."""
        topo = QueueTopology("q", retry_delays=(1, 5, 30))
        assert topo.nearest_retry_queue(4) == ("q.retry.5s", 5)


class _Recorder:
    """A settler that records what was asked and settles once, like the consumer's tickets."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self._outcome: Settle | None = None

    @property
    def outcome(self) -> Settle | None:
        return self._outcome

    def _take(self, call: str, outcome: Settle) -> bool:
        if self._outcome is not None:
            return False
        self._outcome = outcome
        self.calls.append(call)
        return True

    async def settle_ack(self, delivery: Delivery) -> bool:
        return self._take("ack", Settle.ACK)

    async def settle_nack(self, delivery: Delivery, requeue: bool) -> bool:
        return self._take(f"nack:{requeue}", Settle.REQUEUE if requeue else Settle.REJECT)

    async def settle_retry(self, delivery: Delivery, reason: str, delay: float | None) -> bool:
        return self._take(f"retry:{reason}", Settle.RETRY)

    async def settle_dead_letter(self, delivery: Delivery, reason: str) -> bool:
        return self._take(f"dead_letter:{reason}", Settle.DEAD_LETTER)


def _delivery(settler: _Recorder) -> Delivery:
    return Delivery(
        body=b"x",
        message_id="m1",
        headers={},
        redelivered=False,
        attempt=1,
        queue="q",
        exchange="",
        routing_key="q",
        content_type=None,
        settler=settler,
    )


class TestDelivery:
    async def test_outcome_comes_from_the_settler(self) -> None:
        """Delivery.outcome is the settler's StrEnum; a second settle returns False."""
        recorder = _Recorder()
        delivery = _delivery(recorder)
        assert delivery.outcome is None and not delivery.settled
        assert await delivery.ack()
        assert not await delivery.reject("late")
        assert recorder.calls == ["ack"]
        assert delivery.outcome is Settle.ACK
        assert delivery.outcome == "ack"
        assert "outcome='ack'" in repr(delivery)

    async def test_each_method_routes(self) -> None:
        """retry/reject/nack reach the matching settler method."""
        for method, expected in (
            ("retry", "retry:retry requested"),
            ("reject", "dead_letter:rejected by handler"),
            ("nack", "nack:True"),
        ):
            recorder = _Recorder()
            assert await getattr(_delivery(recorder), method)()
            assert recorder.calls == [expected]

    async def test_detached_delivery(self) -> None:
        """A Delivery built without a consumer cannot be settled."""
        delivery = Delivery(
            body=b"",
            message_id="",
            headers={},
            redelivered=False,
            attempt=1,
            queue="q",
            exchange="",
            routing_key="q",
            content_type=None,
        )
        with pytest.raises(RuntimeError):
            await delivery.ack()

    def test_the_consumers_constructor_sets_every_field(self) -> None:
        """``Delivery._received`` (positional, the consumer's) makes what the keyword
        constructor makes, field for field, for Delivery and a subclass."""
        recorder = _Recorder()
        fields = {
            "body": b"x",
            "message_id": "m1",
            "headers": {"h": 1},
            "redelivered": True,
            "attempt": 2,
            "queue": "q",
            "exchange": "ex",
            "routing_key": "rk",
            "content_type": "text/plain",
            "correlation_id": "c",
            "reply_to": "r",
            "delivery_tag": 7,
            "properties": object(),
            "settler": recorder,
        }
        assert list(fields) == [*inspect.signature(Delivery).parameters]
        by_keyword = Delivery(**fields)

        class _Sub(Delivery):
            __slots__ = ()

        for cls in (Delivery, _Sub):
            made = cls._received(*fields.values())
            assert type(made) is cls
            assert [getattr(made, slot) for slot in Delivery.__slots__] == [
                getattr(by_keyword, slot) for slot in Delivery.__slots__
            ]


class TestUnresolvableAnnotations:
    def test_local_model_under_future_annotations(self) -> None:
        """A string annotation that cannot be resolved is refused with a clear message."""

        class Local(BaseModel):
            x: int

        async def handler(body: Local, delivery: Delivery) -> None: ...

        with pytest.raises(TypeError, match="cannot resolve"):
            HandlerSpec.build("q", handler)
