"""The rows of a stream read: their schema from the options, and one row per `StreamRecord`.

Shared by the batch source (``spark.read``) and the streaming one
(``spark.readStream``): both call `RowFormat.from_options` on the driver and
`RowFormat.row` in the tasks.

Options (any case), named as Spark's own JSON source names them:

* ``bodyFormat``: ``binary`` (default: the body as published, column ``body``)
  or ``json`` (the body parsed into the struct column ``value``);
* ``bodySchema``: the body's schema as DDL (``"id BIGINT, name STRING"``),
  for ``json``; or give the whole schema with ``.schema(...)`` instead, its
  ``value`` column being the body's struct;
* ``mode``: what a body that does not parse or match the schema does:
  ``PERMISSIVE`` (default: ``value`` null, the body's text in the corrupt
  column) or ``FAILFAST`` (the task fails with `MalformedBody`, naming the
  stream and offset);
* ``columnNameOfCorruptRecord``: that column's name (default ``_corrupt_body``).

Parsing follows ``from_json``: fields missing from a body are null, fields
the schema does not name are ignored, every field of ``value`` is nullable,
and a value of the wrong type makes the whole body malformed (a string field
takes any JSON value, as its JSON text).
"""

from __future__ import annotations

import datetime as dt
import enum
import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import (
    BinaryType,
    DataType,
    LongType,
    MapType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from ..errors import InvalidSettings
from ..streams import StreamRecord
from ._ddl import parse_schema
from ._errors import MalformedBody
from ._json_types import Convert, Mismatch, converter

__all__ = (
    "BODY_OPTIONS",
    "METADATA_FIELDS",
    "READ_SCHEMA",
    "BadRows",
    "BodyFormat",
    "RowFormat",
)

METADATA_FIELDS = (
    StructField("stream", StringType(), False),
    StructField("offset", LongType(), False),
    StructField("message_id", StringType(), True),
    StructField("routing_key", StringType(), False),
    StructField("exchange", StringType(), False),
    StructField("headers", MapType(StringType(), StringType(), True), False),
    StructField("properties", MapType(StringType(), StringType(), True), False),
    StructField("timestamp", TimestampType(), True),
)
"""The columns of every stream read, whatever the body's format."""

READ_SCHEMA = StructType(
    [*METADATA_FIELDS[:2], StructField("body", BinaryType(), False), *METADATA_FIELDS[2:]]
)
"""The rows of a stream read with ``bodyFormat`` ``binary``: header and property values as text."""

READ_ARROW_SCHEMA = to_arrow_schema(READ_SCHEMA, timezone="UTC")
"""`READ_SCHEMA` as Spark expects it of a ``pyarrow.RecordBatch`` from ``read()``."""

BODY_OPTIONS = ("bodyformat", "bodyschema", "mode", "columnnameofcorruptrecord")
"""The options `RowFormat.from_options` reads (lower case)."""

_OPTIONS = "rabbitmq read options"
_DEFAULT_CORRUPT = "_corrupt_body"


class BodyFormat(enum.StrEnum):
    """Option ``bodyFormat``."""

    BINARY = "binary"
    """The body as published, in the binary column ``body``."""
    JSON = "json"
    """The body parsed as JSON into the struct column ``value`` (``bodySchema``)."""


class BadRows(enum.StrEnum):
    """Option ``mode``: what a JSON body that does not parse or match the schema does."""

    PERMISSIVE = "PERMISSIVE"
    """``value`` is null and the body's text goes to the corrupt column."""
    FAILFAST = "FAILFAST"
    """The task fails with `MalformedBody`, naming the stream and the offset."""


@dataclass(frozen=True)
class RowFormat:
    """How records become rows; built on the driver, pickled to the tasks.

    Attributes:
        body: the body's format.
        body_schema: the body's struct for ``json`` (every field nullable).
        mode: what a malformed JSON body does.
        corrupt_column: the column that gets a malformed body's text (``PERMISSIVE``).
    """

    body: BodyFormat = BodyFormat.BINARY
    body_schema: StructType | None = None
    mode: BadRows = BadRows.PERMISSIVE
    corrupt_column: str = _DEFAULT_CORRUPT

    @classmethod
    def from_options(cls, options: Mapping[str, str], given: StructType | None = None) -> RowFormat:
        """The format from the options (lower-cased keys) and, if any, ``.schema(...)``.

        Raises:
            InvalidSettings: an unknown ``bodyFormat`` or ``mode``, a ``bodySchema``
                that does not parse, ``json`` without a body schema, body options
                with ``binary``, or a given schema that is not the one these
                options read.
        """
        try:
            body = BodyFormat(options.get("bodyformat", "binary").strip().lower())
        except ValueError:
            raise InvalidSettings(_OPTIONS, [("bodyFormat", "'binary' or 'json'")]) from None
        try:
            mode = BadRows(options.get("mode", "PERMISSIVE").strip().upper())
        except ValueError:
            raise InvalidSettings(
                _OPTIONS,
                [("mode", "'PERMISSIVE' (malformed bodies to a column) or 'FAILFAST'")],
            ) from None
        corrupt = options.get("columnnameofcorruptrecord", _DEFAULT_CORRUPT).strip()
        if body is BodyFormat.BINARY:
            extra = [name for name in BODY_OPTIONS[1:] if name in options]
            if extra:
                raise InvalidSettings(
                    _OPTIONS, [(name, "only with bodyFormat json") for name in extra]
                )
            found = cls()
        else:
            found = cls(
                body, _body_schema(options.get("bodyschema"), given, corrupt), mode, corrupt
            )
        found.check(given)
        return found

    def schema(self) -> StructType:
        """The rows' schema: see `READ_SCHEMA`; with ``json``, ``value`` instead of ``body``,
        then the corrupt column (``PERMISSIVE``)."""
        if self.body is BodyFormat.BINARY or self.body_schema is None:
            return READ_SCHEMA
        fields = [*METADATA_FIELDS[:2], StructField("value", self.body_schema, True)]
        fields.extend(METADATA_FIELDS[2:])
        if self.mode is BadRows.PERMISSIVE:
            fields.append(StructField(self.corrupt_column, StringType(), True))
        return StructType(fields)

    def check(self, given: StructType | None) -> None:
        """Raise `InvalidSettings` unless ``given`` (``.schema(...)``, if any) is `schema`."""
        if given is None:
            return
        expected = self.schema()
        if _shape(given) != _shape(expected):
            raise InvalidSettings(
                _OPTIONS,
                [("schema", f"expected {expected.simpleString()}, not {given.simpleString()}")],
            )
        for name in ("value", self.corrupt_column):
            if self.body is BodyFormat.JSON and name in given.fieldNames():
                column = given[name]
                if not column.nullable or column.dataType != _nullable(column.dataType):
                    raise InvalidSettings(
                        _OPTIONS,
                        [
                            (
                                "schema",
                                f"column {name!r} and its fields must be nullable: a body "
                                "may be malformed or lack a field",
                            )
                        ],
                    )

    def row(self, record: StreamRecord) -> tuple[Any, ...]:
        """The row of one record, in `schema`'s order.

        Raises:
            MalformedBody: ``json`` and ``FAILFAST``, and the body does not parse
                or match the schema.
        """
        head = (record.stream, record.offset)
        tail = (
            record.message_id,
            record.routing_key,
            record.exchange,
            {str(k): _text(v) for k, v in record.headers.items()},
            {k: _text(v) for k, v in record.properties.items()},
            record.timestamp,
        )
        if self.body is BodyFormat.BINARY:
            return (*head, record.body, *tail)
        try:
            value = self._parse(record.body)
        except Mismatch as exc:
            if self.mode is BadRows.FAILFAST:
                raise MalformedBody(
                    f"the body at offset {record.offset} of stream {record.stream!r} is not "
                    f"JSON of bodySchema: {exc} (mode FAILFAST; mode PERMISSIVE puts it in "
                    f"column {self.corrupt_column!r})",
                    stream=record.stream,
                    offset=record.offset,
                    reason=str(exc),
                ) from None
            return (*head, None, *tail, record.body.decode("utf-8", "replace"))
        if self.mode is BadRows.PERMISSIVE:
            return (*head, value, *tail, None)
        return (*head, value, *tail)

    @property
    def columnar(self) -> bool:
        """Whether `batch` builds the rows (``binary``): JSON bodies go row by row (`row`)."""
        return self.body is BodyFormat.BINARY

    def batch(self, records: list[StreamRecord]) -> pa.RecordBatch:
        """The rows of ``records`` (``binary`` only) as one Arrow batch of `READ_SCHEMA`.

        Spark takes it as it is, without checking and converting each value of
        each row as it does tuples: the values are the ones `row` gives (a
        naive timestamp is read in the local zone, as Spark reads it).
        """
        utc = dt.UTC
        columns: list[list[Any]] = [[] for _ in range(9)]
        stream, offset, body, message_id, routing_key, exchange, headers, properties, stamp = (
            column.append for column in columns
        )
        for record in records:
            stream(record.stream)
            offset(record.offset)
            body(record.body)
            message_id(record.message_id)
            routing_key(record.routing_key)
            exchange(record.exchange)
            headers({str(k): _text(v) for k, v in record.headers.items()} if record.headers else {})
            properties({k: _text(v) for k, v in record.properties.items()})
            stamp(None if record.timestamp is None else record.timestamp.astimezone(utc))
        return pa.RecordBatch.from_arrays(
            [pa.array(c, type=f.type) for c, f in zip(columns, READ_ARROW_SCHEMA, strict=True)],
            schema=READ_ARROW_SCHEMA,
        )

    @functools.cached_property
    def _convert(self) -> Convert:
        """The body schema's converter, built once per task (never pickled)."""
        assert self.body_schema is not None
        return converter(self.body_schema)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_convert"}

    def _parse(self, body: bytes) -> Any:
        convert = self._convert
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise Mismatch(f"not UTF-8 (byte {exc.start})") from None
        try:
            parsed = json.loads(text)
        except RecursionError:
            raise Mismatch("nested too deeply") from None
        except ValueError as exc:  # JSONDecodeError, and ints over Python's digit limit
            raise Mismatch(f"not JSON ({str(exc)[:120]})") from None
        if not isinstance(parsed, dict):
            raise Mismatch(f"a JSON {type(parsed).__name__}, not an object")
        return convert(parsed)


def _body_schema(ddl: str | None, given: StructType | None, corrupt: str) -> StructType:
    if ddl is not None:
        try:
            parsed = parse_schema(ddl)
        except ValueError as exc:
            raise InvalidSettings(
                _OPTIONS, [("bodySchema", f"not a DDL schema: {str(exc).splitlines()[0][:200]}")]
            ) from None
    elif given is not None and "value" in given.fieldNames():
        value = given["value"].dataType
        if not isinstance(value, StructType):
            raise InvalidSettings(_OPTIONS, [("schema", "column 'value' must be a struct")])
        parsed = value
    elif given is not None:
        raise InvalidSettings(
            _OPTIONS, [("schema", "bodyFormat json reads the body into a struct column 'value'")]
        )
    else:
        raise InvalidSettings(
            _OPTIONS,
            [
                (
                    "bodySchema",
                    "bodyFormat json needs the body's schema: option bodySchema "
                    "(DDL) or .schema(...) with a struct column 'value'",
                )
            ],
        )
    if not corrupt or corrupt in {f.name for f in METADATA_FIELDS} | {"value"}:
        raise InvalidSettings(
            _OPTIONS, [("columnNameOfCorruptRecord", f"{corrupt!r} names another column")]
        )
    nullable = _nullable(parsed)
    assert isinstance(nullable, StructType)
    try:
        converter(nullable)
    except TypeError as exc:
        raise InvalidSettings(_OPTIONS, [("bodySchema", str(exc))]) from None
    return nullable


def _nullable(kind: DataType) -> DataType:
    """``kind`` with every field, element and value nullable (as ``from_json`` reads)."""
    from pyspark.sql.types import ArrayType  # noqa: PLC0415

    if isinstance(kind, StructType):
        return StructType([StructField(f.name, _nullable(f.dataType), True) for f in kind.fields])
    if isinstance(kind, ArrayType):
        return ArrayType(_nullable(kind.elementType), True)
    if isinstance(kind, MapType):
        return MapType(kind.keyType, _nullable(kind.valueType), True)
    return kind


def _shape(schema: StructType) -> list[tuple[str, str]]:
    return [(f.name, _nullable(f.dataType).simpleString()) for f in schema.fields]


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dt.datetime):
        return value.isoformat()
    return str(value)
