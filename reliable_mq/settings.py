"""Validated settings, loadable from ``RELIABLE_MQ_*`` environment variables.

Each section is its own ``BaseSettings`` so an application can configure the
publisher without knowing about the consumer. Invalid values raise
[`InvalidSettings`][reliable_mq.errors.InvalidSettings] naming the field, and never echo
the input (a URL may carry a password).
"""

from __future__ import annotations

import enum
import re
import ssl
from dataclasses import dataclass
from typing import Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from yarl import URL

from .errors import InvalidSettings

__all__ = (
    "BrokerAddress",
    "ConnectionSettings",
    "ConsumerSettings",
    "FastPath",
    "PublisherSettings",
    "TLSSettings",
    "redact_credentials",
    "redact_url",
)

_AMQP_SCHEMES = ("amqp", "amqps")


def redact_url(url: str | URL) -> str:
    """Return ``url`` with its password replaced by ``***`` (safe to log)."""
    parsed = url if isinstance(url, URL) else URL(url)
    if parsed.password is None:
        return str(parsed)
    return str(parsed.with_password("***"))


_CREDENTIALS = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")


def redact_credentials(text: str) -> str:
    """Replace the password of every ``scheme://user:password@`` inside ``text``.

    For free text that may quote a URL (an error message, a traceback), where
    `redact_url()` cannot be applied because the URL is not separate.
    """
    return _CREDENTIALS.sub(r"\1***@", text)


@dataclass(frozen=True)
class BrokerAddress:
    """One broker URL; ``repr`` and ``str`` never show the password."""

    url: URL

    @property
    def redacted(self) -> str:
        return redact_url(self.url)

    @property
    def vhost(self) -> str:
        """The vhost the URL names, read as aiormq reads it (``/`` when the path is empty)."""
        path = self.url.path
        return "/" if path in ("", "/") else path[1:].replace("%2F", "/")

    def __repr__(self) -> str:
        return f"BrokerAddress({self.redacted!r})"

    __str__ = __repr__


class FastPath(enum.StrEnum):
    """Whether to use the fast paths below aiormq's public API (see `ConnectionSettings.fast_path`)."""

    AUTO = "auto"
    """Check every hook when a connection opens; if one fails, warn once per process and
    use the plain path."""
    ON = "on"
    """Check every hook; if one fails, refuse with `UnsupportedDependency`."""
    OFF = "off"
    """The plain path: aiormq's public ``basic_publish`` and ``basic_consume``."""


