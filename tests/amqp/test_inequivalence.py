"""`inequivalence`: the broker's 406 refusal of a redeclare, read (texts as RabbitMQ 3.10.8 sends them)."""

from __future__ import annotations

from typing import Any

import pytest

from reliable_mq._amqp import Fault, FaultKind, inequivalence

_PREFIX = "PRECONDITION_FAILED - inequivalent arg"


def refused(text: str) -> Fault:
    return Fault(FaultKind.REFUSED, 406, text)


class TestInequivalence:
    @pytest.mark.parametrize(
        ("text", "argument", "present", "value"),
        [
            (
                f"{_PREFIX} 'x-expires' for queue 'q' in vhost '/': received the value '0' of "
                "type 'byte' but current is none",
                "x-expires",
                False,
                None,
            ),
            (
                f"{_PREFIX} 'x-queue-type' for queue 'q' in vhost '/': received 'stream' but "
                "current is 'quorum'",
                "x-queue-type",
                True,
                "quorum",
            ),
            (
                f"{_PREFIX} 'durable' for queue 'q' in vhost '/': received 'true' but current "
                "is 'false'",
                "durable",
                True,
                False,
            ),
            (
                f"{_PREFIX} 'x-max-length' for queue 'q' in vhost '/': received the value '5' "
                "of type 'long' but current is the value '50' of type 'signedint'",
                "x-max-length",
                True,
                50,
            ),
            (
                f"{_PREFIX} 'x-dead-letter-exchange' for queue 'q' in vhost '/': received none "
                "but current is the value 'dlx' of type 'longstr'",
                "x-dead-letter-exchange",
                True,
                "dlx",
            ),
            (
                f"{_PREFIX} 'x-single-active-consumer' for queue 'q' in vhost '/': received "
                "none but current is the value 'true' of type 'bool'",
                "x-single-active-consumer",
                True,
                True,
            ),
        ],
    )
    def test_reads_the_argument_and_the_queues_value(
        self, text: str, argument: str, present: bool, value: Any
    ) -> None:
        """Each kind of value the broker words comes back typed, with the broker's words."""
        found = inequivalence(refused(text))
        assert found is not None
        assert (found.argument, found.present, found.value) == (argument, present, value)
        assert type(found.value) is type(value)
        assert found.text in text

    @pytest.mark.parametrize(
        "text",
        [
            "PRECONDITION_FAILED - invalid arg 'x-expires' for queue 'q' in vhost '/' of "
            "queue type rabbit_stream_queue",
            f"{_PREFIX} 'x-max-length' for queue 'q' in vhost '/': received none but current "
            "is the value 'x' of type 'long'",
            "RESOURCE_LOCKED - cannot obtain exclusive access to locked queue 'q'",
        ],
    )
    def test_other_refusals_and_unreadable_values_give_none(self, text: str) -> None:
        """Another refusal, or a number that does not parse, teaches nothing."""
        assert inequivalence(refused(text)) is None
