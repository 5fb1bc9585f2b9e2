"""`PublishSpec`: what to publish and where, built on the driver, pickled to executors."""

from __future__ import annotations

import enum
import json
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import SecretStr

from ..errors import InvalidSettings
from ..settings import ConnectionSettings, PublisherSettings
from ._zones import zone_named

__all__ = ("IdScheme", "NonFinite", "PublishSpec", "check_destination_option")


class IdScheme(enum.StrEnum):
    """How each row's message id is derived (see ``docs/spark.md``, *Message ids*)."""

    ROW = "row"
    """From every column of the row (canonical form): rows that differ in any
    column never share an id; identical rows do. No extra Spark job. Changing a
    value (or a volatile column such as ``uuid()``) changes the id."""
    KEY = "key"
    """From ``key_columns`` only: one id per key whatever the other columns hold.
    The driver checks that no two rows share a key (one aggregation job) before
    anything is published, and raises `DuplicateKeys` if they do."""
    POSITION = "position"
    """From (batch id, partition, row index): only stable while the input and its
    partitioning are deterministic. For data with no usable columns."""


class NonFinite(enum.StrEnum):
    """What a NaN or ±Infinity float becomes in a JSON body or a header."""

    ERROR = "error"
    """The partition stops with `InvalidBody` naming the column (default)."""
    STRING = "string"
    """The strings ``"NaN"``, ``"Infinity"``, ``"-Infinity"``, as Spark's ``to_json`` writes them."""
    NULL = "null"
    """JSON ``null`` (the value is lost: NaN and null look alike)."""


_LIST_FIELDS = ("key_columns", "header_columns")


