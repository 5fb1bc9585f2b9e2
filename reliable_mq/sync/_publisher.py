"""BlockingPublisher: the reliable publisher for threads, over the async one.

One daemon thread per process runs an event loop that owns a
[ReliablePublisher][reliable_mq.ReliablePublisher]; every call is a
message handed to that loop. There is no second implementation: confirms,
republishing, deadlines and errors are the async publisher's.

Hand-over costs little per message: callers append to a deque, and the loop
is woken once per batch of appends (not per message) to start them all.
Each caller is woken once, when its confirm arrives.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import math
import os
import secrets
import threading
from collections import deque
from collections.abc import AsyncIterable, Iterable, Mapping
from functools import partial
from typing import Any, TypeAlias, TypeVar

from prometheus_client import CollectorRegistry
from pydantic import SecretStr
from typing_extensions import Unpack

from .._wire import check_timeout
from ..errors import (
    BrokerUnavailable,
    ClosedError,
    InvalidMessage,
    InvalidSettings,
    PublishAborted,
    PublishTimeout,
    WouldDeadlock,
)
from ..log import get_logger
from ..message import Message, MessageOptions
from ..outcomes import BatchResult, PublisherStats, PublishResult
from ..publisher import PublisherState, ReliablePublisher
from ..settings import ConnectionSettings, PublisherSettings
from . import _process
from ._feed import ChunkFeed
from ._loop import LoopThread

__all__ = ("BlockingPublisher",)

_T = TypeVar("_T")

_Submission: TypeAlias = tuple[
    "concurrent.futures.Future[PublishResult]",
    Any,  # body
    str,  # routing key
    str,  # exchange
    "float | None",  # timeout
    MessageOptions,
    contextvars.Context,
]

_RESULT_GRACE = 30.0
"""Seconds past a message's own deadline before the caller stops waiting for
the loop thread to report (a safety net: the async publisher enforces deadlines)."""


class _Runtime:
    """The loop thread and the async publisher it owns, for one process."""

    __slots__ = ("dead", "publisher", "queue", "scheduled", "slots", "thread")

    def __init__(self, thread: LoopThread, publisher: ReliablePublisher, max_pending: int) -> None:
        self.thread = thread
        self.publisher = publisher
        self.slots = threading.BoundedSemaphore(max_pending)
        self.queue: deque[_Submission] = deque()
        self.scheduled = False
        self.dead = False

    def push(self, item: _Submission) -> None:
        """Any thread: queue a message and wake the loop if no drain is pending."""
        self.queue.append(item)
        if self.dead:
            self.sweep()
        elif not self.scheduled:
            # A drain clears `scheduled` before it empties the queue, so an item
            # appended before we read True here is still taken by that drain.
            self.scheduled = True
            try:
                self.thread.loop.call_soon_threadsafe(self.drain)
            except RuntimeError:  # the loop is closed
                self.dead = True
                self.sweep()

    def drain(self) -> None:
        """Loop thread: start every queued message."""
        self.scheduled = False
        queue = self.queue
        publish = self.publisher.publish
        create_task = self.thread.loop.create_task
        settle = self.settle
        while queue:
            future, body, routing_key, exchange, timeout, options, context = queue.popleft()
            if not future.set_running_or_notify_cancel():
                self.slots.release()  # cancelled by the caller before we took it
                continue
            coro = publish(
                body, routing_key=routing_key, exchange=exchange, timeout=timeout, **options
            )
            task = create_task(coro, context=context)
            task.add_done_callback(partial(settle, future, options.get("message_id") or ""))

    def settle(
        self,
        future: concurrent.futures.Future[PublishResult],
        message_id: str,
        task: asyncio.Task[PublishResult],
    ) -> None:
        """Loop thread: pass a finished publish to its caller's future."""
        self.slots.release()
        if task.cancelled():
            future.set_exception(
                PublishAborted(
                    "publisher stopped before a confirm; the broker may still have it",
                    message_id=message_id,
                    attempts=0,
                )
            )
            return
        error = task.exception()
        if error is None:
            future.set_result(task.result())
        else:
            future.set_exception(error)

    def sweep(self) -> None:
        """Fail messages queued after the loop stopped (they were never sent)."""
        while True:
            try:
                future, *_ = self.queue.popleft()
            except IndexError:
                return
            self.slots.release()
            if future.set_running_or_notify_cancel():
                future.set_exception(ClosedError("publisher is closed"))


