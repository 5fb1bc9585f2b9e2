"""RabbitMQ streams: declare one, and read it from an offset.

A stream (``x-queue-type: stream``) keeps its messages after they are read.
Publish to it as to any queue, with confirms (`ReliablePublisher`, the Spark
writer, the outbox relay). Read it with a `StreamReader`, from an offset you
keep, or with the Spark sources (``spark.read.format("rabbitmq")``, and
``spark.readStream`` with offsets in the checkpoint).

```python
from reliable_mq.streams import OffsetRange, StreamReader, declare_stream

await declare_stream(url, "events", max_length_bytes=10 * 2**30, max_age="7D")
async with StreamReader(url, "events") as reader:
    end = await reader.tail()
    async for record in reader.read(OffsetRange("events", 0, end)):
        print(record.offset, record.message_id, record.body)
```

What a `ReliableConsumer` does with queues does not apply to a stream: no
per-message TTL, no dead-lettering, no requeue (a stream keeps everything
until retention removes it), so a consumer refuses one
(`StreamNotSupported`), and a reader refuses a classic or quorum queue
(`NotAStream`): those cannot be read again from an offset.
"""

from ..errors import NotAStream, StreamDataLoss, StreamError, StreamNotSupported
from ._declare import StreamSpec, check_stream, declare_stream, is_stream, refuse_stream
from ._offsets import (
    OffsetRange,
    StartingOffset,
    StartingPoint,
    parse_starting_offset,
    split_range,
)
from ._read import StreamReader, StreamRecord

__all__ = (
    "NotAStream",
    "OffsetRange",
    "StartingOffset",
    "StartingPoint",
    "StreamDataLoss",
    "StreamError",
    "StreamNotSupported",
    "StreamReader",
    "StreamRecord",
    "StreamSpec",
    "check_stream",
    "declare_stream",
    "is_stream",
    "parse_starting_offset",
    "refuse_stream",
    "split_range",
)
