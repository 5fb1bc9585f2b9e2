"""One AMQP connection kept alive: reconnect with backoff, fail over between brokers.

We do not use aio-pika's ``RobustConnection``: it restores channels behind our
back, and its pending confirms can hang across a reconnect (aio-pika #636,
#689). Here a loss is an event with a generation number that the publisher and
consumer react to explicitly (republish, drop stale delivery tags).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import logging
import random
from collections.abc import Callable, Iterator

from ._amqp import AMQP_ERRORS, Channel, FaultKind, Got, Link, classify, open_link
from .errors import BrokerUnavailable, ClosedError
from .log import get_logger
from .metrics import Metrics
from .settings import BrokerAddress, ConnectionSettings, redact_credentials

__all__ = (
    "AMQP_ERRORS",
    "Channel",
    "ConnectionState",
    "ConnectionSupervisor",
    "FaultKind",
    "Got",
    "Link",
    "classify",
)
"""The supervisor, and the part of the AMQP seam (`reliable_mq._amqp`) that tools
built on it (the CLI, the Spark driver's checks) use: links, plain channels, the
error map."""


_CLOSE_ERRORS: tuple[type[BaseException], ...] = (*AMQP_ERRORS, RuntimeError)
"""Closing a connection that already broke can raise anything of these; none matters."""

_SHORT_LIFE = 2.0
"""Seconds: a connection lost sooner than this "died young" and delays the next reconnect."""


_OUR_CONNECT = contextvars.ContextVar("reliable_mq_connect_attempt", default=False)
_TRANSPORT_ERROR = "error when creating transport: %r"


class _OwnConnectErrors(logging.Filter):
    """Drops aiormq's ``error when creating transport`` record for a connect attempt of ours.

    aiormq logs that at ERROR and raises the same error; we raise or log it
    ourselves, so its line would be a stray duplicate (on stderr, through
    logging's last-resort handler, in an application without logging set up).
    The context variable limits the filter to our own attempts: other aiormq
    connections in the process keep their records.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        return not (_OUR_CONNECT.get() and record.msg == _TRANSPORT_ERROR)


_OWN_CONNECT_ERRORS = _OwnConnectErrors()


@contextlib.contextmanager
def _own_connect_errors() -> Iterator[None]:
    logging.getLogger("aiormq.connection").addFilter(_OWN_CONNECT_ERRORS)  # once: a no-op after
    token = _OUR_CONNECT.set(True)
    try:
        yield
    finally:
        _OUR_CONNECT.reset(token)


class ConnectionState(enum.StrEnum):
    """Where a `ConnectionSupervisor` is in its life."""

    IDLE = "idle"
    """Not started."""
    CONNECTING = "connecting"
    """Connecting or reconnecting; work waits."""
    CONNECTED = "connected"
    """A connection is open."""
    CLOSED = "closed"
    """Closed by the owner; takes no more work."""


class ConnectionSupervisor:
    """Keeps one connection open and tells listeners when it is (re)established.

    Args:
        settings: where and how to connect.
        role: a short word ("publisher", "consumer") added to the connection name.
        metrics: collectors for recoveries and the up/down gauge.
        decode_frames: decode the connection's frames with reliable_mq's decoder
            (a consumer's, a tool's: deliveries pamqp cannot decode are then
            dead-lettered instead of closing the connection).
    """

    def __init__(
        self,
        settings: ConnectionSettings,
        *,
        role: str,
        metrics: Metrics,
        decode_frames: bool = False,
    ) -> None:
        self._settings = settings
        self._decode_frames = decode_frames
        self._name = f"{settings.connection_name}.{role}"
        self._metrics = metrics.for_connection(self._name, owner=self)
        self._log = get_logger(__name__).bind(connection=self._name)
        self._state = ConnectionState.IDLE
        self._connection: Link | None = None
        self._connected = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._address_index = 0
        self.generation = 0
        """Increments with every new connection; lets listeners tell old from new."""
        self.connected_at = 0.0
        """Loop time when the current connection opened."""
        self._short_lives = 0
        self.on_stopped: Callable[[str], None] | None = None
        """Called once if supervision ends while the supervisor is not closed (its
        task was cancelled from outside, as the event loop's shutdown does, or
        failed): no reconnect will come, and `wait_connected` raises from then on."""
        self._stopped: str | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def connection(self) -> Link | None:
        """The open connection, or None while (re)connecting."""
        return self._connection if self._state is ConnectionState.CONNECTED else None

    @property
    def user(self) -> str | None:
        """The user the broker address in use logs in as (the URL's, else aiormq's
        ``guest``); None when the broker names it (``auth=external``: a TLS certificate)."""
        url = self._current_address().url
        if url.query.get("auth", "plain").upper() == "EXTERNAL":
            return None
        return url.user or "guest"

    async def start(self) -> None:
        """Connect for the first time; try every address once before giving up.

        Raises:
            BrokerUnavailable: no address accepted a connection.
        """
        if self._state is not ConnectionState.IDLE:
            return
        self._state = ConnectionState.CONNECTING
        errors: list[str] = []
        for _ in self._settings.addresses:
            try:
                connection = await self._connect_once()
            except AMQP_ERRORS as exc:
                fault = classify(exc)
                if fault is not None and fault.kind is FaultKind.AUTH_REFUSED:
                    self._state = ConnectionState.CLOSED
                    raise BrokerUnavailable(
                        f"{self._current_address().redacted}: authentication refused "
                        f"({fault.reply_text})"
                    ) from None
                if fault is not None and fault.kind is FaultKind.VHOST_REFUSED:
                    self._state = ConnectionState.CLOSED  # vhosts are cluster-wide
                    raise BrokerUnavailable(self._vhost_refused()) from None
                errors.append(f"{self._current_address().redacted}: {_describe(exc)}")
                self._advance_address()
                continue
            self._set_connected(connection)
            self._task = asyncio.get_running_loop().create_task(
                self._supervise(), name=f"reliable_mq:{self._name}"
            )
            self._task.add_done_callback(self._supervision_ended)
            return
        self._state = ConnectionState.CLOSED
        raise BrokerUnavailable("no broker accepted a connection: " + "; ".join(errors))

    async def wait_connected(self) -> Link:
        """Wait for an open connection (callers bound this with their own deadline).

        Raises:
            ClosedError: the supervisor was closed.
        """
        while True:
            if self._state is ConnectionState.CLOSED:
                raise ClosedError(f"connection {self._name} is closed")
            if self._stopped is not None:
                raise ClosedError(f"connection {self._name} is no longer kept: {self._stopped}")
            connection = self.connection
            if connection is not None and not connection.is_closed:
                return connection
            self._connected.clear()
            await self._connected.wait()

    async def close(self, timeout: float = 5.0) -> None:
        """Close the connection and stop reconnecting (waiting ``timeout`` s at most)."""
        if self._state is ConnectionState.CLOSED:
            return
        self._state = ConnectionState.CLOSED
        self._connected.set()  # wake waiters so they see CLOSED
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        connection, self._connection = self._connection, None
        if connection is not None:
            try:
                async with asyncio.timeout(timeout):
                    await connection.close()
            except _CLOSE_ERRORS:
                self._log.debug("connection_close_error")
        self._metrics.set_up(False)
        self._log.debug("connection_closed")

    def _supervision_ended(self, task: asyncio.Task[None]) -> None:
        if self._state is ConnectionState.CLOSED:
            return  # close() stopped it
        if task.cancelled():
            why = "its supervision task was cancelled"
        else:
            exc = task.exception()
            why = f"its supervision task failed: {_describe(exc)}" if exc else "supervision ended"
        self._stopped = why
        self._connected.set()  # wake waiters: they raise ClosedError now
        if self.on_stopped is not None:
            self.on_stopped(why)

    def _closed(self) -> bool:
        """Re-read the state (it changes while we await)."""
        return self._state is ConnectionState.CLOSED

    @property
    def address(self) -> BrokerAddress:
        """The broker address in use (or tried next, while reconnecting)."""
        return self._current_address()

    def _current_address(self) -> BrokerAddress:
        addresses = self._settings.addresses
        return addresses[self._address_index % len(addresses)]

    def _vhost_refused(self) -> str:
        address = self._current_address()
        return (
            f"{address.redacted}: vhost {address.vhost!r} not found, or access to it refused "
            "(the broker closed the connection when it was opened: the vhost does not exist, "
            "this user has no permission on it, or its connection limit is reached)"
        )

    def _advance_address(self) -> None:
        self._address_index = (self._address_index + 1) % len(self._settings.addresses)

    async def _connect_once(self) -> Link:
        settings = self._settings
        url = self._current_address().url
        ssl_context = None
        if url.scheme == "amqps":
            ssl_context = settings.tls.ssl_context() if settings.tls else None
        with _own_connect_errors():
            return await open_link(
                url,
                name=self._name,
                heartbeat=settings.heartbeat,
                ssl_context=ssl_context,
                timeout=settings.connect_timeout,
                fast_path=settings.fast_path,
                decode_frames=self._decode_frames,
            )

    def _set_connected(self, connection: Link) -> None:
        self._connection = connection
        self.generation += 1
        self.connected_at = asyncio.get_running_loop().time()
        self._state = ConnectionState.CONNECTED
        self._metrics.set_up(True)
        self._connected.set()
        self._log.debug(
            "connection_open", broker=self._current_address().redacted, generation=self.generation
        )

    async def _supervise(self) -> None:
        """Wait for the connection to drop, then reconnect until closed."""
        while self._state is not ConnectionState.CLOSED:
            connection = self._connection
            assert connection is not None
            end = await connection.wait_closed()
            reason = end.reason
            broker_closed = end.fault is not None and end.fault.broker_initiated
            if self._closed():
                return
            self._connection = None
            self._state = ConnectionState.CONNECTING
            self._connected.clear()
            self._metrics.set_up(False)
            lived = asyncio.get_running_loop().time() - self.connected_at
            young = broker_closed and lived < _SHORT_LIFE
            self._short_lives = self._short_lives + 1 if young else 0
            self._log.warning(
                "connection_lost", broker=self._current_address().redacted, reason=reason
            )
            await self._reconnect()

    def first_reconnect_delay(self) -> float:
        """0, unless the broker itself closed one connection after another young.

        A broker that keeps closing new connections (a refused frame, a forced
        close, an alarm) must not be answered with a reconnect storm; a network
        cut is not the broker's doing and is answered at once.
        """
        if not self._short_lives:
            return 0.0
        settings = self._settings
        delay = settings.reconnect_initial_delay * 2 ** (self._short_lives - 1)
        return float(min(delay, settings.reconnect_max_delay))

    async def _reconnect(self) -> None:
        delay = self._settings.reconnect_initial_delay
        attempt = 0
        pause = self.first_reconnect_delay()
        if pause:
            await asyncio.sleep(pause * random.uniform(0.8, 1.2))
        while self._state is not ConnectionState.CLOSED:
            attempt += 1
            try:
                connection = await self._connect_once()
            except AMQP_ERRORS as exc:
                fault = classify(exc)
                vhost_refused = fault is not None and fault.kind is FaultKind.VHOST_REFUSED
                self._log.info(
                    "reconnect_failed",
                    broker=self._current_address().redacted,
                    attempt=attempt,
                    error=self._vhost_refused() if vhost_refused else _describe(exc),
                )
                self._advance_address()
                await asyncio.sleep(delay * random.uniform(0.8, 1.2))
                delay = min(delay * 2, self._settings.reconnect_max_delay)
                continue
            if self._closed():
                await connection.close()
                return
            self._metrics.recovered()
            self._set_connected(connection)
            self._log.info(
                "connection_recovered", broker=self._current_address().redacted, attempt=attempt
            )
            return


def _describe(exc: BaseException) -> str:
    """A one-line, password-free description of a connection error."""
    text = redact_credentials(str(exc) or type(exc).__name__)
    return f"{type(exc).__name__}: {text}"[:300]