class BlockingPublisher:
    """Publishes with confirms from plain threads: Flask, Django, scripts, Celery tasks.

    Thread-safe: any number of threads may share one. The first call (or
    ``start()``) connects; ``publish()`` blocks until the broker confirms and
    raises the same errors as
    [ReliablePublisher.publish][reliable_mq.ReliablePublisher.publish]::

        with BlockingPublisher("amqp://guest:guest@127.0.0.1/") as publisher:
            result = publisher.publish({"order": 1}, routing_key="orders")

    After ``os.fork()`` (a pre-forking server such as gunicorn ``--preload``)
    the child opens its own loop thread and connection on first use, named
    ``<connection_name>.fork<pid>``; it never touches the parent's. At
    interpreter exit, an unclosed publisher is closed: messages still
    unconfirmed get ``exit_timeout`` seconds.

    Args:
        connection: an AMQP URL (several, comma separated, fail over), or
            [ConnectionSettings][reliable_mq.ConnectionSettings]; default:
            from ``RELIABLE_MQ_*`` variables.
        settings: window, deadlines and retry policy; default: from
            ``RELIABLE_MQ_PUBLISHER_*`` variables.
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
        max_pending: messages accepted and not yet final, at most; ``submit()``
            blocks beyond that (default: twice ``settings.max_in_flight``).
        exit_timeout: seconds an unclosed publisher waits for confirms at exit.

    Raises:
        InvalidSettings: a setting or argument is invalid.
    """

    def __init__(
        self,
        connection: str | ConnectionSettings | None = None,
        *,
        settings: PublisherSettings | None = None,
        registry: CollectorRegistry | None = None,
        metrics_prefix: str = "reliable_mq",
        max_pending: int | None = None,
        exit_timeout: float = 10.0,
    ) -> None:
        if connection is None:
            connection = ConnectionSettings()
        elif isinstance(connection, str):
            connection = ConnectionSettings(url=SecretStr(connection))
        elif not isinstance(connection, ConnectionSettings):
            raise InvalidSettings(
                "BlockingPublisher", [("connection", "must be a URL or ConnectionSettings")]
            )
        self.settings = settings if settings is not None else PublisherSettings()
        if max_pending is None:
            max_pending = 2 * self.settings.max_in_flight
        if type(max_pending) is not int or max_pending < 1:
            raise InvalidSettings("BlockingPublisher", [("max_pending", "must be an int >= 1")])
        if not _is_number(exit_timeout) or not 0 <= exit_timeout < math.inf:
            raise InvalidSettings(
                "BlockingPublisher", [("exit_timeout", "must be a finite number >= 0")]
            )
        self._connection = connection
        self._registry = registry
        self._metrics_prefix = metrics_prefix
        self._max_pending = max_pending
        self._exit_timeout = float(exit_timeout)
        self._log = get_logger(__name__)
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._state = PublisherState.IDLE
        self._runtime: _Runtime | None = None
        self._closed = threading.Event()
        self._closing = False
        self._pid = os.getpid()
        _process.track(self)

    # -- life cycle -------------------------------------------------------------

    def __enter__(self) -> BlockingPublisher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def state(self) -> PublisherState:
        return self._state

    @property
    def connection_name(self) -> str:
        """The AMQP connection name (as the broker shows it)."""
        return f"{self._connection.connection_name}.publisher"

    def start(self) -> None:
        """Connect now rather than on the first call (a no-op when running).

        Raises:
            BrokerUnavailable: no broker address accepted a connection.
            ClosedError: the publisher is closed.
            WouldDeadlock: called from the publisher's own loop thread.
        """
        self._runtime_for_call()

    def close(self, timeout: float | None = None) -> None:
        """Stop taking messages, wait for outstanding confirms, close the connection.

        Messages still unconfirmed after ``timeout`` seconds (default
        ``settings.close_timeout``; 0: do not wait) fail with
        ``PublishAborted``. Safe to call more than once and from several
        threads: every caller returns once the publisher is closed.

        Raises:
            WouldDeadlock: called from the publisher's own loop thread.
        """
        if timeout is None:
            wait = self.settings.close_timeout
        elif type(timeout) in (int, float) and timeout == 0:
            wait = 0.0
        else:
            wait = check_timeout(timeout)
        runtime = self._runtime
        if runtime is not None and runtime.thread.in_loop_thread():
            raise WouldDeadlock("close() was called from the publisher's own loop thread")
        with self._lock:
            self._forget_parent_if_forked()
            runtime, self._runtime = self._runtime, None
            if self._state is not PublisherState.CLOSED:
                self._state = PublisherState.CLOSING
            closed = self._closed
            if runtime is None and not self._closing:
                self._state = PublisherState.CLOSED
                closed.set()  # never started (or start failed): nothing to close
            self._closing = True
        if runtime is None:  # closed already, or another caller is closing it
            closed.wait(wait + _RESULT_GRACE)
            return
        try:
            self._close_runtime(runtime, wait)
        finally:
            self._state = PublisherState.CLOSED
            closed.set()

    def _close_runtime(self, runtime: _Runtime, wait: float) -> None:
        done = runtime.thread.submit(_close_runtime(runtime, wait))
        try:
            done.result(timeout=wait + _RESULT_GRACE)
        except Exception as exc:  # past this point, closing is best effort
            self._log.warning("close_incomplete", error=repr(exc))
        runtime.dead = True
        if not runtime.thread.stop(timeout=5.0):
            self._log.warning("loop_thread_stuck", thread=runtime.thread.name)
        runtime.sweep()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message accepted by ``publish()``/``submit()`` is final.

        Raises:
            PublishTimeout: ``timeout`` seconds passed first (the messages stay in flight).
        """
        limit = None if timeout is None else check_timeout(timeout)
        runtime = self._runtime
        if runtime is not None and runtime.thread.in_loop_thread():
            raise WouldDeadlock("flush() was called from the publisher's own loop thread")
        with self._idle:
            if not self._idle.wait_for(lambda: self._outstanding == 0, limit):
                raise PublishTimeout(
                    f"{self._outstanding} messages still unconfirmed after {limit}s",
                    message_id="",
                    attempts=0,
                )

    # -- publishing ---------------------------------------------------------------

    def publish(
        self,
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> PublishResult:
        """Publish one message and return once the broker has confirmed it.

        Arguments and errors are those of
        [ReliablePublisher.publish][reliable_mq.ReliablePublisher.publish]; in
        addition:

        Raises:
            InvalidMessage: ``routing_key``/``exchange`` is not a str, or
                ``timeout`` is not a finite number above 0.
            WouldDeadlock: called from the publisher's own loop thread.
            ClosedError: the publisher is closed.
        """
        future = self.submit(
            body, routing_key=routing_key, exchange=exchange, timeout=timeout, **options
        )
        deadline = self.settings.publish_timeout if timeout is None else timeout
        return _wait(future, deadline + _RESULT_GRACE, options.get("message_id") or "")

    def submit(
        self,
        body: Any,
        *,
        routing_key: str,
        exchange: str = "",
        timeout: float | None = None,
        **options: Unpack[MessageOptions],
    ) -> concurrent.futures.Future[PublishResult]:
        """Like ``publish()``, but return a future at once instead of waiting.

        The future ends with the ``PublishResult`` or the publish error. Its
        callbacks run on the publisher's loop thread: keep them short, and do
        not call the publisher's blocking methods there (``WouldDeadlock``).
        ``future.cancel()`` succeeds only until the loop has taken the message.

        Blocks only while ``max_pending`` messages are already outstanding
        (backpressure); past the message's deadline it raises ``PublishTimeout``.
        """
        runtime = self._runtime_for_call()
        deadline = self._check(routing_key, exchange, timeout)
        if options.get("message_id") is None:
            options["message_id"] = secrets.token_hex(16)
        if not runtime.slots.acquire(timeout=deadline):
            raise PublishTimeout(
                f"max_pending={self._max_pending} messages outstanding for {deadline}s; never sent",
                message_id=options["message_id"] or "",
                attempts=0,
            )
        future: concurrent.futures.Future[PublishResult] = concurrent.futures.Future()
        with self._idle:
            self._outstanding += 1
        future.add_done_callback(self._one_done)
        context = contextvars.copy_context()
        runtime.push((future, body, routing_key, exchange, timeout, options, context))
        return future

    def publish_many(
        self,
        messages: Iterable[Message],
        *,
        timeout: float | None = None,
        max_failures: int | None = None,
        raise_on_error: bool = True,
    ) -> BatchResult:
        """Publish a stream of messages and return once each has a final outcome.

        ``messages`` is iterated in the calling thread and handed to the loop
        in chunks, so memory stays flat for any length and a generator may do
        I/O. Per message it behaves as the async ``publish_many()``: a
        message that cannot be encoded, or ends in a publish error, is recorded
        as a failure and the others go on.

        Args:
            messages: an iterable of ``Message``.
            timeout: the deadline of each message, as in ``publish()``.
            max_failures: stop taking messages after this many failures.
            raise_on_error: raise ``PublishBatchError`` if any message failed.

        If iterating ``messages`` raises, the messages taken before are still
        published and confirmed, then that exception is raised.

        Raises:
            PublishBatchError: some messages failed (``.result`` has them all;
                an item that is not a ``Message`` is one of them).
            InvalidMessage: ``messages`` is not an iterable, or a bad ``timeout``.
            InvalidSettings: ``max_failures`` is not an int >= 1.
            WouldDeadlock: called from the publisher's own loop thread.
        """
        runtime = self._runtime_for_call()
        self._check("", "", timeout)
        if max_failures is not None and (type(max_failures) is not int or max_failures < 1):
            raise InvalidSettings("publish_many", [("max_failures", "must be an int >= 1")])
        if isinstance(messages, (str, bytes, bytearray, Mapping, AsyncIterable)) or not isinstance(
            messages, Iterable
        ):
            raise InvalidMessage(
                f"messages must be an iterable of Message, not {type(messages).__name__}"
            )
        feed: ChunkFeed[Message] = ChunkFeed(runtime.thread.loop)
        outcome = runtime.thread.submit(
            runtime.publisher.publish_many(
                feed.items(),
                timeout=timeout,
                max_failures=max_failures,
                raise_on_error=raise_on_error,
            )
        )
        try:
            feed.produce(messages, alive=lambda: not outcome.done() and runtime.thread.alive)
        except BaseException:
            feed.finish()  # what was handed over is still published and confirmed
            with contextlib.suppress(BaseException):
                _wait(outcome, None, "", runtime=runtime)
            raise
        feed.finish()
        return _wait(outcome, None, "", runtime=runtime)

    def stats(self) -> PublisherStats:
        """The async publisher's counters (zeros before the first connection)."""
        runtime = self._runtime
        if runtime is None:
            return PublisherStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        return runtime.publisher.stats()

    def __repr__(self) -> str:
        return f"<BlockingPublisher {self.connection_name} {self._state.value}>"

    # -- internals ----------------------------------------------------------------

    def _one_done(self, _future: object) -> None:
        with self._idle:
            self._outstanding -= 1
            if self._outstanding == 0:
                self._idle.notify_all()

    def _check(self, routing_key: Any, exchange: Any, timeout: Any) -> float:
        """Validate what the facade passes on; return the deadline in seconds."""
        if not isinstance(routing_key, str):
            raise InvalidMessage(f"routing_key must be a str, not {type(routing_key).__name__}")
        if not isinstance(exchange, str):
            raise InvalidMessage(f"exchange must be a str, not {type(exchange).__name__}")
        if timeout is None:
            return self.settings.publish_timeout
        return check_timeout(timeout)

    def _runtime_for_call(self) -> _Runtime:
        """The running runtime of this process; start it on first use."""
        runtime = self._runtime
        if runtime is not None and self._pid == os.getpid():
            if runtime.thread.in_loop_thread():
                raise WouldDeadlock(
                    "a blocking publisher call was made from its own loop thread "
                    "(a future callback?); call it from another thread"
                )
            if self._state is PublisherState.OPEN and not runtime.dead:
                return runtime
        with self._lock:
            self._forget_parent_if_forked()
            if self._state in (PublisherState.CLOSING, PublisherState.CLOSED):
                raise ClosedError("publisher is closed")
            runtime = self._runtime
            if runtime is not None and runtime.thread.alive:
                return runtime
            runtime = self._start_runtime()
            self._runtime = runtime
            self._state = PublisherState.OPEN
            return runtime

    def _start_runtime(self) -> _Runtime:
        thread = LoopThread(f"reliable_mq.sync:{self.connection_name}")
        thread.start()
        settings = self._connection
        limit = settings.connect_timeout * len(settings.addresses) + 5.0
        opened = thread.submit(self._open())
        try:
            publisher = opened.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            opened.cancel()
            thread.stop(timeout=5.0)
            raise BrokerUnavailable(f"no connection within {limit:.0f}s") from None
        except BaseException:
            thread.stop(timeout=5.0)
            raise
        return _Runtime(thread, publisher, self._max_pending)

    async def _open(self) -> ReliablePublisher:
        publisher = ReliablePublisher(
            self._connection,
            settings=self.settings,
            registry=self._registry,
            metrics_prefix=self._metrics_prefix,
        )
        await publisher.start()
        return publisher

    def _forget_parent_if_forked(self) -> None:
        if self._pid != os.getpid():
            self._after_fork_in_child()

    def _after_fork_in_child(self) -> None:
        """In a forked child: drop the parent's loop and connection without touching them.

        Called by the fork hook (and by a pid check, as a fallback). The
        parent's objects are kept referenced, never used: closing them here
        would run finalizers against a loop whose thread is gone.
        """
        self._lock = threading.Lock()
        self._idle = threading.Condition()
        self._closed = threading.Event()
        self._closing = False
        self._outstanding = 0
        if self._runtime is not None:
            _process.orphan(self._runtime)
            self._runtime = None
        if self._state is PublisherState.OPEN:
            self._state = PublisherState.IDLE
        pid = os.getpid()
        base = self._connection.connection_name.split(".fork", 1)[0][:180]
        self._connection = self._connection.model_copy(
            update={"connection_name": f"{base}.fork{pid}"}
        )
        self._pid = pid

    def _close_at_exit(self) -> None:
        """The ``atexit`` hook's part: close if running in this process, bounded."""
        if self._pid != os.getpid() or self._state is not PublisherState.OPEN:
            return
        self.close(timeout=self._exit_timeout)


