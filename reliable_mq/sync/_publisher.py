"""BlockingPublisher: the reliable publisher for threads, over the async one.

One daemon thread per process runs an event loop that owns a
[ReliablePublisher][reliable_mq.publisher.ReliablePublisher]; every call is a
message handed to that loop (see `_runtime`). There is no second
implementation: confirms, republishing, deadlines and errors are the async
publisher's.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import itertools
import math
import os
import secrets
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterable, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry
from typing_extensions import Unpack

from .._publish import check_timeout
from ..errors import (
    BrokerUnavailable,
    ClosedError,
    FlushTimeout,
    InvalidMessage,
    InvalidSettings,
    PublishAborted,
    PublishTimeout,
    ReliableMQError,
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
from ._runtime import Runtime, Waiter

__all__ = ("BlockingPublisher",)

_T = TypeVar("_T")

_RESULT_GRACE = 30.0
"""Seconds past a message's own deadline before the caller stops waiting for
the loop thread to report (a safety net: the async publisher enforces deadlines)."""


class BlockingPublisher:
    """Publishes with confirms from plain threads: Flask, Django, scripts, Celery tasks.

    Thread-safe: any number of threads may share one. The first call (or
    ``start()``) connects; ``publish()`` blocks until the broker confirms and
    raises the same errors as
    [ReliablePublisher.publish][reliable_mq.publisher.ReliablePublisher.publish]:

    ```python
    with BlockingPublisher("amqp://guest:guest@127.0.0.1/") as publisher:
        result = publisher.publish({"order": 1}, routing_key="orders")
    ```

    After ``os.fork()`` (a pre-forking server such as gunicorn ``--preload``)
    the child opens its own loop thread and connection on first use, named
    ``<connection_name>.fork<pid>``; it never touches the parent's, and drops
    its copies of the parent's socket descriptors. At interpreter exit, a
    publisher that connected and was not closed is closed, even if nothing
    references it any more: messages still unconfirmed get ``exit_timeout``
    seconds, and the whole close takes at most ``exit_timeout`` + 2 seconds.

    Args:
        connection: an AMQP URL (several, comma separated, fail over), or
            [ConnectionSettings][reliable_mq.settings.ConnectionSettings]; default:
            from ``RELIABLE_MQ_*`` variables.
        settings: window, deadlines and retry policy; default: from
            ``RELIABLE_MQ_PUBLISHER_*`` variables.
        registry: the Prometheus registry for metrics (default: the global one).
        metrics_prefix: the metric name prefix.
        max_pending: messages from ``submit()`` not yet final, at most;
            ``submit()`` blocks beyond that (default: twice ``settings.max_in_flight``).
        exit_timeout: seconds an unclosed publisher waits for confirms at exit
            (the close then gets 2 more seconds at most).
        tracer_provider: an OpenTelemetry ``TracerProvider`` for the publish spans
            (see the tracing guide); default: the global one. Each call runs on the
            loop thread in a copy of the calling thread's context, so a publish span
            is a child of the span current in the caller's thread.

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
        tracer_provider: Any | None = None,
    ) -> None:
        connection = ConnectionSettings.of(connection)
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
        self._tracer_provider = tracer_provider
        self._max_pending = max_pending
        self._exit_timeout = float(exit_timeout)
        self._log = get_logger(__name__)
        self._state = PublisherState.IDLE
        self._runtime: Runtime | None = None
        self._last_runtime: Runtime | None = None
        self._new_process_state()
        _process.track(self)

    def _new_process_state(self) -> None:
        """What must not be shared with a parent process after a fork."""
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._closing = False
        self._id_prefix = secrets.token_hex(8) + "-"
        self._ids = itertools.count(1)

    # -- life cycle -------------------------------------------------------------

    def __enter__(self) -> BlockingPublisher:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def state(self) -> PublisherState:
        """``IDLE`` until connected, ``OPEN``, then ``CLOSING`` and ``CLOSED``."""
        return self._state

    @property
    def connection_name(self) -> str:
        """The AMQP connection name (as the broker shows it)."""
        return f"{self._connection.connection_name}.publisher"

    def start(self) -> None:
        """Connect now rather than on the first call (a no-op when open).

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
        self._refuse_loop_thread("close()")
        closed, runtime = self._begin_close()
        if runtime is None:  # closed already, or another caller is closing it
            closed.wait(wait + _RESULT_GRACE)
            return
        now = time.monotonic()
        self._finish_close(
            closed, runtime, self._submit_close(runtime, wait), now + wait + _RESULT_GRACE, 5.0
        )

    def _begin_close(self) -> tuple[threading.Event, Runtime | None]:
        """Mark the publisher closing; the runtime to close, unless another caller has it."""
        with self._lock:
            self._forget_parent_if_forked()
            runtime, self._runtime = self._runtime, None
            self._last_runtime = runtime or self._last_runtime
            if self._state is not PublisherState.CLOSED:
                self._state = PublisherState.CLOSING
            closed = self._closed
            if runtime is None and not self._closing:
                self._state = PublisherState.CLOSED
                closed.set()  # never started (or start failed): nothing to close
                _process.release(self)
            self._closing = True
        return closed, runtime

    def _submit_close(
        self, runtime: Runtime, wait: float
    ) -> concurrent.futures.Future[None] | None:
        """Start closing on the loop thread (None: its loop is closed already)."""
        try:
            return runtime.thread.submit(runtime.close(wait))
        except RuntimeError:
            return None

    def _finish_close(
        self,
        closed: threading.Event,
        runtime: Runtime,
        done: concurrent.futures.Future[None] | None,
        result_by: float,
        join: float,
    ) -> None:
        """Wait for the close until ``result_by`` (monotonic), then stop the loop thread.

        The thread is given ``join`` seconds to end; past that it is left
        behind (a daemon, it never keeps the process alive).
        """
        try:
            while done is not None and not done.done() and runtime.thread.alive:
                left = result_by - time.monotonic()
                if left <= 0:
                    self._log.warning("close_incomplete", error="no outcome in time")
                    break
                concurrent.futures.wait([done], timeout=min(left, 0.25))
            if done is not None and done.done() and not done.cancelled():
                error = done.exception()
                if error is not None:  # past this point, closing is best effort
                    self._log.warning("close_incomplete", error=repr(error))
            runtime.dead = True
            if not runtime.thread.stop(timeout=join):
                self._log.warning("loop_thread_stuck", thread=runtime.thread.name)
            never_sent = runtime.sweep()
            abandoned = runtime.abandon()
            if never_sent or abandoned:
                self._log.error(
                    "close_unsent",
                    connection=self.connection_name,
                    aborted=abandoned,
                    never_sent=never_sent,
                    reason="the loop thread did not finish closing in time"
                    if abandoned
                    else "handed over after the loop stopped",
                )
        finally:
            self._state = PublisherState.CLOSED
            closed.set()
            _process.release(self)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every message handed over by ``publish()``/``submit()`` is final.

        Raises:
            FlushTimeout: ``timeout`` seconds passed first (the messages stay in flight).
            WouldDeadlock: called from the publisher's own loop thread.
        """
        limit = None if timeout is None else check_timeout(timeout)
        self._refuse_loop_thread("flush()")
        runtime = self._runtime
        if runtime is None or self._pid != os.getpid():
            return
        done = runtime.thread.submit(runtime.flush())

        def late() -> ReliableMQError:
            return FlushTimeout(f"messages still unconfirmed after {limit}s")

        _wait(done, limit, runtime, late)

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
        [ReliablePublisher.publish][reliable_mq.publisher.ReliablePublisher.publish]; in
        addition:

        Raises:
            InvalidMessage: ``routing_key``/``exchange`` is not a str, or
                ``timeout`` is not a finite number above 0.
            WouldDeadlock: called from the publisher's own loop thread.
            ClosedError: the publisher is closed.
        """
        runtime = self._runtime_for_call()
        deadline = self._check(routing_key, exchange, timeout)
        message_id = options.get("message_id")
        if message_id is None:
            message_id = options["message_id"] = f"{self._id_prefix}{next(self._ids)}"
        waiter = Waiter()
        context = contextvars.copy_context()
        runtime.push((waiter, body, routing_key, exchange, timeout, options, context, False))
        waited, limit = 0.0, deadline + _RESULT_GRACE
        while not waiter.wait(1.0):  # the loop thread reports; we only guard against its death
            waited += 1.0
            if not runtime.thread.alive:
                raise PublishAborted(
                    "the publisher's loop thread ended", message_id=message_id, attempts=0
                )
            if waited >= limit:
                raise _no_outcome(message_id)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.result is not None
        return waiter.result

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

        Blocks only while ``max_pending`` submitted messages are outstanding
        (backpressure); past the message's deadline it raises ``PublishTimeout``.
        """
        runtime = self._runtime_for_call()
        deadline = self._check(routing_key, exchange, timeout)
        message_id = options.get("message_id")
        if message_id is None:
            message_id = options["message_id"] = f"{self._id_prefix}{next(self._ids)}"
        if not runtime.slots.acquire(timeout=deadline):
            raise PublishTimeout(
                f"max_pending={self._max_pending} messages outstanding for {deadline}s; never sent",
                message_id=message_id,
                attempts=0,
            )
        future: concurrent.futures.Future[PublishResult] = concurrent.futures.Future()
        context = contextvars.copy_context()
        runtime.push((future, body, routing_key, exchange, timeout, options, context, True))
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
        I/O. Per message it behaves as
        [ReliablePublisher.publish_many][reliable_mq.publisher.ReliablePublisher.publish_many]:
        a message that cannot be encoded, or ends in a publish error, is
        recorded as a failure and the others go on.

        If iterating ``messages`` raises, the messages taken before are still
        published and confirmed, then that exception is raised. When
        ``max_failures`` stops the batch, up to a few thousand messages past
        ``result.taken`` may have been read from ``messages`` (they were in
        transit) without being published: resume from ``result.taken``.

        Args:
            messages: an iterable of ``Message``.
            timeout: the deadline of each message, as in ``publish()``.
            max_failures: stop taking messages after this many failures.
            raise_on_error: raise ``PublishBatchError`` if any message failed.

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
        # The batch's task runs in a copy of this thread's context (its spans' parent).
        outcome = contextvars.copy_context().run(
            runtime.thread.submit,
            runtime.publisher.publish_many(
                feed.items(),
                timeout=timeout,
                max_failures=max_failures,
                raise_on_error=raise_on_error,
            ),
        )
        try:
            feed.produce(messages, alive=lambda: not outcome.done() and runtime.thread.alive)
        except BaseException:
            feed.finish()  # what was handed over is still published and confirmed
            with contextlib.suppress(BaseException):
                _wait(outcome, None, runtime, _aborted)
            raise
        feed.finish()
        return _wait(outcome, None, runtime, _aborted)

    def stats(self) -> PublisherStats:
        """The async publisher's counters (zeros before the first connection; kept after close)."""
        runtime = self._runtime or self._last_runtime
        if runtime is None:
            return PublisherStats(0, 0, 0, 0, 0, 0, 0, 0, 0)
        return runtime.publisher.stats()

    def __repr__(self) -> str:
        return f"<BlockingPublisher {self.connection_name} {self._state.value}>"

    # -- internals ----------------------------------------------------------------

    def _check(self, routing_key: Any, exchange: Any, timeout: Any) -> float:
        """Validate what the facade passes on; return the deadline in seconds."""
        if not isinstance(routing_key, str):
            raise InvalidMessage(f"routing_key must be a str, not {type(routing_key).__name__}")
        if not isinstance(exchange, str):
            raise InvalidMessage(f"exchange must be a str, not {type(exchange).__name__}")
        if timeout is None:
            return self.settings.publish_timeout
        return check_timeout(timeout)

    def _refuse_loop_thread(self, call: str) -> None:
        runtime = self._runtime
        if runtime is not None and runtime.thread.in_loop_thread():
            raise WouldDeadlock(
                f"{call} was called from the publisher's own loop thread "
                "(a future callback?); call it from another thread"
            )

    def _runtime_for_call(self) -> Runtime:
        """The open runtime of this process; start it on first use."""
        runtime = self._runtime
        if runtime is not None and self._pid == os.getpid():
            if runtime.thread.in_loop_thread():
                self._refuse_loop_thread("a blocking publisher call")
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
            _process.hold(self)  # closed at exit even if the caller drops it unclosed
            return runtime

    def _start_runtime(self) -> Runtime:
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
        return Runtime(thread, publisher, self._max_pending)

    async def _open(self) -> ReliablePublisher:
        publisher = ReliablePublisher(
            self._connection,
            settings=self.settings,
            registry=self._registry,
            metrics_prefix=self._metrics_prefix,
            tracer_provider=self._tracer_provider,
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
        would run finalizers against a loop whose thread is gone. The child's
        copies of their file descriptors (the broker socket, the loop's
        selector and wake-up pipe) are pointed at ``/dev/null``: nothing is
        sent, the parent's connection is untouched, and the child holds no
        reference to it. New message ids get a new random prefix, so parent
        and child never share one.
        """
        if self._runtime is not None:
            self._runtime.thread.drop_fds_in_child()
            _process.orphan(self._runtime)
            self._runtime = None
            _process.release(self)
        self._last_runtime = None  # the parent's counters are not this process's
        if self._state is PublisherState.OPEN:
            self._state = PublisherState.IDLE
        self._new_process_state()
        base = self._connection.connection_name.split(".fork", 1)[0][:180]
        self._connection = self._connection.model_copy(
            update={"connection_name": f"{base}.fork{self._pid}"}
        )

    def _start_close_at_exit(self) -> Callable[[], None] | None:
        """The ``atexit`` hook's part: start closing; return what waits for the end.

        The returned function returns at most ``exit_timeout`` +
        ``EXIT_MARGIN`` seconds after this was called, whatever the link does.
        """
        if self._pid != os.getpid() or self._state is not PublisherState.OPEN:
            return None
        started = time.monotonic()
        closed, runtime = self._begin_close()
        if runtime is None:
            return None
        done = self._submit_close(runtime, self._exit_timeout)
        end = started + self._exit_timeout + _process.EXIT_MARGIN
        join = _process.EXIT_MARGIN / 4

        def finish() -> None:
            self._finish_close(closed, runtime, done, end - join, join)

        return finish


def _no_outcome(message_id: str) -> PublishTimeout:
    return PublishTimeout(
        "no outcome from the publisher's loop thread in time; the broker may have it",
        message_id=message_id,
        attempts=0,
    )


def _aborted() -> ReliableMQError:
    return PublishAborted("the publisher's loop thread ended", message_id="", attempts=0)


def _wait(
    future: concurrent.futures.Future[_T],
    limit: float | None,
    runtime: Runtime,
    late: Callable[[], ReliableMQError],
) -> _T:
    """Wait for a future filled by the loop thread, never forever.

    The wait ends with ``late()`` raised after ``limit`` seconds, or if the
    loop thread dies.
    """
    waited = 0.0
    while True:
        step = 1.0 if limit is None else min(1.0, max(limit - waited, 0.0))
        try:
            return future.result(timeout=step)
        except concurrent.futures.TimeoutError:
            if future.done():  # a TimeoutError of the call itself (PublishTimeout)
                return future.result()
        waited += step
        if not runtime.thread.alive or (limit is not None and waited >= limit):
            future.cancel()
            raise late() from None


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
