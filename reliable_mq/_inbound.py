"""Deliveries of the consumer's channels, taken below aiormq's per-delivery task.

What we own and why. aiormq keeps the socket, parses frames and queues each
channel's frames for that channel's reader task, which calls
``Channel._on_deliver_frame`` for every ``basic.deliver``. aiormq's version
reads the content into a ``BytesIO``, wraps it in a ``DeliveredMessage`` and
starts an asyncio Task per delivery through its future store (a wrapper
object, two sets and two done-callbacks per delivery) to run the consumer
callback. On the channels the consumer opens, and only there, we replace that
one handler (as `reliable_mq._stream` replaces the publisher's confirm, return
and close handlers on its own channel):

* the content header and body frames are taken straight from the channel's
  frame queue (waiting for them only when they have not arrived yet);
* a single-frame body is used as is; a body split over several frames is joined;
* the delivery is handed *synchronously*, in tag order, to a plain function
  (the consumer's dispatcher), which records it and starts the one Task that
  processes it.

Everything else stays aiormq's: the frame reader, RPCs, ``basic.qos``,
``basic.consume``/``basic.cancel`` (our consumer tag is registered the usual
way, and a delivery for a tag that is not registered is dropped, as aiormq
does), settle frames, the close handshake. A header or body frame of the wrong
kind raises from the channel's reader, as in aiormq: the channel closes and the
broker requeues what it had delivered.

Since our tasks are not in aiormq's future store, aiormq no longer cancels
them when the channel closes: the consumer does that itself (see
`reliable_mq._route.ChannelKeeper`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import aiormq
from pamqp.body import ContentBody
from pamqp.commands import Basic
from pamqp.header import ContentHeader

__all__ = ("OnDelivery", "take_deliveries")

OnDelivery = Callable[[Basic.Deliver, Basic.Properties, bytes], None]
"""Called once per delivery, in tag order, from the channel's reader task:
``(deliver frame, properties, body)``. It must not raise (an exception closes
the channel)."""


def take_deliveries(channel: aiormq.Channel, on_delivery: OnDelivery) -> None:
    """Replace ``channel``'s delivery handler: each delivery goes to ``on_delivery``."""
    frames = channel.frames
    get_frame = channel._get_frame
    consumers = channel.consumers

    async def next_frame() -> Any:
        if frames.empty():
            return await get_frame()
        frame = frames.get_nowait()[1]
        frames.task_done()
        return frame

    async def on_deliver(frame: Basic.Deliver) -> None:
        header = await next_frame()
        if not isinstance(header, ContentHeader):
            raise ValueError(f"Unexpected frame {header!r} instead of ContentHeader", header)
        size = header.body_size or 0
        body = b""
        if size:
            content = await next_frame()
            if not isinstance(content, ContentBody):
                raise ValueError(f"Unexpected frame {content!r}", content)
            body = content.value
            if len(body) < size:
                body = await _rest(body, size, next_frame)
        if frame.consumer_tag in consumers:
            on_delivery(frame, header.properties, body)

    channel._on_deliver_frame = on_deliver  # type: ignore[method-assign]


async def _rest(first: bytes, size: int, next_frame: Callable[[], Any]) -> bytes:
    """The rest of a body split over several frames."""
    parts = [first]
    received = len(first)
    while received < size:
        content = await next_frame()
        if not isinstance(content, ContentBody):
            raise ValueError(f"Unexpected frame {content!r}", content)
        parts.append(content.value)
        received += len(content.value)
    return b"".join(parts)
