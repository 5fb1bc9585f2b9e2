"""One worker process of ``reliable-mq run``: run a consumer until told to stop.

Started by the supervisor as ``python -m reliable_mq.runner._worker``. It
reports its readiness (``consumer.consuming``) as JSON lines on a pipe the
supervisor reads: on every change, and every second as a heartbeat. SIGTERM
or SIGINT runs the consumer's graceful stop; so does losing the supervisor
(the pipe breaks), so a worker never outlives it for more than a second.

Exit codes: 0 after a graceful stop, 1 if the consumer failed to start or
stopped by itself, 2 if the target cannot be loaded.
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


async def _serve(consumer: ReliableConsumer, status: _Status) -> int:
    log = get_logger(__name__)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reporter = loop.create_task(_report(consumer, status, stop))
    try:
        if not await _start(consumer, stop):
            return 0 if stop.is_set() else 1
        try:
            log.info("worker_started", queues=[spec.queue for spec in consumer.handlers])
            await stop.wait()
            log.info("worker_draining")
        finally:
            await consumer.stop()
    finally:
        reporter.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporter
        status.send(False)
    log.info("worker_stopped", **consumer.stats()._asdict())
    return 0


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
    return asyncio.run(_serve(consumer, status))


if __name__ == "__main__":
    sys.exit(main())