class _Settings(BaseSettings):
    """Shared behaviour: friendly, redacted validation errors."""

    model_config = SettingsConfigDict(extra="forbid", frozen=True, validate_default=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = [
                (".".join(str(part) for part in err["loc"]) or "(model)", err["msg"])
                for err in exc.errors(include_input=False, include_url=False)
            ]
            raise InvalidSettings(type(self).__name__, problems) from None


class TLSSettings(_Settings):
    """TLS for ``amqps://`` URLs; the system trust store is used unless ``ca_file`` is set."""

    model_config = SettingsConfigDict(env_prefix="RELIABLE_MQ_TLS_")

    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    verify: bool = True

    def ssl_context(self) -> ssl.SSLContext:
        """Build the client context (certificate checks on unless ``verify`` is off)."""
        context = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file:
            context.load_cert_chain(self.cert_file, self.key_file)
        if not self.verify:
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        return context


class ConnectionSettings(_Settings):
    """How to reach the broker, and how hard to try.

    ``url`` takes one AMQP URL or several separated by commas (or a list): on a
    connection loss the client walks them in order, so a cluster fails over.
    """

    model_config = SettingsConfigDict(env_prefix="RELIABLE_MQ_")

    url: SecretStr = Field(default=SecretStr("amqp://guest:guest@127.0.0.1:5672/"))
    connection_name: str = Field(default="reliable_mq", min_length=1, max_length=200)
    heartbeat: int = Field(default=30, ge=0, le=3600, description="seconds; 0 disables")
    connect_timeout: float = Field(default=10.0, gt=0, le=600)
    reconnect_initial_delay: float = Field(default=0.1, gt=0, le=60)
    reconnect_max_delay: float = Field(default=5.0, gt=0, le=600)
    tls: TLSSettings | None = None
    host: str | None = Field(default=None, description="overrides the host of every URL")
    port: int | None = Field(default=None, ge=1, le=65535, description="overrides the port")
    username: str | None = Field(default=None, description="overrides the user")
    password: SecretStr | None = Field(default=None, description="overrides the password")
    virtual_host: str | None = Field(default=None, description="overrides the vhost")
    fast_path: FastPath = Field(
        default=FastPath.AUTO,
        description="the fast paths below aiormq's public API: auto (checked, with a "
        "warned fallback), on (checked, or refuse), off (the plain path)",
    )

    @field_validator("url", mode="before")
    @classmethod
    def _join_url_list(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)):
            return ",".join(str(item) for item in value)
        return value

    @field_validator("url")
    @classmethod
    def _check_urls(cls, value: SecretStr) -> SecretStr:
        parts = [part.strip() for part in value.get_secret_value().split(",") if part.strip()]
        if not parts:
            raise ValueError("at least one AMQP URL is required")
        for index, part in enumerate(parts):
            try:
                parsed = URL(part)
            except (TypeError, ValueError):
                raise ValueError(f"URL #{index + 1} cannot be parsed") from None
            if parsed.scheme not in _AMQP_SCHEMES:
                raise ValueError(f"URL #{index + 1} must start with amqp:// or amqps://")
            if not parsed.host:
                raise ValueError(f"URL #{index + 1} has no host")
        return SecretStr(",".join(parts))

    @classmethod
    def of(cls, value: str | ConnectionSettings | None) -> ConnectionSettings:
        """What every ``connection=`` argument takes: a URL (or several, comma separated),
        settings, or None (from ``RELIABLE_MQ_*`` variables).

        Raises:
            InvalidSettings: ``value`` is of another type, or not a valid URL.
        """
        if value is None:
            return cls()
        if isinstance(value, ConnectionSettings):
            return value
        if isinstance(value, str):
            return cls(url=SecretStr(value))
        raise InvalidSettings(
            cls.__name__,
            [("url", f"expected an AMQP URL or ConnectionSettings, not {type(value).__name__}")],
        )

    @model_validator(mode="after")
    def _check_delays(self) -> ConnectionSettings:
        if self.reconnect_max_delay < self.reconnect_initial_delay:
            raise ValueError("reconnect_max_delay must be >= reconnect_initial_delay")
        return self

    @property
    def addresses(self) -> tuple[BrokerAddress, ...]:
        """The broker URLs in failover order, with any parts given separately applied."""
        return tuple(
            BrokerAddress(self._apply_parts(URL(part)))
            for part in self.url.get_secret_value().split(",")
        )

    def _apply_parts(self, url: URL) -> URL:
        if self.host is not None:
            url = url.with_host(self.host)
        if self.port is not None:
            url = url.with_port(self.port)
        if self.username is not None or self.password is not None:
            user = self.username if self.username is not None else (url.user or "")
            password = (
                self.password.get_secret_value() if self.password is not None else url.password
            )
            url = url.with_user(user).with_password(password)
        if self.virtual_host is not None:
            url = url.with_path("/" + self.virtual_host.replace("/", "%2F"), encoded=True)
        return url


class PublisherSettings(_Settings):
    """The confirm window, deadlines and retry policy of a `ReliablePublisher`."""

    model_config = SettingsConfigDict(env_prefix="RELIABLE_MQ_PUBLISHER_")

    max_in_flight: int = Field(
        default=1000, ge=1, le=1_000_000, description="unconfirmed messages at most"
    )
    publish_timeout: float = Field(
        default=60.0, gt=0, description="default deadline of one publish(), seconds"
    )
    confirm_timeout: float = Field(
        default=30.0,
        gt=0,
        description="a confirm slower than this marks the channel stuck: it is reopened",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=1000, description="nacks or confirm timeouts before giving up"
    )
    backoff_initial: float = Field(default=0.05, ge=0, le=60)
    backoff_max: float = Field(default=2.0, ge=0, le=600)
    backoff_multiplier: float = Field(default=2.0, ge=1, le=10)
    mandatory: bool = True
    persistent: bool = True
    close_timeout: float = Field(default=30.0, ge=0)
    returns_retried_after_reconnect: float = Field(
        default=10.0,
        ge=0,
        description=(
            "seconds after a REconnect during which basic.return is retried (a restarted "
            "broker may not have recovered its queues yet); 0 turns it off"
        ),
    )
    max_message_size: int = Field(
        default=128 * 1024 * 1024, ge=1, description="bytes; RabbitMQ's own default limit"
    )
    unavailable_timeout: float = Field(
        default=30.0,
        gt=0,
        description=(
            "seconds without a connection after which every message waiting for one fails "
            "with PublishUnavailable, and new publishes fail at once until it is back"
        ),
    )
    trace_create_spans: bool = Field(
        default=True,
        description=(
            "with tracing on, publish_many() gives each message without a traceparent a "
            "'create' span of its own; off, it gets the batch span's context"
        ),
    )

    @model_validator(mode="after")
    def _check_backoff(self) -> PublisherSettings:
        if self.backoff_max < self.backoff_initial:
            raise ValueError("backoff_max must be >= backoff_initial")
        return self

    def backoff(self, failures: int) -> float:
        """Delay before retry number ``failures`` (1-based), capped at ``backoff_max``."""
        delay = self.backoff_initial * self.backoff_multiplier ** max(failures - 1, 0)
        return float(min(delay, self.backoff_max))