async def _close_runtime(runtime: _Runtime, wait: float) -> None:
    runtime.drain()  # messages handed over before close() are still published
    await asyncio.sleep(0)  # their tasks take a window slot before the publisher closes
    await runtime.publisher.close(wait)


def _wait(
    future: concurrent.futures.Future[_T],
    limit: float | None,
    message_id: str,
    *,
    runtime: _Runtime | None = None,
) -> _T:
    """Wait for a future filled by the loop thread, never forever.

    ``limit`` bounds the wait (a safety net past the message's own deadline);
    with ``runtime``, the wait also ends if the loop thread dies.
    """
    waited = 0.0
    while True:
        step = 1.0 if limit is None else min(1.0, max(limit - waited, 0.0))
        try:
            return future.result(timeout=step)
        except concurrent.futures.TimeoutError:
            if future.done():  # a TimeoutError of the publish itself (PublishTimeout)
                return future.result()
        waited += step
        if runtime is not None and not runtime.thread.alive:
            future.cancel()
            raise PublishAborted(
                "the publisher's loop thread ended", message_id=message_id, attempts=0
            )
        if limit is not None and waited >= limit:
            future.cancel()
            raise PublishTimeout(
                "no outcome from the publisher's loop thread in time; the broker may have it",
                message_id=message_id,
                attempts=0,
            )


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
