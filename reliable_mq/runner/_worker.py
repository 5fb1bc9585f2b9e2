"""One worker process of ``reliable-mq run``: run a consumer until told to stop.

Started by the supervisor as ``python -m reliable_mq.runner._worker``. It
reports its readiness (``consumer.consuming``) as JSON lines on a pipe the
supervisor reads: on every change, and every second as a heartbeat. SIGTERM
or SIGINT runs the consumer's graceful stop; so does losing the supervisor
(the pipe breaks), so a worker never outlives it for more than a second.

The drain always fits in the supervisor's ``--graceful-timeout`` (passed to the
worker), counted from when the drain begins, whatever started it (a signal,
the supervisor gone, or the event loop torn down by a ``SystemExit``); see
`stop_budget`. Handlers get the consumer's ``shutdown_grace``, within the budget;
past the stop budget the rest is cancelled, and past the exit deadline a thread
ends the process (``os._exit(1)``) after an error line, so a worker answers
SIGTERM before the supervisor's SIGKILL even when a handler ignores
cancellation. Either way the broker requeues what the worker had not settled.

Exit codes: 0 after a graceful stop, 1 if the consumer failed to start or
stopped by itself, or its drain overran, 2 if the target cannot be loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence

import structlog

from ..consumer import ReliableConsumer
from ..errors import InvalidSettings, InvalidTarget, ReliableMQError
from ..log import get_logger
from ._logs import configure_runner_logging
from ._target import load_consumer

__all__ = ("main",)

HEARTBEAT = 1.0
"""Seconds between status lines when nothing changes."""
_POLL = 0.1
DEFAULT_GRACEFUL_TIMEOUT = 60.0
"""The supervisor's ``--graceful-timeout`` when none is passed."""
SETTLE_RESERVE = 15.0
"""Seconds of the stop budget kept for what follows the handlers' grace (consumer
cancel, ack flush, the internal publisher's confirms, connection close; 5 s bounds
each), unless that leaves the handlers less than half of it."""


def stop_budget(graceful_timeout: float) -> tuple[float, float, float]:
    """``(handlers, stop, exit)``: seconds from the start of a drain.

    Handlers get at most ``handlers`` to finish, the consumer's stop at most
    ``stop``; at ``exit`` the process ends whatever runs. All three end before
    the supervisor's SIGKILL at ``graceful_timeout`` (a margin of up to 2 s).
    With the defaults (60 s) that is 41, 56 and 58 s: a ``shutdown_grace`` of
    30 s is kept whole.
    """
    margin = min(2.0, graceful_timeout / 4)
    stop = graceful_timeout - 2 * margin
    return max(stop / 2, stop - SETTLE_RESERVE), stop, graceful_timeout - margin


class _Status:
    """Writes status lines to the supervisor's pipe without ever blocking the loop."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self.broken = False

    def send(self, ready: bool) -> None:
        line = json.dumps({"ready": ready, "pid": os.getpid(), "t": time.time()}) + "\n"
        try:
            os.write(self._fd, line.encode())
        except BlockingIOError:
            pass  # the supervisor is behind: the next line says the same, newer
        except OSError as exc:
            if exc.errno in (errno.EPIPE, errno.EBADF):
                self.broken = True
            else:
                raise


async def _report(consumer: ReliableConsumer, status: _Status, stop: asyncio.Event) -> None:
    log = get_logger(__name__)
    last: bool | None = None
    sent_at = 0.0
    while True:
        ready = consumer.consuming
        now = time.monotonic()
        if ready != last or now - sent_at >= HEARTBEAT:
            if ready != last:
                log.info("worker_ready" if ready else "worker_not_ready")
            status.send(ready)
            last, sent_at = ready, now
            if status.broken and not stop.is_set():
                log.warning("supervisor_gone", action="stopping")
                stop.set()
        await asyncio.sleep(_POLL)


async def _serve(consumer: ReliableConsumer, status: _Status, graceful_timeout: float) -> int:
    log = get_logger(__name__)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reporter = loop.create_task(_report(consumer, status, stop))
    drained = True
    try:
        if not await _start(consumer, stop):
            return 0 if stop.is_set() else 1
        try:
            log.info("worker_started", queues=[spec.queue for spec in consumer.handlers])
            await stop.wait()
            log.info("worker_draining")
        finally:
            # Also when this task was cancelled: asyncio.run tears the loop down so
            # after a SystemExit (every task cancelled, the consumer's I/O included).
            drained = await _drain(consumer, graceful_timeout)
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        status.send(False)
    if not drained:
        return 1
    log.info("worker_stopped", **consumer.stats()._asdict())
    return 0


async def _drain(consumer: ReliableConsumer, graceful_timeout: float) -> bool:
    """Stop the consumer within the budget; False if it had to be cut short.

    A daemon thread ends the process at the budget's last figure, should even
    the event loop's own shutdown hang (a handler that swallows cancellation).
    """
    handlers, stop, end = stop_budget(graceful_timeout)
    _exit_at(end)
    grace = min(consumer.settings.shutdown_grace, handlers)
    try:
        async with asyncio.timeout(stop):
            await consumer.stop(grace)
    except TimeoutError:
        get_logger(__name__).error(
            "worker_drain_overran",
            seconds=stop,
            graceful_timeout=graceful_timeout,
            in_progress=consumer.stats().in_progress,
            hint="what is not settled is cancelled; the broker requeues its deliveries",
        )
        return False
    return True


def _exit_at(seconds: float) -> None:
    """End the process ``seconds`` from now, from a daemon thread (the last resort)."""

    def end() -> None:
        get_logger(__name__).error(
            "worker_exit_forced",
            seconds=seconds,
            reason="the drain did not end in time; the broker requeues unsettled deliveries",
        )
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(1)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.name = "reliable_mq.worker:exit-deadline"
    timer.start()


async def _start(consumer: ReliableConsumer, stop: asyncio.Event) -> bool:
    """Start the consumer unless told to stop first; False if it did not start."""
    loop = asyncio.get_running_loop()
    starting = loop.create_task(consumer.start())
    stopping = loop.create_task(stop.wait())
    await asyncio.wait((starting, stopping), return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    if not starting.done():
        starting.cancel()  # start() closes what it opened when cancelled
    try:
        await starting
    except asyncio.CancelledError:
        return False
    except ReliableMQError as exc:
        get_logger(__name__).error("worker_start_failed", error=f"{type(exc).__name__}: {exc}")
        return False
    return True


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="reliable_mq.runner._worker")
    parser.add_argument("target")
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--status-fd", type=int, required=True)
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--graceful-timeout", type=float, default=DEFAULT_GRACEFUL_TIMEOUT)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one worker; returns its exit code (see the module docstring)."""
    args = _parse(argv)
    configure_runner_logging(json=args.log_json, level=args.log_level)
    structlog.contextvars.bind_contextvars(worker=args.index, pid=os.getpid())
    log = get_logger(__name__)
    status = _Status(args.status_fd)
    try:
        consumer = load_consumer(args.target)
    except (InvalidTarget, InvalidSettings) as exc:
        log.error("worker_target_failed", error=str(exc))
        return 2
    return asyncio.run(_serve(consumer, status, args.graceful_timeout))


if __name__ == "__main__":
    sys.exit(main())
