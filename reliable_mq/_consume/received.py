"""A received message as its handler sees it: a `Delivery` built from its frames.

Runs once per delivery, on the hot path (`reliable_mq._consume.dispatch`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from .._amqp import Basic
from ..delivery import Delivery
from ..headers import ATTEMPT_HEADER, DELIVERY_COUNT_HEADER, NO_CONTENT_TYPE_HEADER

if TYPE_CHECKING:
    from .route import Route
    from .session import Ticket

__all__ = ("int_header", "received")

_NO_HEADERS: Mapping[str, Any] = MappingProxyType({})


def received(
    route: Route, frame: Basic.Deliver, props: Basic.Properties, body: bytes, ticket: Ticket
) -> Delivery:
    """The `Delivery` a handler gets: its attempt counted from our header (and, on a
    quorum queue, the broker's delivery count); its content type None when the
    publisher sent none (a copy of ours says so in a header)."""
    headers: Mapping[str, Any] = props.headers or _NO_HEADERS
    if headers:
        attempt = max(int_header(headers, ATTEMPT_HEADER) or 1, 1)
        if route.quorum:
            attempt += max(int_header(headers, DELIVERY_COUNT_HEADER) or 0, 0)
        content_type = None if NO_CONTENT_TYPE_HEADER in headers else props.content_type
    else:
        attempt, content_type = 1, props.content_type
    return Delivery._received(  # positional: a third of the keyword call's cost
        body,
        props.message_id or "",
        headers,
        bool(frame.redelivered),
        attempt,
        route.queue,
        frame.exchange or "",
        frame.routing_key or "",
        content_type,
        props.correlation_id,
        props.reply_to,
        ticket.tag,
        props,
        ticket,
    )


def int_header(headers: Mapping[str, Any], name: str) -> int | None:
    """An int header's value (ints, and strings of digits); None otherwise."""
    value = headers.get(name)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, (str, bytes)):
        try:
            return int(value)
        except ValueError:
            return None
    return None
