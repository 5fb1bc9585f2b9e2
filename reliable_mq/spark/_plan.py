"""A spec checked against a schema on the driver, and the row encoder each task builds from it."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.types import (
    BinaryType,
    CharType,
    DataType,
    IntegralType,
    StringType,
    StructType,
    VarcharType,
)

from .._codec import BYTES_CONTENT_TYPE, JSON_CONTENT_TYPE, TEXT_CONTENT_TYPE, encode_body
from ..errors import InvalidMessage, InvalidSettings
from ..headers import SPARK_BATCH_ID_HEADER, SPARK_PARTITION_HEADER, SPARK_TASK_ATTEMPT_HEADER
from ._encode import (
    Encode,
    HeaderEncode,
    body_encoder,
    canonical_value,
    header_encoder,
    row_problems,
    struct_encoder,
)
from ._errors import NullKey, UnsupportedSchema
from ._spec import IdScheme, NonFinite, PublishSpec
from ._zones import zone_named

__all__ = (
    "HEADER_BATCH_ID",
    "HEADER_PARTITION",
    "HEADER_TASK_ATTEMPT",
    "Prepared",
    "PublishPlan",
    "RowEncoder",
    "TaskInfo",
    "arrow_rows",
    "message_id_for",
    "plan_publish",
)

# The Spark headers of the wire contract, defined in reliable_mq/headers.py;
# re-exported under these names by reliable_mq.spark.
HEADER_PARTITION = SPARK_PARTITION_HEADER
HEADER_TASK_ATTEMPT = SPARK_TASK_ATTEMPT_HEADER
HEADER_BATCH_ID = SPARK_BATCH_ID_HEADER

_TEXT_TYPES = (StringType, CharType, VarcharType)


@dataclass(frozen=True)
class PublishPlan:
    """A `PublishSpec` checked against a DataFrame's schema; what every task runs.

    Built on the driver by `plan_publish`, pickled to the executors.

    Attributes:
        spec: where and how.
        schema: the DataFrame's schema (rows arrive as tuples in this order).
        time_zone: the zone of timestamps in bodies and headers.
    """

    spec: PublishSpec
    schema: StructType
    time_zone: str


def plan_publish(spec: PublishSpec, schema: StructType, *, time_zone: str = "UTC") -> PublishPlan:
    """Check ``spec`` against ``schema`` on the driver, before any task runs.

    Args:
        spec: where and how.
        schema: the schema of the rows to publish.
        time_zone: the session time zone (``spark.sql.session.timeZone``); the
            spec's own ``time_zone`` wins when set.

    Raises:
        InvalidSettings: the spec names a column the schema lacks.
        UnsupportedSchema: no columns at all, a column type with no faithful
            encoding, duplicate column names, or a key/routing-key column of
            the wrong type.
    """
    names = schema.fieldNames()
    if not names:
        raise UnsupportedSchema(
            [
                (
                    "(schema)",
                    "the DataFrame has no columns: its rows have no body and no id to "
                    "publish (select at least one column)",
                )
            ]
        )
    _check_columns(spec, names)
    problems = row_problems(schema, _encoded_columns(spec, schema))
    if spec.routing_key_column is not None:
        data_type = schema[spec.routing_key_column].dataType
        if not isinstance(data_type, (*_TEXT_TYPES, IntegralType)):
            problems.append(
                (
                    spec.routing_key_column,
                    f"a routing key column must be a string or an integer, not "
                    f"{data_type.simpleString()}",
                )
            )
    if problems:
        raise UnsupportedSchema(problems)
    zone = spec.time_zone or time_zone
    try:
        zone_named(zone)
    except ValueError as exc:
        raise InvalidSettings("PublishSpec", [("time_zone", str(exc))]) from None
    return PublishPlan(spec=spec, schema=schema, time_zone=zone)


def _check_columns(spec: PublishSpec, available: Sequence[str]) -> None:
    wanted: dict[str, Sequence[str]] = {
        "key_columns": spec.key_columns,
        "header_columns": spec.header_columns,
        "columns": spec.columns or (),
        "body_column": (spec.body_column,) if spec.body_column else (),
        "routing_key_column": (spec.routing_key_column,) if spec.routing_key_column else (),
    }
    present = set(available)
    problems = [
        (name, f"no column {column!r} in the DataFrame (columns: {', '.join(available)})")
        for name, columns in wanted.items()
        for column in columns
        if column not in present
    ]
    if problems:
        raise InvalidSettings("PublishSpec", problems)


def _encoded_columns(spec: PublishSpec, schema: StructType) -> list[str]:
    """The columns whose values get encoded (and so must have a supported type)."""
    columns = [*spec.key_columns, *spec.header_columns]
    if spec.ids == IdScheme.ROW:
        columns.extend(schema.fieldNames())
    if spec.body_column is not None:
        if not isinstance(schema[spec.body_column].dataType, (BinaryType, *_TEXT_TYPES)):
            columns.append(spec.body_column)
    elif spec.serializer is None:
        columns.extend(spec.columns or schema.fieldNames())
    return columns


@dataclass(frozen=True, slots=True)
class TaskInfo:
    """Where a partition runs: diagnostics for headers, never part of a key-based id."""

    partition: int
    attempt: int
    batch_id: int | None


@dataclass(slots=True)
class Prepared:
    """One row, encoded: what the publisher sends."""

    message_id: str
    body: bytes
    content_type: str
    routing_key: str
    headers: dict[str, Any]


class RowEncoder:
    """Turns a row (a tuple in schema order) into a `Prepared` message."""

    def __init__(self, plan: PublishPlan, task: TaskInfo) -> None:
        spec, schema = plan.spec, plan.schema
        zone = zone_named(plan.time_zone)
        self._spec = spec
        self._task = task
        self._namespace = spec.namespace
        self._index = -1
        positions = {name: i for i, name in enumerate(schema.fieldNames())}
        self._id_text = self._id_encoder(spec, schema, positions)
        self._null_checked = (
            ()
            if spec.allow_null_keys
            else tuple((name, positions[name]) for name in spec.key_columns)
        )
        self._body = self._body_encoder(spec, schema, positions, zone)
        self._routing_position = (
            None if spec.routing_key_column is None else positions[spec.routing_key_column]
        )
        self._header_columns: list[tuple[str, int, HeaderEncode]] = [
            (
                name,
                positions[name],
                header_encoder(schema[name].dataType, name, zone, NonFinite(spec.non_finite)),
            )
            for name in spec.header_columns
        ]
        base = dict(spec.headers)
        base[HEADER_PARTITION] = task.partition
        base[HEADER_TASK_ATTEMPT] = task.attempt
        if task.batch_id is not None:
            base[HEADER_BATCH_ID] = task.batch_id
        self._base_headers = base

    @staticmethod
    def _id_encoder(
        spec: PublishSpec, schema: StructType, positions: Mapping[str, int]
    ) -> Encode | None:
        if spec.ids == IdScheme.ROW:
            return struct_encoder(schema.fields, "", None, NonFinite(spec.non_finite))
        if spec.ids == IdScheme.KEY:
            fields = [schema[name] for name in spec.key_columns]
            encode = struct_encoder(fields, "", None, NonFinite(spec.non_finite))
            picks = [positions[name] for name in spec.key_columns]
            return lambda row: encode([row[i] for i in picks])
        return None  # positional

    def _body_encoder(
        self, spec: PublishSpec, schema: StructType, positions: Mapping[str, int], zone: Any
    ) -> Callable[[Any], tuple[bytes, str]]:
        serializer = spec.serializer
        if serializer is not None:
            return lambda row: encode_body(serializer(row))
        if spec.body_column is not None:
            position = positions[spec.body_column]
            data_type: DataType = schema[spec.body_column].dataType
            if isinstance(data_type, BinaryType):
                return lambda row: (_bytes_or_empty(row[position]), BYTES_CONTENT_TYPE)
            if isinstance(data_type, _TEXT_TYPES):
                return lambda row: ((row[position] or "").encode(), TEXT_CONTENT_TYPE)
            text = body_encoder(data_type, spec.body_column, zone, NonFinite(spec.non_finite))
            return lambda row: (text(row[position]).encode(), JSON_CONTENT_TYPE)
        names = spec.columns or schema.fieldNames()
        fields = [schema[name] for name in names]
        encode = struct_encoder(fields, "", zone, NonFinite(spec.non_finite))
        if spec.columns is None:
            return lambda row: (encode(row).encode(), JSON_CONTENT_TYPE)
        picks = [positions[name] for name in names]
        return lambda row: (encode([row[i] for i in picks]).encode(), JSON_CONTENT_TYPE)

    def __call__(self, row: Sequence[Any]) -> Prepared:
        self._index += 1
        for name, position in self._null_checked:
            if row[position] is None:
                raise NullKey(
                    f"key column {name!r} is null in row {self._index} of partition "
                    f"{self._task.partition}; rows with null keys would share message ids "
                    "(set allow_null_keys=True to publish them anyway)"
                )
        if self._id_text is not None:
            message_id = str(uuid.uuid5(self._namespace, self._id_text(row)))
        else:
            message_id = _positional_id(self._namespace, self._task, self._index)
        body, content_type = self._body(row)
        headers = self._base_headers
        if self._header_columns:
            headers = dict(headers)
            for name, position, encode in self._header_columns:
                headers[name] = encode(row[position])
        return Prepared(message_id, body, content_type, self._routing_key(row, message_id), headers)

    def _routing_key(self, row: Sequence[Any], message_id: str) -> str:
        if self._routing_position is None:
            assert self._spec.routing_key is not None
            return self._spec.routing_key
        value = row[self._routing_position]
        if value is None:
            raise InvalidMessage(
                f"row {message_id}: routing key column {self._spec.routing_key_column!r} is null"
            )
        return str(value)


def _bytes_or_empty(value: Any) -> bytes:
    return b"" if value is None else bytes(value)


def _positional_id(namespace: uuid.UUID, task: TaskInfo, index: int) -> str:
    keys = {"batch": task.batch_id, "index": index, "partition": task.partition}
    return str(uuid.uuid5(namespace, json.dumps(keys, sort_keys=True, separators=(",", ":"))))


def message_id_for(spec: PublishSpec, values: Mapping[str, Any]) -> str:
    """The message id a row gets (for consumers and tests).

    ``values`` holds the key columns (``ids="key"``) or every column of the row
    (``ids="row"``), as PySpark gives them. The id is ``uuid5(spec.namespace,
    canonical text)``; the canonical text is compact JSON with keys sorted,
    timestamps as UTC instants (``"2024-10-27T00:30:00.000000Z"``; pass aware
    datetimes, naive ones are taken as TIMESTAMP_NTZ), decimals as plain
    numbers without trailing zeros (``Decimal('9.00E-7')``, as ``collect()``
    returns a ``DECIMAL(20,7)``, and ``Decimal('0.0000009')`` give one id),
    binary as base64, NaN/Infinity as strings.
    """
    if spec.ids == IdScheme.KEY:
        values = {name: values[name] for name in spec.key_columns}
    return str(uuid.uuid5(spec.namespace, canonical_value(dict(values))))


def arrow_rows(batches: Iterable[Any]) -> Iterator[tuple[Any, ...]]:
    """Rows (tuples in schema order) from ``pyarrow.RecordBatch`` objects.

    Timestamps come out as aware datetimes (exact instants), nested structs as
    dicts, maps as lists of pairs: the encoders accept all of these.
    """
    for batch in batches:
        columns = [column.to_pylist() for column in batch.columns]
        yield from zip(*columns, strict=True)
