"""Publish a Spark DataFrame to RabbitMQ so that a job's success means every row was confirmed.

An optional extra, ``spark`` (PySpark 4.1+ and PyArrow): from a clone,
``pip install '.[spark]'``. Nothing in ``reliable_mq/__init__.py`` imports this package.

```python
from reliable_mq.spark import PublishSpec, foreach_batch_sink, publish_dataframe, register_data_source

spec = PublishSpec(
    url="amqp://guest:guest@rabbit:5672/",
    routing_key="orders",
    key_columns=("order_id",),
    id_namespace="orders-export-v1",
)
report = publish_dataframe(df, spec)                          # a PublishReport
register_data_source(spark)                                   # df.write.format("rabbitmq")
sink = foreach_batch_sink(spec)                               # writeStream.foreachBatch(sink)
```

How it works (details in ``docs/spark.md``):

* The driver checks everything it can before any task runs: the schema
  (unsupported types, duplicate names: `plan_publish`), the key columns
  (nulls, and duplicates under ``ids="key"``: `check_keys`) and the
  destination (`check_destination`).
* Each partition runs in the executor's Python worker on its own event loop
  and its own connection (none for an empty partition), streams the rows
  through a `ReliablePublisher`'s confirm window and waits for every confirm.
* Message ids are deterministic: by default from the canonical form of the
  whole row (`IdScheme`), so retries, speculative tasks and replayed batches
  send the same ids while distinct rows never share one.
* Bodies are strict JSON following Spark's ``to_json`` (session time zone,
  plain decimals); NaN/Infinity per `NonFinite`.
* Deterministic failures (unroutable, refused, unencodable) stop the partition
  and are raised on the driver without Spark retries; transient ones are
  republished in bounded rounds, then the task fails for Spark to retry.

The package's modules, one job each: ``_spec`` (the spec and its enums),
``_encode`` (schema-directed encoders), ``_plan`` (spec x schema, the row
encoder, ids), ``_partition`` (the executor side), ``_driver`` (checks, the
job, the report), ``_stream`` (micro-batches and stopping), ``_source`` (batch reads of a
stream), ``_rows`` (a read's schema and rows: the body binary or JSON, with
``_ddl`` and ``_json_types``), ``_stream_source`` (streaming reads),
``datasource`` (the ``rabbitmq`` format).
"""

from __future__ import annotations

try:
    import pyarrow  # noqa: F401
    import pyspark  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    from .._extras import missing_extra

    raise ImportError(
        missing_extra("reliable_mq.spark needs PySpark and PyArrow", "spark")
    ) from exc

from ._driver import (
    PublishReport,
    check_destination,
    check_keys,
    partition_publisher,
    plan_for,
    publish_dataframe,
    raise_for_stats,
)
from ._errors import (
    DestinationNotFound,
    DuplicateKeys,
    MalformedBody,
    NullKey,
    PartitionNotConfirmed,
    StreamStopping,
    UnsupportedSchema,
)
from ._partition import PartitionStats, current_task, publish_partition
from ._plan import (
    HEADER_BATCH_ID,
    HEADER_PARTITION,
    HEADER_TASK_ATTEMPT,
    PublishPlan,
    TaskInfo,
    arrow_rows,
    message_id_for,
    plan_publish,
)
from ._rows import READ_SCHEMA, BadRows, BodyFormat, RowFormat
from ._source import ReadSpec
from ._spec import IdScheme, NonFinite, PublishSpec
from ._stream import BatchSink, foreach_batch_sink, stop_after_current_batch
from ._stream_source import StreamSourceSpec
from .datasource import RabbitMQDataSource, register_data_source

__all__ = (
    "BadRows",
    "BatchSink",
    "BodyFormat",
    "DestinationNotFound",
    "DuplicateKeys",
    "HEADER_BATCH_ID",
    "HEADER_PARTITION",
    "HEADER_TASK_ATTEMPT",
    "IdScheme",
    "MalformedBody",
    "NonFinite",
    "NullKey",
    "PartitionNotConfirmed",
    "PartitionStats",
    "PublishPlan",
    "PublishReport",
    "PublishSpec",
    "READ_SCHEMA",
    "RabbitMQDataSource",
    "ReadSpec",
    "RowFormat",
    "StreamSourceSpec",
    "StreamStopping",
    "TaskInfo",
    "UnsupportedSchema",
    "arrow_rows",
    "check_destination",
    "check_keys",
    "current_task",
    "foreach_batch_sink",
    "message_id_for",
    "partition_publisher",
    "plan_for",
    "plan_publish",
    "publish_dataframe",
    "publish_partition",
    "raise_for_stats",
    "register_data_source",
    "stop_after_current_batch",
)
