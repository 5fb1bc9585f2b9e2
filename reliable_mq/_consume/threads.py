"""Plain ``def`` handlers: a bounded pool of daemon threads, and its bridge to the event loop.

A consumer runs a plain ``def`` handler through [`HandlerThreads`][reliable_mq._consume.threads.HandlerThreads],
one pool per queue, sized like the queue's handler limit (``concurrency``, else
``prefetch``). Everything around the call stays on the event loop: the body is
decoded before the hand-over, and the outcome (return, raise, timeout, shutdown)
is settled by the dispatcher as for an ``async def``. The bridge is a coroutine,
so the consumer's watchdog and shutdown cancel it like any handler's await.

Python cannot interrupt a thread. When the wait for a thread is cancelled (a
``handler_timeout``, a shutdown past its grace, a dead channel) the job is
marked abandoned: if it has not started it never runs; if it runs, the thread
finishes it, its result or error is discarded (logged as
``handler_finished_late``), and only then is the thread free for the next job.
Nothing is settled from a thread, so nothing is settled twice.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined at
interpreter exit, so one handler that never returns would hang the process
after ``stop()``. These threads are daemons, and a late job is visible
(`HandlerThreads.busy`) and logged when it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import enum
import inspect
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

import structlog

from ..delivery import Delivery
from ..errors import ClosedError
from ..handlers import SyncHandlerFunc
from ..log import get_logger

__all__ = ("HandlerThreads", "JobState", "pool_size")

FALLBACK_SIZE = 32
"""Threads per queue when neither ``concurrency`` nor ``prefetch`` bounds the handlers."""

_NOT_FROM_A_THREAD = (
    "Delivery.{name}() cannot be called from a plain def handler: it runs in a thread, "
    "and a delivery settles on the consumer's event loop. Return to ack, raise Retry "
    "or Reject to steer the outcome, or make the handler an async def."
)


class JobState(enum.StrEnum):
    """Where one handler call is."""

    QUEUED = "queued"
    """Waiting for a free thread."""
    RUNNING = "running"
    """In a thread."""
    DONE = "done"
    """Finished; its result went back to the loop."""
    ABANDONED = "abandoned"
    """Nobody waits for it any more: skipped if still queued, its result
    discarded if running."""


class _Job:
    __slots__ = (
        "args",
        "context",
        "delivery",
        "func",
        "future",
        "loop",
        "on_end",
        "returned",
        "started",
        "state",
    )

    def __init__(
        self,
        func: SyncHandlerFunc,
        args: tuple[Any, ...],
        loop: asyncio.AbstractEventLoop,
        future: asyncio.Future[None],
        on_end: Callable[[bool], None] | None = None,
    ) -> None:
        self.func = func
        self.args = args
        self.on_end = on_end
        self.returned = False  # func ran and returned (no exception)
        self.context = contextvars.copy_context()  # the delivery task's: structlog context
        self.loop = loop
        self.future = future
        self.state = JobState.QUEUED
        self.started = 0.0
        self.delivery = next((a for a in args if isinstance(a, Delivery)), None)  # for logs


class HandlerThreads:
    """A bounded pool of daemon threads for the plain ``def`` handler of one queue.

    Threads start on demand, up to ``size``, and live until `close`. A job
    waits for a free thread when every one is taken (only possible when late
    handlers hold them: the consumer never hands over more jobs than ``size``
    at once otherwise).

    Args:
        size: the most threads, so the most handlers running at once.
        name: the thread name prefix (printable characters only are kept).
    """

    def __init__(self, size: int, name: str) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size
        self._name = "".join(c if c.isprintable() else "?" for c in name[:60])
        self._lock = threading.Lock()
        self._work: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # threads waiting for a job (not reserved by a submitted one)
        self._busy = 0
        self._peak = 0
        self._closed = False
        self._log = get_logger(__name__)

    @property
    def busy(self) -> int:
        """Threads running a handler now, late ones (result to be discarded) included."""
        return self._busy

    @property
    def peak(self) -> int:
        """The most threads that ran a handler at once."""
        return self._peak

    @property
    def started(self) -> int:
        """Threads started so far (never more than ``size``)."""
        return len(self._threads)

    async def run(
        self, func: SyncHandlerFunc, /, *args: Any, on_end: Callable[[bool], None] | None = None
    ) -> None:
        """Run ``func(*args)`` in a thread of the pool, in a copy of the caller's context.

        A `Delivery` argument is passed as a copy whose settle methods raise
        ``RuntimeError`` (they are coroutines of the loop). Cancelling the
        caller abandons the job (see the module docstring).

        Args:
            func: the plain ``def`` to run.
            args: its arguments.
            on_end: called once on the event loop when ``func`` really ended,
                late or not (a cancelled wait does not end a running thread), or
                when it will never run (abandoned while queued, pool closed); with
                True if ``func`` ran and returned (its effect is done, even late).

        Raises:
            ClosedError: the pool is closed.
            Exception: whatever ``func`` raised (a ``StopIteration`` becomes a
                ``RuntimeError``).
        """
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        args = tuple(_for_thread(arg) if type(arg) is Delivery else arg for arg in args)
        job = _Job(func, args, loop, future, on_end)
        try:
            self._submit(job)
        except BaseException:
            self._ended(job, now=True)  # it will never run
            raise
        try:
            await future
        except asyncio.CancelledError:
            with self._lock:
                if job.state in (JobState.QUEUED, JobState.RUNNING):
                    job.state = JobState.ABANDONED
            raise

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._closed:
                raise ClosedError("the consumer's handler threads are closed")
            self._work.put(job)
            if self._idle:
                self._idle -= 1
                return
            if len(self._threads) >= self.size:
                return  # every thread is taken: the job waits for one
            thread = threading.Thread(
                target=self._serve,
                name=f"{self._name}-{len(self._threads) + 1}",
                daemon=True,  # a handler that never returns must not hold the process
            )
            self._threads.append(thread)
        try:
            thread.start()
        except RuntimeError:  # "can't start new thread": out of threads or memory
            with self._lock:
                self._threads.remove(thread)
                taken = job.state is not JobState.QUEUED  # by another thread meanwhile
                if not taken:
                    job.state = JobState.ABANDONED
            self._log.error("handler_thread_not_started", threads=len(self._threads))
            if not taken:
                raise  # a handler error for this delivery: retried, as for any other

    def _serve(self) -> None:
        """One thread: take jobs until the pool closes."""
        while True:
            job = self._work.get()
            if job is None:
                return
            with self._lock:
                # Timed out or shut down while queued. Task.cancel() cancels the
                # awaited future at once; the task marks the job on its next step.
                skipped = job.state is JobState.ABANDONED or job.future.cancelled()
                if skipped:
                    job.state = JobState.ABANDONED
                    self._idle += 1
                else:
                    job.state = JobState.RUNNING
                    self._busy += 1
                    self._peak = max(self._peak, self._busy)
            if skipped:
                self._ended(job)
                continue
            self._call(job)
            del job  # drop the body, the delivery and the handler's result now

    def _call(self, job: _Job) -> None:
        job.started = time.perf_counter()
        error: BaseException | None = None
        try:
            result: object = job.context.run(job.func, *job.args)
            if inspect.isawaitable(result):
                _close(result)
                raise TypeError("a plain def handler returned an awaitable; declare it async def")
        except StopIteration as exc:  # an asyncio future refuses StopIteration
            error = RuntimeError(f"handler raised StopIteration: {exc!r}")
        except BaseException as exc:  # everything goes back to the loop, as from a coroutine
            error = exc
        else:
            job.returned = True
        with self._lock:
            self._busy -= 1
            self._idle += 1
            late = job.state is JobState.ABANDONED
            if not late:
                job.state = JobState.DONE
        if late:
            job.context.run(self._finished_late, job, error)
        else:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits for it
                job.loop.call_soon_threadsafe(_resolve, job.future, error)
        self._ended(job)

    def _ended(self, job: _Job, *, now: bool = False) -> None:
        """Tell the job's owner that the job ended or will never run: once, on its loop
        (``now``: we are on the loop already)."""
        with self._lock:
            on_end, job.on_end = job.on_end, None
        if on_end is None:
            return
        if now:
            on_end(job.returned)
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is left to tell
            job.loop.call_soon_threadsafe(on_end, job.returned)

    def _finished_late(self, job: _Job, error: BaseException | None) -> None:
        # Run in the job's context, whose structlog contextvars are bound
        # explicitly (structlog may not be configured to merge them), with the
        # delivery's names when the handler takes the delivery.
        names = structlog.contextvars.get_contextvars()
        delivery = job.delivery
        if delivery is not None:
            names.update(
                queue=delivery.queue, message_id=delivery.message_id, attempt=delivery.attempt
            )
        self._log.bind(**names).warning(
            "handler_finished_late",
            seconds=round(time.perf_counter() - job.started, 3),
            error=None if error is None else repr(error)[:300],
            hint="its delivery was settled without it (handler_timeout or shutdown); "
            "the result is discarded",
        )

    def close(self) -> int:
        """Stop taking jobs; threads exit once their handler returns. Never waits.

        Jobs still queued fail with `ClosedError`. Returns the number of
        threads still running a handler (Python cannot stop them; they are
        daemon threads, so they do not keep the process alive).
        """
        with self._lock:
            if self._closed:
                return self._busy
            self._closed = True
            threads = len(self._threads)
            busy = self._busy
        while True:
            try:
                job = self._work.get_nowait()
            except queue.Empty:
                break
            if job is None:
                continue
            with self._lock:
                job.state = JobState.ABANDONED
            if not job.future.done():
                job.future.set_exception(ClosedError("the consumer stopped"))
            self._ended(job)
        for _ in range(threads):
            self._work.put(None)
        return busy


def pool_size(concurrency: int | None, prefetch: int) -> int:
    """Threads for one queue: ``concurrency``, else ``prefetch``, else `FALLBACK_SIZE`.

    Args:
        concurrency: the handler limit below prefetch
            (``ConsumerSettings.effective_concurrency``).
        prefetch: ``ConsumerSettings.prefetch`` (0: unlimited).
    """
    return concurrency or prefetch or FALLBACK_SIZE


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # cancelled after the thread finished, before this ran
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _close(awaitable: object) -> None:
    close = getattr(awaitable, "close", None)
    if callable(close):
        close()  # no "coroutine was never awaited" warning on top of our error


class _ThreadDelivery(Delivery):
    """The copy of a `Delivery` a plain ``def`` handler gets: read it, do not settle it."""

    __slots__ = ()

    def ack(self) -> NoReturn:
        raise RuntimeError(_NOT_FROM_A_THREAD.format(name="ack"))

    def retry(self, reason: str = "", *, delay: float | None = None) -> NoReturn:
        raise RuntimeError(_NOT_FROM_A_THREAD.format(name="retry"))

    def reject(self, reason: str = "") -> NoReturn:
        raise RuntimeError(_NOT_FROM_A_THREAD.format(name="reject"))

    def nack(self, *, requeue: bool = True) -> NoReturn:
        raise RuntimeError(_NOT_FROM_A_THREAD.format(name="nack"))


def _for_thread(delivery: Delivery) -> Delivery:
    copy = _ThreadDelivery.__new__(_ThreadDelivery)
    for slot in Delivery.__slots__:
        setattr(copy, slot, getattr(delivery, slot))
    return copy