@dataclass(frozen=True)
class PublishSpec:
    """What to publish and where; picklable, built on the driver, used on executors.

    Args:
        url: an AMQP URL (several comma separated fail over) or
            `ConnectionSettings`. Stored as a ``SecretStr``, so ``repr`` never
            shows the password.
        routing_key: a fixed routing key (the queue name on the default exchange).
        exchange: the exchange; ``""`` is the default exchange.
        routing_key_column: take the routing key from this column (string or
            integer) instead.
        key_columns: the columns that identify a row. With ``ids="key"`` the id
            derives from them alone; with any scheme a null in them is an error
            unless ``allow_null_keys``.
        id_namespace: names the dataset/export ("orders-export-v1"); change it to
            publish the same rows again under new ids.
        ids: how ids are derived, an `IdScheme` (default ``row``).
        allow_null_keys: accept nulls in key columns (null is then a key value
            like any other; under ``ids="key"`` two null keys are duplicates).
        body_column: send this column's value as the body (binary as is, string
            as text, anything else as JSON).
        columns: for the default JSON body, only these columns (default: all).
        serializer: ``row -> body`` (bytes, str, dict...); replaces the default.
            Must be picklable (cloudpickle: lambdas and local functions are fine).
        header_columns: copy these columns into AMQP headers.
        headers: fixed headers added to every message.
        non_finite: what NaN and ±Infinity become, a `NonFinite` (default: an error).
        time_zone: the zone of timestamps in bodies and headers (an IANA name or
            an offset such as ``+02:00``); default: ``spark.sql.session.timeZone``.
        publisher: window, deadlines and retry policy of each partition's publisher.
        max_task_attempts: rounds inside one task: messages still unconfirmed
            after a round are republished on a fresh connection, at most this
            many rounds in all, then the task fails for Spark to retry.
        connection_name: shown in the broker's connection list (the partition
            number is appended).

    Raises:
        InvalidSettings: the combination of fields is not usable.
    """

    url: SecretStr | str | ConnectionSettings = field(repr=False)
    routing_key: str | None = None
    exchange: str = ""
    routing_key_column: str | None = None
    key_columns: Sequence[str] = ()
    id_namespace: str = ""
    ids: IdScheme | str = IdScheme.ROW
    allow_null_keys: bool = False
    body_column: str | None = None
    columns: Sequence[str] | None = None
    serializer: Callable[[Any], Any] | None = None
    header_columns: Sequence[str] = ()
    headers: Mapping[str, Any] = field(default_factory=dict)
    non_finite: NonFinite | str = NonFinite.ERROR
    time_zone: str | None = None
    publisher: PublisherSettings = field(default_factory=PublisherSettings)
    max_task_attempts: int = 3
    connection_name: str = "reliable_mq.spark"

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        self._set_connection(problems)
        self._set_column_lists(problems)
        object.__setattr__(self, "headers", dict(self.headers))
        self._set_enum("ids", IdScheme, problems)
        self._set_enum("non_finite", NonFinite, problems)
        if (self.routing_key is None) == (self.routing_key_column is None):
            problems.append(("routing_key", "give exactly one of routing_key, routing_key_column"))
        if sum(x is not None for x in (self.body_column, self.serializer, self.columns)) > 1:
            problems.append(("body_column", "give at most one of body_column, serializer, columns"))
        if not self.id_namespace:
            problems.append(("id_namespace", "required: it names the id space of this dataset"))
        if self.ids == IdScheme.KEY and not self.key_columns:
            problems.append(("key_columns", "ids='key' needs key columns"))
        if self.time_zone is not None:
            try:
                zone_named(self.time_zone)
            except ValueError as exc:
                problems.append(("time_zone", str(exc)))
        if self.max_task_attempts < 1:
            problems.append(("max_task_attempts", "must be >= 1"))
        if problems:
            raise InvalidSettings("PublishSpec", problems)

    def _set_connection(self, problems: list[tuple[str, str]]) -> None:
        connection: ConnectionSettings | None
        if isinstance(self.url, ConnectionSettings):
            connection = self.url
        else:
            secret = self.url if isinstance(self.url, SecretStr) else SecretStr(self.url)
            object.__setattr__(self, "url", secret)
            try:
                connection = ConnectionSettings(url=secret, connection_name=self.connection_name)
            except InvalidSettings as exc:
                problems.extend(("url", msg) for _, msg in exc.problems)
                connection = None
        object.__setattr__(self, "_connection", connection)

    def _set_column_lists(self, problems: list[tuple[str, str]]) -> None:
        for name in (*_LIST_FIELDS, "columns"):
            value = getattr(self, name)
            if value is None and name == "columns":
                continue
            if isinstance(value, str):
                problems.append((name, "must be a sequence of column names, not a str"))
            else:
                object.__setattr__(self, name, tuple(value))

    def _set_enum(
        self, name: str, kind: type[IdScheme] | type[NonFinite], problems: list[tuple[str, str]]
    ) -> None:
        value = getattr(self, name)
        try:
            object.__setattr__(self, name, kind(value))
        except ValueError:
            allowed = ", ".join(repr(member.value) for member in kind)
            problems.append((name, f"must be one of {allowed}"))

    def __getstate__(self) -> dict[str, Any]:
        # Settings travel as plain field values and are rebuilt (and validated)
        # on the executor: no pickled pydantic internals, and nothing read from
        # the executor's environment overrides what the driver configured.
        state = dict(self.__dict__)
        state["_connection"] = self.connection.model_dump()
        state["publisher"] = self.publisher.model_dump()
        if isinstance(self.url, ConnectionSettings):
            state["url"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = dict(state)
        connection = ConnectionSettings(**state["_connection"])
        state["_connection"] = connection
        state["publisher"] = PublisherSettings(**state["publisher"])
        if state["url"] is None:
            state["url"] = connection
        self.__dict__.update(state)

    @property
    def connection(self) -> ConnectionSettings:
        """The connection settings (URL validated, password hidden)."""
        return self.__dict__["_connection"]  # type: ignore[no-any-return]

    @property
    def namespace(self) -> uuid.UUID:
        """``uuid5(NAMESPACE_URL, id_namespace)``, the namespace of every message id."""
        return uuid.uuid5(uuid.NAMESPACE_URL, self.id_namespace)

    @classmethod
    def from_options(cls, options: Mapping[str, str]) -> PublishSpec:
        """Build a spec from string options, as ``df.write.format("rabbitmq")`` passes them.

        Every field but ``serializer`` has an option of the same name (Spark
        lower-cases option names; either case works). Lists are JSON arrays or
        comma-separated names; ``headers`` is a JSON object. Connection and
        publisher settings are dotted: ``connection.heartbeat``,
        ``connection.password``, ``connection.tls.ca_file``,
        ``publisher.max_in_flight``...

        Raises:
            InvalidSettings: an unknown option, or a value that does not parse.
        """
        return cls(**_fields_from_options(options))


_SCALAR_OPTIONS = {
    "url": str,
    "routing_key": str,
    "exchange": str,
    "routing_key_column": str,
    "id_namespace": str,
    "ids": str,
    "body_column": str,
    "non_finite": str,
    "time_zone": str,
    "connection_name": str,
}


def _fields_from_options(options: Mapping[str, str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    connection: dict[str, Any] = {}
    publisher: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    for raw_name, value in options.items():
        try:
            if not _take_option(raw_name.lower(), value, fields, connection, publisher):
                problems.append((raw_name, "unknown option (see docs/spark.md, Options)"))
        except ValueError as exc:
            problems.append((raw_name, str(exc)))
    if problems:
        raise InvalidSettings("rabbitmq options", problems)
    if publisher:
        fields["publisher"] = PublisherSettings(**publisher)
    if connection:
        url = fields.pop("url", None)
        if url is not None:
            connection["url"] = SecretStr(url)
        connection.setdefault("connection_name", fields.get("connection_name", "reliable_mq.spark"))
        fields["url"] = ConnectionSettings(**connection)
    if "url" not in fields:
        raise InvalidSettings("rabbitmq options", [("url", "required")])
    return fields


def _take_option(
    name: str,
    value: str,
    fields: dict[str, Any],
    connection: dict[str, Any],
    publisher: dict[str, Any],
) -> bool:
    """Put option ``name`` (lower case) where it belongs; False if it is unknown.

    Raises:
        ValueError: the value does not parse.
    """
    if name in _SCALAR_OPTIONS:
        fields[name] = value
    elif name in ("key_columns", "header_columns", "columns"):
        fields[name] = _names(value)
    elif name == "headers":
        fields[name] = _json_object(value)
    elif name == "allow_null_keys":
        fields[name] = _boolean(value)
    elif name == "max_task_attempts":
        fields[name] = int(value)
    elif name.startswith("connection."):
        _set_dotted(connection, name.removeprefix("connection."), value)
    elif name.startswith("publisher."):
        _set_dotted(publisher, name.removeprefix("publisher."), value)
    else:
        return name in _DATA_SOURCE_OPTIONS
    return True


_DATA_SOURCE_OPTIONS = frozenset({"check_destination", "path", "checkpointlocation"})
"""Options of the data source itself or of Spark (``checkpointLocation``), not of the spec."""


def check_destination_option(options: Mapping[str, str]) -> bool:
    """The data source's ``check_destination`` option (default true), parsed as strictly as
    the spec's own booleans: ``"off"`` or a typo is an error, never a silent true.

    Raises:
        InvalidSettings: the value is not one of true/false, 1/0, yes/no.
    """
    value = options.get("check_destination")
    if value is None:
        return True
    try:
        return _boolean(value)
    except ValueError as exc:
        raise InvalidSettings("rabbitmq options", [("check_destination", str(exc))]) from None


def _names(value: str) -> list[str]:
    text = value.strip()
    if text.startswith("["):
        parsed = json.loads(text)
        if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
            raise ValueError("must be a JSON array of column names")
        return parsed
    return [part.strip() for part in text.split(",") if part.strip()]


def _json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        raise ValueError("must be a JSON object") from None
    if not isinstance(parsed, dict):
        raise ValueError("must be a JSON object")
    return parsed


def _boolean(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("true", "1", "yes"):
        return True
    if lowered in ("false", "0", "no"):
        return False
    raise ValueError("must be true or false")


def _set_dotted(target: dict[str, Any], path: str, value: str) -> None:
    parts = path.split(".")
    for part in parts[:-1]:
        nested = target.setdefault(part, {})
        if not isinstance(nested, dict):
            raise ValueError(f"{part!r} is not a section")
        target = nested
    target[parts[-1]] = value