class ConsumerSettings(_Settings):
    """Prefetch, concurrency, timeouts, retries and ack batching of a `ReliableConsumer`.

    ``prefetch`` is the ``basic.qos`` count per consumed queue: the most
    deliveries that can be unacknowledged (in a handler, or finished and waiting
    in an ack batch) at once. ``0`` means unlimited and is refused unless
    ``allow_unlimited_prefetch`` is set; the consumer then logs a warning.
    """

    model_config = SettingsConfigDict(env_prefix="RELIABLE_MQ_CONSUMER_", allow_inf_nan=False)

    prefetch: int = Field(default=200, ge=0, le=65535, description="basic.qos prefetch count")
    allow_unlimited_prefetch: bool = False
    concurrency: int | None = Field(
        default=None, ge=1, le=65535, description="handlers running at once; default: prefetch"
    )
    handler_timeout: float | None = Field(
        default=300.0, gt=0, description="seconds; a slower handler is cancelled and retried"
    )
    consumer_timeout: float | None = Field(
        default=None,
        gt=0,
        description="seconds: the broker's consumer_timeout, if known (RabbitMQ's default: "
        "1800). A handler is cut (and retried) at 85% of it after its delivery arrived, at "
        "most 30 s before it, so the broker never closes the channel for it. Unset: learned "
        "from the broker the first time it closes a channel for it",
    )
    max_attempts: int = Field(
        default=5, ge=1, le=10_000, description="handler runs before dead-lettering"
    )
    retry_delays: tuple[float, ...] = Field(
        default=(1.0, 5.0, 30.0),
        min_length=1,
        max_length=32,
        description="seconds before attempt 2, 3, ...; the last one repeats",
    )
    batch_ack: bool = Field(default=True, description="coalesce acks into multiple=true frames")
    ack_batch_size: int = Field(default=50, ge=1, le=65535)
    ack_flush_interval: float = Field(default=0.05, gt=0, le=10, description="seconds")
    trace_parent_from_message: bool = Field(
        default=False,
        description="the process span is a child of the producer's context from the message's "
        "traceparent header (it stays linked too), instead of only linked to it; see Tracing",
    )
    shutdown_grace: float = Field(
        default=30.0, ge=0, description="seconds in-flight handlers get to finish on stop()"
    )
    republish_timeout: float = Field(
        default=30.0, gt=0, description="deadline of a retry/DLQ republish, seconds"
    )
    fallback_delay: float = Field(
        default=1.0,
        gt=0,
        le=60,
        description="seconds a delivery is held before it is requeued when no copy of it "
        "(retry, DLQ, deferral) could be published and the broker cannot dead-letter it; "
        "doubles with each hold of that message in a row, and of any message since a copy "
        "was last published",
    )
    fallback_max_delay: float = Field(
        default=30.0, gt=0, le=3600, description="the cap of that doubling hold, seconds"
    )
    dedup_lease: float | None = Field(
        default=None,
        gt=0,
        description="seconds a de-duplication claim holds a message id; default: "
        "handler_timeout + 30 (600 without a handler timeout)",
    )
    dedup_retention: float = Field(
        default=3600.0,
        gt=0,
        description="seconds the default in-memory dedup store remembers a done id",
    )
    dedup_max_entries: int = Field(
        default=100_000, ge=1, description="ids the default in-memory dedup store keeps (LRU)"
    )

    @field_validator("retry_delays")
    @classmethod
    def _check_delays(cls, value: tuple[float, ...]) -> tuple[float, ...]:
        for delay in value:
            if not 0 < delay <= 86_400 * 7:
                raise ValueError("each retry delay must be > 0 and at most 7 days")
        return value

    @model_validator(mode="after")
    def _check_prefetch(self) -> ConsumerSettings:
        if self.prefetch == 0 and not self.allow_unlimited_prefetch:
            raise ValueError(
                "prefetch=0 means unlimited; set allow_unlimited_prefetch=True to ask for it"
            )
        if self.fallback_max_delay < self.fallback_delay:
            raise ValueError("fallback_max_delay must be >= fallback_delay")
        return self

    @property
    def effective_concurrency(self) -> int | None:
        """The handler limit below prefetch, or None when prefetch already bounds it."""
        if self.concurrency is None:
            return None
        if self.prefetch and self.concurrency >= self.prefetch:
            return None
        return self.concurrency

    @property
    def effective_dedup_lease(self) -> float:
        """The claim lease: ``dedup_lease``, else ``handler_timeout`` + 30 s, else 600 s.

        It must outlast a handler run, or a second consumer could claim the id
        while the first still runs it.
        """
        if self.dedup_lease is not None:
            return self.dedup_lease
        if self.handler_timeout is not None:
            return self.handler_timeout + 30.0
        return 600.0

    def retry_delay(self, attempt: int) -> float:
        """Delay before running attempt ``attempt + 1`` after attempt ``attempt`` failed."""
        index = min(max(attempt, 1) - 1, len(self.retry_delays) - 1)
        return self.retry_delays[index]
