"""The supervisor of ``reliable-mq run``: N worker processes, restarts, probes, drain.

Each worker is a fresh interpreter (``python -m reliable_mq.runner._worker``),
never a fork of the supervisor, so no socket, lock or loop is shared. A worker
that exits while the supervisor is not stopping is restarted after a backoff
(0.5 s, doubling to 30 s). The backoff is reset only by a worker that was
*ready* (consuming every queue, as its status lines said) for `STABLE_AFTER`
seconds in a row: time spent starting, or stuck in a shutdown, does not count.

SIGTERM or SIGINT: the supervisor stops restarting, sends SIGTERM to every
worker (each runs the consumer's graceful stop, fitted into
``graceful_timeout``, which it is told), waits ``graceful_timeout`` seconds,
then SIGKILLs what is left. A second SIGINT kills at once.

Metrics with N workers use prometheus_client's multiprocess mode: workers
write to files in one folder, the supervisor serves the sum on one port.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import glob
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from ..errors import InvalidSettings
from ..log import get_logger
from ._http import HttpServer, Response

__all__ = ("RunnerOptions", "Supervisor", "WorkerState")

STABLE_AFTER = 30.0
"""A worker that was ready this long without a break resets its restart backoff."""
BACKOFF_FIRST = 0.5
BACKOFF_MAX = 30.0
STALE_AFTER = 10.0
"""A worker whose last status line is older than this counts as not ready."""
_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class WorkerState(enum.StrEnum):
    """Where one worker slot is."""

    STARTING = "starting"
    """Process started; its consumer is not consuming yet."""
    RUNNING = "running"
    """Process alive (see ``ready`` for whether it consumes every queue)."""
    BACKOFF = "backoff"
    """The process exited; waiting before a restart."""
    STOPPING = "stopping"
    """Sent SIGTERM; draining."""
    STOPPED = "stopped"
    """Exited after the supervisor asked it to."""


@dataclass
class RunnerOptions:
    """What ``reliable-mq run`` was asked to do.

    Raises:
        InvalidSettings: a field is out of range (named in the message).
    """

    target: str
    workers: int = 1
    metrics_port: int | None = None
    http_host: str = "127.0.0.1"
    graceful_timeout: float = 60.0
    log_json: bool = True
    log_level: str = "INFO"
    app_dir: str = "."

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        if type(self.workers) is not int or not 1 <= self.workers <= 1024:
            problems.append(("workers", "must be an int from 1 to 1024"))
        port = self.metrics_port
        if port is not None and (type(port) is not int or not 0 <= port <= 65535):
            problems.append(("metrics_port", "must be None or an int from 0 to 65535"))
        timeout = self.graceful_timeout
        if not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            problems.append(("graceful_timeout", "must be a finite number of seconds above 0"))
        if problems:
            raise InvalidSettings("RunnerOptions", problems)


@dataclass
class _Slot:
    index: int
    state: WorkerState = WorkerState.STARTING
    process: asyncio.subprocess.Process | None = None
    ready: bool = False
    reported_at: float = 0.0
    started_at: float = 0.0
    ready_since: float | None = None
    """When the current unbroken run of "ready" status lines began (None: not ready)."""
    ready_for: float = 0.0
    """The longest unbroken time this process reported itself ready."""
    restarts: int = 0
    failures: int = 0
    last_exit: int | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def spawned(self, now: float) -> None:
        self.state = WorkerState.STARTING
        self.ready = False
        self.started_at = now
        self.ready_since = None
        self.ready_for = 0.0

    def observe(self, ready: bool, now: float) -> None:
        """A status line: ``ready`` at ``now`` (lines come every second while alive)."""
        self.reported_at = now
        if not ready:
            self.ready_since = None
            return
        if self.ready_since is None:
            self.ready_since = now
        self.ready_for = max(self.ready_for, now - self.ready_since)

    def stable(self) -> bool:
        """The process was ready for `STABLE_AFTER` s in a row: its exit resets the backoff.

        Measured from its own status lines, so neither a slow start nor a shutdown
        that hangs (no lines, or "not ready" ones) makes a crash loop look healthy.
        """
        return self.ready_for >= STABLE_AFTER

    def is_ready(self, now: float) -> bool:
        return (
            self.state is WorkerState.RUNNING
            and self.ready
            and now - self.reported_at < STALE_AFTER
        )

    def describe(self, now: float) -> dict[str, object]:
        return {
            "index": self.index,
            "pid": self.pid,
            "state": self.state.value,
            "ready": self.is_ready(now),
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }


class Supervisor:
    """Runs and supervises the workers of one ``reliable-mq run``.

    Args:
        options: the target, worker count, ports and timeouts.
    """

    def __init__(self, options: RunnerOptions) -> None:
        self.options = options
        self._log = get_logger(__name__).bind(role="supervisor")
        self._slots = [_Slot(index) for index in range(options.workers)]
        self._stopping = asyncio.Event()
        self._signals = 0
        self._http: HttpServer | None = None
        self._metrics_dir: str | None = None
        self._own_metrics_dir = False
        self._registry: CollectorRegistry | None = None
        self._readers: set[asyncio.Task[None]] = set()

    @property
    def http_port(self) -> int | None:
        return self._http.port if self._http is not None else None

    def request_stop(self, sig: signal.Signals = signal.SIGTERM) -> None:
        """Begin the graceful drain (a second SIGINT kills the workers at once)."""
        self._signals += 1
        if self._stopping.is_set():
            if sig is signal.SIGINT and self._signals > 1:
                self._log.warning("supervisor_killing_workers")
                self._send_all(signal.SIGKILL)
            return
        self._log.info("supervisor_stopping", signal=sig.name)
        self._stopping.set()

    async def run(self) -> int:
        """Run until stopped; returns 0 if every worker stopped cleanly, else 1.

        Raises:
            OSError: the metrics port cannot be bound.
        """
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop, sig)
        try:
            if self.options.metrics_port is not None:
                await self._start_http(self.options.metrics_port)
            self._log.info(
                "supervisor_started",
                target=self.options.target,
                workers=self.options.workers,
                http_port=self.http_port,
            )
            keepers = [loop.create_task(self._keep(slot)) for slot in self._slots]
            await self._stopping.wait()
            clean = await self._drain(keepers)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if self._http is not None:
                await self._http.close()
            self._remove_metrics_dir()
        self._log.info("supervisor_stopped", clean=clean)
        return 0 if clean else 1

    # -- workers ------------------------------------------------------------------

    async def _keep(self, slot: _Slot) -> None:
        """Start the slot's worker; restart it with backoff until stopping."""
        while not self._stopping.is_set():
            try:
                await self._spawn(slot)
            except OSError as exc:  # out of processes or descriptors: try again later
                slot.process = None
                slot.spawned(time.monotonic())
                code = None
                self._log.error("worker_spawn_failed", worker=slot.index, error=repr(exc))
            else:
                if self._stopping.is_set():  # the drain may have signalled before we spawned
                    slot.state = WorkerState.STOPPING
                    self._send_all(signal.SIGTERM)
                code = await self._watch(slot)
                slot.last_exit = code
                self._forget_worker_gauges(slot.pid)
            if self._stopping.is_set():
                break
            slot.failures = 1 if slot.stable() else slot.failures + 1
            delay = min(BACKOFF_FIRST * 2 ** (slot.failures - 1), BACKOFF_MAX)
            slot.state = WorkerState.BACKOFF
            self._log.warning(
                "worker_exited", worker=slot.index, pid=slot.pid, code=code, restart_in=delay
            )
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._stopping.wait()
            if not self._stopping.is_set():
                slot.restarts += 1
        slot.state = WorkerState.STOPPED

    async def _spawn(self, slot: _Slot) -> None:
        read_fd, write_fd = os.pipe()
        options = self.options
        argv = [
            sys.executable,
            "-m",
            "reliable_mq.runner._worker",
            options.target,
            "--index",
            str(slot.index),
            "--status-fd",
            str(write_fd),
            "--log-level",
            options.log_level,
            "--log-json" if options.log_json else "--no-log-json",
            "--graceful-timeout",
            str(float(options.graceful_timeout)),
        ]
        try:
            slot.process = await asyncio.create_subprocess_exec(
                *argv,
                pass_fds=(write_fd,),
                env=self._worker_env(),
                stdin=asyncio.subprocess.DEVNULL,
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        slot.spawned(time.monotonic())
        reader = asyncio.get_running_loop().create_task(self._read_status(slot, read_fd))
        self._readers.add(reader)
        reader.add_done_callback(self._readers.discard)
        self._log.info("worker_spawned", worker=slot.index, pid=slot.pid)

    async def _watch(self, slot: _Slot) -> int:
        assert slot.process is not None
        code = await slot.process.wait()
        slot.ready = False
        return code

    async def _read_status(self, slot: _Slot, read_fd: int) -> None:
        """Follow one worker's status lines until its pipe closes."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader(limit=4096)
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(
            lambda: asyncio.StreamReaderProtocol(reader), pipe
        )
        try:
            while True:
                try:
                    line = await reader.readline()
                except ValueError:  # an over-long line: skip it
                    continue
                if not line:
                    return
                self._on_status(slot, line)
        finally:
            transport.close()

    def _on_status(self, slot: _Slot, line: bytes) -> None:
        try:
            report = json.loads(line)
            ready = report["ready"]
        except (ValueError, KeyError, TypeError):
            return
        if not isinstance(ready, bool) or slot.state not in (
            WorkerState.STARTING,
            WorkerState.RUNNING,
        ):
            return
        slot.observe(ready, time.monotonic())
        if ready and slot.state is WorkerState.STARTING:
            slot.state = WorkerState.RUNNING
        if ready != slot.ready:
            slot.ready = ready
            self._log.info("worker_readiness", worker=slot.index, pid=slot.pid, ready=ready)

    async def _drain(self, keepers: list[asyncio.Task[None]]) -> bool:
        """SIGTERM every worker, wait ``graceful_timeout``, SIGKILL the rest."""
        for slot in self._slots:
            if slot.state in (WorkerState.STARTING, WorkerState.RUNNING):
                slot.state = WorkerState.STOPPING
        self._send_all(signal.SIGTERM)
        _, late = await asyncio.wait(keepers, timeout=self.options.graceful_timeout)
        if late:
            self._log.error("workers_not_drained", timeout=self.options.graceful_timeout)
            self._send_all(signal.SIGKILL)
            await asyncio.wait(late, timeout=10)
        for task in keepers:
            if not task.done():
                task.cancel()
        # -SIGTERM: a worker still importing when asked to stop (nothing in flight yet).
        clean_exits = (0, None, -signal.SIGTERM)
        return not late and all(slot.last_exit in clean_exits for slot in self._slots)

    def _send_all(self, sig: signal.Signals) -> None:
        for slot in self._slots:
            process = slot.process
            if process is not None and process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    process.send_signal(sig)

    def _worker_env(self) -> dict[str, str]:
        env = dict(os.environ)
        app_dir = str(Path(self.options.app_dir).resolve())
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [app_dir, env.get("PYTHONPATH")]))
        if self._metrics_dir is not None:
            env[_MULTIPROC_ENV] = self._metrics_dir
        return env

    # -- probes and metrics ---------------------------------------------------------

    async def _start_http(self, port: int) -> None:
        self._metrics_dir = os.environ.get(_MULTIPROC_ENV) or None
        if self._metrics_dir is None:
            self._metrics_dir = tempfile.mkdtemp(prefix="reliable-mq-metrics-")
            self._own_metrics_dir = True
        else:  # a folder of the operator's: stale files from an earlier run would add up
            for stale in glob.glob(os.path.join(self._metrics_dir, "*.db")):
                os.remove(stale)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=self._metrics_dir)  # type: ignore[no-untyped-call]
        self._registry = registry
        self._http = HttpServer(
            self.options.http_host,
            port,
            {"/livez": self._livez, "/readyz": self._readyz, "/metrics": self._metrics},
        )
        await self._http.start()

    def _status(self) -> dict[str, object]:
        now = time.monotonic()
        workers = [slot.describe(now) for slot in self._slots]
        return {"ready": all(w["ready"] for w in workers), "workers": workers}

    async def _livez(self) -> Response:
        return Response(200, json.dumps({"live": True, **self._status()}).encode())

    async def _readyz(self) -> Response:
        status = self._status()
        ready = bool(status["ready"]) and not self._stopping.is_set()
        status["ready"] = ready
        return Response(200 if ready else 503, json.dumps(status).encode())

    async def _metrics(self) -> Response:
        assert self._registry is not None
        body = await asyncio.to_thread(generate_latest, self._registry)
        return Response(200, body, CONTENT_TYPE_LATEST)

    def _forget_worker_gauges(self, pid: int | None) -> None:
        """A dead worker's gauges (connection up, in flight...) must not linger.

        Its counters and histograms stay, so totals never go backwards.
        """
        if self._metrics_dir is None or pid is None:
            return
        for path in glob.glob(os.path.join(self._metrics_dir, f"gauge_*_{pid}.db")):
            with contextlib.suppress(OSError):
                os.remove(path)

    def _remove_metrics_dir(self) -> None:
        if self._own_metrics_dir and self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
