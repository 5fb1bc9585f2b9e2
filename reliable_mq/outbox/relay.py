"""``OutboxRelay``: moves committed outbox rows to RabbitMQ with confirms, then removes them.

One cycle: claim a batch (PostgreSQL: ``FOR UPDATE SKIP LOCKED``; SQLite: a
lease), publish every row through a [ReliablePublisher][reliable_mq.ReliablePublisher],
wait for each confirm, then in one commit delete the confirmed rows, move the
refused ones to ``dead`` with their reason, and put the others back with a
backoff. A row leaves the table only after the broker confirmed it, so a crash
anywhere means a republish (same ``message_id``), never a loss.

Outcome per row, by the publisher's typed errors:

* confirmed: deleted (or kept as ``sent`` for ``keep_sent`` seconds);
* ``PublishUnroutable``, ``PublishRefused`` (``ExchangeNotFound``),
  ``MessageTooLarge``, ``InvalidMessage``: ``dead``, reason in ``last_error``;
  the rows behind it (its ordering key's too) go on;
* the broker could not be reached (``PublishUnavailable``, or an outcome left
  unknown because the connection dropped or the message never got out):
  pending again as it was, no attempt counted, and the relay pauses with a
  backoff; an outage never dead-letters anything;
* any other failure the message met while the broker was reachable
  (``PublishGaveUp`` after nacks, a confirm that never came): one attempt
  counted, pending again after a backoff that doubles per attempt; ``dead``
  after ``max_attempts``. A row backing off still blocks the later rows of its
  ordering key, never another key's.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from prometheus_client import CollectorRegistry
from pydantic import Field
from pydantic_settings import SettingsConfigDict

from ..errors import (
    BrokerUnavailable,
    ClosedError,
    InvalidMessage,
    InvalidSettings,
    MessageTooLarge,
    PublishAborted,
    PublishError,
    PublishOutcomeUnknown,
    PublishRefused,
    PublishUnroutable,
    ReliableMQError,
)
from ..log import get_logger
from ..message import Message
from ..metrics import Metrics
from ..publisher import ReliablePublisher
from ..settings import ConnectionSettings, PublisherSettings, _Settings
from ._backend import Backend, Backlog, OutboxRow, RowOutcome, RowResult
from ._dsn import describe_database, dialect_of, error_text, sqlite_path
from ._schema import DEFAULT_TABLE, Dialect, check_table_name
from .errors import OutboxError, OutboxUnavailable

__all__ = ("OutboxRelay", "RelaySettings", "RelayStats")

_MAX_REASON = 500
_STOP_MEASURE_TIMEOUT = 2.0
"""Seconds ``close()`` waits for the backlog count it logs."""


class RelaySettings(_Settings):
    """How an [OutboxRelay][reliable_mq.outbox.OutboxRelay] claims, waits and cleans up."""

    model_config = SettingsConfigDict(env_prefix="RELIABLE_MQ_OUTBOX_")

    batch_size: int = Field(default=500, ge=1, le=10_000, description="rows claimed per batch")
    scan_limit: int | None = Field(
        default=None,
        ge=1,
        le=100_000,
        description="ordering keys (and unkeyed rows) looked at per claim; default 4 x batch_size",
    )
    lanes: int = Field(
        default=2,
        ge=1,
        le=16,
        description="PostgreSQL: batches in flight at once, each on its own connection, so one "
        "claims and commits while another waits for confirms (SQLite: always 1)",
    )
    listen: bool = Field(default=True, description="wake on LISTEN/NOTIFY (PostgreSQL)")
    poll_interval: float = Field(
        default=1.0, gt=0, le=3600, description="seconds between polls when idle"
    )
    publish_timeout: float = Field(
        default=30.0, gt=0, description="deadline of each row's publish, seconds"
    )
    max_attempts: int | None = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="failed dispatches of a row (nacked, or unconfirmed while the broker was "
        "reachable) before it goes dead; None retries forever. Broker outages never count",
    )
    retry_backoff_initial: float = Field(default=1.0, gt=0, le=3600)
    retry_backoff_max: float = Field(default=60.0, gt=0, le=86_400)
    keep_sent: float = Field(
        default=0.0, ge=0, description="seconds confirmed rows are kept as 'sent'; 0 deletes them"
    )
    keep_dead: float | None = Field(
        default=7 * 86_400.0, gt=0, description="seconds dead rows are kept; None keeps them"
    )
    cleanup_interval: float = Field(default=60.0, gt=0, description="seconds between cleanups")
    cleanup_batch: int = Field(default=1000, ge=1, le=100_000, description="rows per DELETE")
    stats_interval: float = Field(
        default=5.0, gt=0, description="seconds between backlog measurements (metrics)"
    )
    lease: float = Field(
        default=120.0, gt=0, description="SQLite: seconds a claimed row stays claimed"
    )
    transaction_timeout: float | None = Field(
        default=None,
        gt=0,
        description="PostgreSQL: idle_in_transaction_session_timeout of a batch; "
        "default publish_timeout + 30",
    )
    reconnect_delay_max: float = Field(default=10.0, gt=0, le=600)

    @property
    def effective_scan_limit(self) -> int:
        return self.scan_limit if self.scan_limit is not None else 4 * self.batch_size


class RelayStats(NamedTuple):
    """Counters of one relay since it started.

    ``deferred`` counts rows put back uncounted because the broker could not be
    reached; ``broker_outages`` the pauses that followed such batches
    (``outages`` counts database outages). ``pending`` and ``oldest_age`` are
    the backlog as last measured: every ``stats_interval`` while running, and
    once more by ``close()``.
    """

    batches: int
    dispatched: int
    dead: int
    retried: int
    outages: int
    pending: int
    oldest_age: float
    deferred: int = 0
    broker_outages: int = 0


Observer = Callable[[Sequence[OutboxRow]], None]
"""Called with the rows of each batch once their deletion is committed."""


class OutboxRelay:
    """Publishes committed outbox rows with confirms; run as many as you like.

    Use it as an async context manager and call [run][reliable_mq.outbox.OutboxRelay.run]
    (until [stop][reliable_mq.outbox.OutboxRelay.stop]), or call
    [run_once][reliable_mq.outbox.OutboxRelay.run_once] for one batch:

    ```python
    async with OutboxRelay("postgresql://app@db/shop", "amqp://guest:guest@mq/") as relay:
        await relay.run()
    ```

    Args:
        database: a PostgreSQL DSN (``postgresql://...`` or ``host=... dbname=...``),
            or an SQLite file (a path or ``sqlite:///path``).
        publisher: an AMQP URL or [ConnectionSettings][reliable_mq.ConnectionSettings]
            (the relay makes and owns its publisher), or a started
            [ReliablePublisher][reliable_mq.ReliablePublisher] you own.
        settings: batching, waiting and cleanup; default from ``RELIABLE_MQ_OUTBOX_*``.
        publisher_settings: for a publisher the relay makes.
        table: the outbox table.
        name: this relay's name in logs (and its SQLite lease owner).
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
        on_dispatched: called with each batch's confirmed rows after their commit.
        tracer_provider: an OpenTelemetry ``TracerProvider`` for the spans of a
            publisher the relay makes (a publisher you pass keeps its own);
            None: the global provider.

    Raises:
        InvalidSettings: ``tracer_provider`` given with a ``ReliablePublisher``.
    """

    def __init__(
        self,
        database: str | os.PathLike[str],
        publisher: ReliablePublisher | str | ConnectionSettings | None = None,
        *,
        settings: RelaySettings | None = None,
        publisher_settings: PublisherSettings | None = None,
        table: str = DEFAULT_TABLE,
        name: str | None = None,
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "reliable_mq",
        on_dispatched: Observer | None = None,
        tracer_provider: Any | None = None,
    ) -> None:
        self.settings = settings if settings is not None else RelaySettings()
        self.table = check_table_name(table)
        self.name = name or f"relay-{os.getpid()}-{secrets.token_hex(3)}"
        self.dialect = dialect_of(database)
        lanes = self.settings.lanes if self.dialect is Dialect.POSTGRES else 1
        self._lanes = [self._make_backend(database, lane) for lane in range(lanes)]
        self._backend = self._lanes[0]
        """Lane 0: also listens, measures the backlog and cleans up."""
        self._own_publisher = not isinstance(publisher, ReliablePublisher)
        if isinstance(publisher, ReliablePublisher):
            if tracer_provider is not None:
                raise InvalidSettings(
                    "OutboxRelay",
                    [("tracer_provider", "is for a publisher the relay makes: give it to yours")],
                )
            self._publisher = publisher
        else:
            connection = ConnectionSettings.of(publisher)
            self._publisher = ReliablePublisher(
                connection,
                settings=publisher_settings,
                registry=registry,
                metrics_prefix=metrics_prefix,
                tracer_provider=tracer_provider,
            )
        metrics = Metrics.on(registry, metrics_prefix)
        self._counts = metrics.for_outbox(self.table, owner=self)
        """What the relay counts, for ``stats()`` and Prometheus alike."""
        self._on_dispatched = on_dispatched
        self._log = get_logger(__name__).bind(
            relay=self.name, database=describe_database(database), table=self.table
        )
        self._stopping = asyncio.Event()
        self._started = False
        self._next_stats = 0.0
        self._next_cleanup = 0.0
        self._batches = self._outages = self._broker_outages = 0
        self._broker_down = 0
        """Consecutive batches that met an unreachable broker (0: the last one did not)."""

    def _make_backend(self, database: str | os.PathLike[str], lane: int) -> Backend:
        s = self.settings
        backoff = (s.retry_backoff_initial, s.retry_backoff_max)
        if self.dialect is Dialect.SQLITE:
            from ._sqlite import SQLiteBackend  # noqa: PLC0415 (no psycopg needed)

            return SQLiteBackend(
                sqlite_path(database),
                table=self.table,
                owner=self.name,
                scan_limit=s.effective_scan_limit,
                lease=s.lease,
                keep_sent=s.keep_sent,
                retry_backoff=backoff,
            )
        from ._postgres import PostgresBackend  # noqa: PLC0415 (needs the postgres extra)

        return PostgresBackend(
            os.fspath(database),
            table=self.table,
            scan_limit=s.effective_scan_limit,
            listen=s.listen and lane == 0,
            keep_sent=s.keep_sent,
            retry_backoff=backoff,
            transaction_timeout=s.transaction_timeout or s.publish_timeout + 30,
            application_name=f"reliable-mq-outbox-{self.name}{f'-{lane}' if lane else ''}"[:63],
        )

    # -- life cycle -------------------------------------------------------------------

    async def __aenter__(self) -> OutboxRelay:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def start(self) -> None:
        """Connect to the database and (for a publisher it owns) to the broker.

        Raises:
            OutboxError: the table does not exist.
            OutboxUnavailable: the database cannot be reached.
            BrokerUnavailable: no broker address accepted a connection.
        """
        if self._started:
            return
        self._started = True
        await self._backend.open()
        if self._own_publisher:
            try:
                await self._publisher.start()
            except BaseException:
                await self._backend.close()
                raise
        self._log.info("outbox_relay_started", listening=self._backend.listening)

    async def close(self) -> None:
        """Stop, release a batch in progress (its rows stay pending) and disconnect.

        The ``outbox_relay_stopped`` line reports the backlog measured at that
        moment (``pending`` and ``oldest_age`` are ``None`` if the database
        could not answer within 2 s), not the last periodic measurement.
        """
        self._stopping.set()
        measured = self._started and await self._measure_backlog(_STOP_MEASURE_TIMEOUT)
        for backend in self._lanes:
            await backend.close()
        if self._own_publisher:
            await self._publisher.close(timeout=5)
        if self._started:
            stats = self.stats()._asdict()
            if not measured:
                stats.update(pending=None, oldest_age=None)
            self._log.info("outbox_relay_stopped", **stats)

    async def _measure_backlog(self, timeout: float) -> bool:
        """Count the pending rows now (the stats and the gauges); False if the database failed."""
        try:
            async with asyncio.timeout(timeout):
                await self._backend.open()
                backlog = await self._backend.backlog()
        except (OutboxError, TimeoutError):  # unreachable, or no table (a failed start)
            return False
        self._set_backlog(backlog)
        return True

    def _set_backlog(self, backlog: Backlog) -> None:
        counts = self._counts
        counts.pending, counts.oldest_age = backlog.pending, backlog.oldest_age
        counts.flush()

    def stop(self) -> None:
        """Ask [run][reliable_mq.outbox.OutboxRelay.run] to return after the current batch."""
        self._stopping.set()

    @property
    def broker_unreachable(self) -> bool:
        """True if the last batch found the broker unreachable (its rows were put back)."""
        return self._broker_down > 0

    def stats(self) -> RelayStats:
        counts = self._counts
        failed = counts.failed
        return RelayStats(
            batches=self._batches,
            dispatched=counts.dispatched,
            dead=failed[RowOutcome.DEAD],
            retried=failed[RowOutcome.RETRY],
            outages=self._outages,
            pending=counts.pending,
            oldest_age=counts.oldest_age,
            deferred=failed[RowOutcome.DEFERRED],
            broker_outages=self._broker_outages,
        )

    # -- the loop -------------------------------------------------------------------------

    async def run(self) -> None:
        """Dispatch batches until [stop][reliable_mq.outbox.OutboxRelay.stop] is called.

        A database outage is logged and retried with backoff, forever: the
        relay never gives up on its rows. So is a broker outage: a batch that
        found the broker unreachable puts its rows back uncounted, and the
        relay pauses (doubling up to ``reconnect_delay_max``) before the next.
        After a batch that held rows the relay claims again at once (a key's
        next row may be claimable now); it waits for a notification or
        ``poll_interval`` only when a claim finds nothing. On PostgreSQL,
        ``settings.lanes`` such loops run at once, each with its own
        connection and batch; they share the publisher, and a key's rows still
        go out one at a time, as between relays.

        Raises:
            OutboxError: the table does not exist (at start or later).
        """
        await self.start()
        lanes = [
            asyncio.ensure_future(self._lane(backend, housekeeping=backend is self._backend))
            for backend in self._lanes
        ]
        try:
            done, _ = await asyncio.wait(lanes, return_when=asyncio.FIRST_EXCEPTION)
        finally:
            for lane in lanes:
                lane.cancel()
            await asyncio.gather(*lanes, return_exceptions=True)
        for lane in done:
            error = None if lane.cancelled() else lane.exception()
            if error is not None:
                raise error

    async def _lane(self, backend: Backend, *, housekeeping: bool) -> None:
        """One loop of ``run()``: claim, publish, finish, on ``backend``'s connection."""
        failures = 0
        while not self._stopping.is_set():
            try:
                if housekeeping:
                    await self._housekeeping()
                handled = await self._batch(backend)
                failures = 0
            except OutboxUnavailable as exc:
                failures += 1
                await self._outage(backend, exc, failures)
                continue
            if self._broker_down:
                await self._broker_pause()
            elif not handled:
                await self._idle()

    async def run_once(self) -> int:
        """Claim, publish and finish one batch; return how many rows it held.

        Raises:
            OutboxUnavailable: the database failed; the batch's rows stay pending.
        """
        return await self._batch(self._backend)

    async def _batch(self, backend: Backend) -> int:
        await backend.open()  # after an outage; nothing to do when connected
        self._backend.forget_notifications()  # lane 0 listens for every lane
        started = time.monotonic()
        rows = await backend.claim(self.settings.batch_size)
        if not rows:
            return 0
        try:
            results = await self._publish_rows(rows)
            await backend.finish(results)
        except BaseException:
            await backend.abandon()
            raise
        self._count(results, time.monotonic() - started)
        return len(rows)

    async def cleanup(self) -> int:
        """Delete old ``sent`` and ``dead`` rows now, in batches; return how many."""
        s = self.settings
        deleted = await self._backend.cleanup(
            keep_sent=s.keep_sent, keep_dead=s.keep_dead, batch=s.cleanup_batch
        )
        if deleted:
            self._log.info("outbox_cleanup", deleted=deleted)
        return deleted

    async def _idle(self) -> None:
        stop = asyncio.ensure_future(self._stopping.wait())
        work = asyncio.ensure_future(self._backend.wait_for_work(self.settings.poll_interval))
        try:
            await asyncio.wait((stop, work), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stop, work):
                task.cancel()
            await asyncio.gather(stop, work, return_exceptions=True)

    async def _outage(self, backend: Backend, exc: OutboxUnavailable, failures: int) -> None:
        self._outages += 1
        delay = self._outage_delay(failures)
        self._log.warning(
            "outbox_database_unavailable", error=error_text(exc), retry_in=round(delay, 2)
        )
        await backend.reset()
        await self._sleep(delay)

    async def _broker_pause(self) -> None:
        self._broker_outages += 1
        delay = self._outage_delay(self._broker_down)
        self._log.warning("outbox_broker_unavailable", retry_in=round(delay, 2))
        await self._sleep(delay)

    def _outage_delay(self, failures: int) -> float:
        return float(min(0.1 * 2 ** min(failures, 10), self.settings.reconnect_delay_max))

    async def _sleep(self, seconds: float) -> None:
        """Sleep, returning early if the relay is asked to stop."""
        try:
            async with asyncio.timeout(seconds):
                await self._stopping.wait()
        except TimeoutError:
            pass

    async def _housekeeping(self) -> None:
        await self._backend.open()
        now = time.monotonic()
        if now >= self._next_stats:
            self._next_stats = now + self.settings.stats_interval
            self._set_backlog(await self._backend.backlog())
        if now >= self._next_cleanup:
            self._next_cleanup = now + self.settings.cleanup_interval
            await self.cleanup()

    # -- publishing -----------------------------------------------------------------------

    async def _publish_rows(self, rows: list[OutboxRow]) -> list[RowResult]:
        """Publish a batch and wait for every outcome: the one place that talks to the publisher.

        One ``publish_many()``: the rows stream through the confirm window and a
        batch costs about one confirm round trip; each failure comes back with
        its row's index.
        """
        messages = [
            Message(
                row.body,
                routing_key=row.routing_key,
                exchange=row.exchange,
                message_id=row.message_id,
                headers=_headers(row.properties),
                content_type=_text_or_none(row.properties.get("content_type")),
                content_encoding=_text_or_none(row.properties.get("content_encoding")),
                correlation_id=_text_or_none(row.properties.get("correlation_id")),
                message_type=_text_or_none(row.properties.get("message_type")),
                user_id=_text_or_none(row.properties.get("user_id")),
            )
            for row in rows
        ]
        publisher = self._publisher
        connections = publisher.connections
        connected = publisher.connected
        result = await publisher.publish_many(
            messages, timeout=self.settings.publish_timeout, raise_on_error=False
        )
        failed = {failure.index: failure.error for failure in result.failures}
        # The broker stayed reachable all along: same connection, open at both ends.
        reachable = connected and publisher.connected and publisher.connections == connections
        return [
            self._failed(row, failed[index], reachable=reachable)
            if index in failed
            else RowResult(row, RowOutcome.CONFIRMED)
            for index, row in enumerate(rows)
        ]

    def _failed(self, row: OutboxRow, exc: ReliableMQError, *, reachable: bool) -> RowResult:
        reason = _printable(f"{type(exc).__name__}: {error_text(exc)}")[:_MAX_REASON]
        if isinstance(exc, (PublishUnroutable, PublishRefused, MessageTooLarge, InvalidMessage)):
            return self._dead_letter(row, reason)
        if _broker_unreachable(exc, reachable=reachable):
            self._log.info("outbox_row_deferred", row_id=row.id, reason=reason)
            return RowResult(row, RowOutcome.DEFERRED, reason)
        if not isinstance(exc, PublishError):  # pragma: no cover - a new error type
            self._log.error("outbox_row_unexpected_error", row_id=row.id, reason=reason)
        attempts = row.attempts + 1
        limit = self.settings.max_attempts
        if limit is not None and attempts >= limit:
            return self._dead_letter(row, f"gave up after {attempts} attempts; last: {reason}")
        self._log.info("outbox_row_retry", row_id=row.id, attempts=attempts, reason=reason)
        return RowResult(row, RowOutcome.RETRY, reason)

    def _dead_letter(self, row: OutboxRow, reason: str) -> RowResult:
        reason = reason[:_MAX_REASON]
        self._log.warning(
            "outbox_row_dead",
            row_id=row.id,
            message_id=_printable(row.message_id),
            routing_key=_printable(row.routing_key),
            attempts=row.attempts + 1,
            reason=reason,
        )
        return RowResult(row, RowOutcome.DEAD, reason)

    def _count(self, results: list[RowResult], seconds: float) -> None:
        confirmed = [r.row for r in results if r.outcome is RowOutcome.CONFIRMED]
        dead = sum(1 for r in results if r.outcome is RowOutcome.DEAD)
        deferred = sum(1 for r in results if r.outcome is RowOutcome.DEFERRED)
        retried = len(results) - len(confirmed) - dead - deferred
        self._batches += 1
        self._broker_down = self._broker_down + 1 if deferred else 0
        counts = self._counts
        counts.dispatched += len(confirmed)
        failed = counts.failed
        failed[RowOutcome.DEAD] += dead
        failed[RowOutcome.RETRY] += retried
        failed[RowOutcome.DEFERRED] += deferred
        counts.batch_latency.observe(seconds)
        counts.flush()
        self._log.debug(
            "outbox_batch",
            rows=len(results),
            confirmed=len(confirmed),
            dead=dead,
            retried=retried,
            deferred=deferred,
        )
        if self._on_dispatched is not None and confirmed:
            self._on_dispatched(confirmed)


def _broker_unreachable(exc: ReliableMQError, *, reachable: bool) -> bool:
    """True if ``exc`` says the broker could not be reached, not that the message failed.

    ``PublishUnavailable`` (no connection for ``unavailable_timeout``) and a
    closing publisher are never the message's doing. An unknown outcome
    (a deadline passed) is the message's only if it was sent at least once
    and the connection stayed up throughout the batch: a message that never
    got out, or one caught by a dropped connection, met an outage.
    """
    if isinstance(exc, (BrokerUnavailable, ClosedError, PublishAborted)):
        return True
    if isinstance(exc, PublishOutcomeUnknown):
        return not reachable or exc.attempts == 0
    return False


def _headers(properties: dict[str, Any]) -> dict[str, Any] | None:
    headers = properties.get("headers")
    return headers if isinstance(headers, dict) and headers else None


def _text_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _printable(text: str) -> str:
    """Control characters escaped (message ids and broker texts end up in logs)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
