"""``reliable-mq run``: workers as real processes against the real broker.

Every runner is started in its own session (process group) and killed as a
group afterwards, so a failed test leaves no worker behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import pytest

from reliable_mq import ConnectionSettings, InvalidSettings, Message, QueueTopology
from reliable_mq.runner import RunnerOptions
from reliable_mq.runner._supervisor import STABLE_AFTER, _Slot
from reliable_mq.runner._worker import stop_budget
from reliable_mq.sync import BlockingPublisher
from reliable_mq.topology import delete_topology
from tests.support.amqp import drain_queue_sync, run_sync
from tests.support.cli_fork import CliForkServer
from tests.support.threaded_proxy import ThreadedProxy

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]
TARGET = "tests.support.runner_app"


class Runner:
    """One ``reliable-mq run`` process, its log file and its HTTP port."""

    def __init__(self, tmp: Path, args: list[str], env: dict[str, str]) -> None:
        self.log_path = tmp / f"runner-{uuid.uuid4().hex[:6]}.log"
        self._log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "reliable_mq.cli", "run", *args],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.port = 0

    def events(self) -> list[dict[str, Any]]:
        """Every JSON log line so far (the supervisor's and the workers')."""
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    found.append(event)
        return found

    def wait_port(self) -> int:
        def started() -> int | None:
            assert self.process.poll() is None, self.tail()
            for event in self.events():
                if event.get("event") == "supervisor_started":
                    return int(event["http_port"])
            return None

        self.port = wait_for(started, 60, "the supervisor to start")
        return self.port

    def get(self, path: str) -> tuple[int, bytes] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()
        except OSError:
            return None

    def readiness(self) -> dict[str, Any] | None:
        answer = self.get("/readyz")
        if answer is None:
            return None
        status, body = answer
        report: dict[str, Any] = json.loads(body)
        assert (status == 200) == report["ready"], (status, report)
        return report

    def stop(self, timeout: float = 90) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)

    def tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self._log.close()


def wait_for(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.1)


@pytest.fixture
def rqueue(broker_url: str) -> Iterator[str]:
    """A queue name; the consumer declares its topology, deleted afterwards."""
    name = f"test-runner-{uuid.uuid4().hex[:10]}"
    yield name

    async def delete() -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await delete_topology(await connection.channel(), QueueTopology(name))

    run_sync(delete)


@pytest.fixture
def start_runner(tmp_path: Path, broker_url: str) -> Iterator[Callable[..., Runner]]:
    started: list[Runner] = []

    def start(*args: str, url: str = broker_url, **env: str) -> Runner:
        environ = {**os.environ, "RELIABLE_MQ_URL": url, **env}
        environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        runner = Runner(tmp_path, list(args), environ)
        started.append(runner)
        return runner

    yield start
    for runner in started:
        runner.kill()


def _handled(out: Path) -> list[str]:
    return [line for path in out.glob("*.log") for line in path.read_text().splitlines()]


def _publish(url: str, queue: str, ids: list[str]) -> None:
    name = f"test-runner-pub-{uuid.uuid4().hex[:6]}"
    with BlockingPublisher(ConnectionSettings(url=url, connection_name=name)) as publisher:  # type: ignore[arg-type]
        publisher.publish_many(Message(b"m", routing_key=queue, message_id=i) for i in ids)


WORKER_ORPHAN_BOUND = 10.0
"""Seconds within which a worker exits once its supervisor is gone: up to one 1 s
heartbeat to notice, then the drain of an idle consumer (1.5 s measured on a
shared 2-core machine)."""


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (orphans are reaped by whoever adopts them)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _queue_counts(url: str, queue: str) -> tuple[int, int]:
    """(ready messages, consumers) of ``queue``, from a passive declare."""

    async def go() -> tuple[int, int]:
        connection = await aio_pika.connect(url)
        async with connection:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            result = declared.declaration_result
            return result.message_count or 0, result.consumer_count or 0

    return run_sync(go)


def _consumers(url: str, queue: str) -> int:
    return _queue_counts(url, queue)[1]


class TestTargets:
    @pytest.mark.parametrize(
        ("target", "message"),
        [
            ("no_such_module_x:consumer", "cannot import"),
            (f"{TARGET}:missing", "has no attribute"),
            (f"{TARGET}:not_a_consumer", "is a int, not a ReliableConsumer"),
            (f"{TARGET}:empty_router", "no handlers"),
            ("not a path", "not an import path"),
        ],
    )
    def test_a_bad_target_exits_2_with_the_reason(
        self, target: str, message: str, cli_fork_server: CliForkServer
    ) -> None:
        run = cli_fork_server.run(
            ["run", target], env=dict(os.environ), cwd=ROOT, stdin=b"", timeout=120
        )
        assert run.code == 2, run.stderr
        assert message in run.stderr


class TestOptions:
    @pytest.mark.parametrize(
        "fields",
        [
            {"workers": 0},
            {"workers": 2.0},
            {"metrics_port": 70000},
            {"graceful_timeout": float("nan")},
            {"graceful_timeout": 0},
        ],
    )
    def test_out_of_range_options_are_refused(self, fields: dict[str, Any]) -> None:
        with pytest.raises(InvalidSettings, match=next(iter(fields))):
            RunnerOptions(target=f"{TARGET}:consumer", **fields)

    def test_a_port_in_use_exits_2_before_any_worker_starts(
        self, cli_fork_server: CliForkServer
    ) -> None:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            port = taken.getsockname()[1]
            run = cli_fork_server.run(
                ["run", f"{TARGET}:consumer", "--metrics-port", str(port)],
                env=dict(os.environ),
                cwd=ROOT,
                stdin=b"",
                timeout=120,
            )
        assert run.code == 2, run.stderr
        assert "cannot listen" in run.stderr
        assert "worker_spawned" not in run.stdout


def _lived(events: list[tuple[float, bool | None]]) -> _Slot:
    """A slot spawned at 0 that saw these status lines (``None``: a gap, no line)."""
    slot = _Slot(0)
    slot.spawned(0.0)
    for at, ready in events:
        if ready is not None:
            slot.observe(ready, at)
    return slot


class TestBackoff:
    """What resets the restart backoff: an unbroken time ready, not time since spawn."""

    @pytest.mark.parametrize(
        ("lines", "stable"),
        [
            pytest.param([(2.0 + t, True) for t in range(40)], True, id="ready-40s"),
            # ready 5 s, then the loop ended (SystemExit) and the stop hung 30 s: no lines
            pytest.param([(2.0 + t, True) for t in range(5)] + [(37.0, None)], False, id="hung"),
            # ready 5 s, then 30 s of "not ready" lines while it stopped
            pytest.param(
                [(2.0 + t, True) for t in range(5)] + [(7.0 + t, False) for t in range(30)],
                False,
                id="stopping",
            ),
            pytest.param([(29.0 + t, True) for t in range(3)], False, id="slow-start"),
            pytest.param(
                [(t, True) for t in range(20)]
                + [(20.0, False)]
                + [(21.0 + t, True) for t in range(20)],
                False,
                id="broken-run",
            ),
        ],
    )
    def test_only_an_unbroken_ready_run_is_stable(
        self, lines: list[tuple[float, bool | None]], stable: bool
    ) -> None:
        assert _lived(lines).stable() is stable

    def test_a_respawn_forgets_the_last_run(self) -> None:
        slot = _lived([(float(t), True) for t in range(int(STABLE_AFTER) + 2)])
        assert slot.stable()
        slot.spawned(100.0)
        assert not slot.stable()

    @pytest.mark.parametrize("graceful", [0.1, 1.0, 3.0, 10.0, 60.0, 3600.0])
    def test_the_stop_budget_ends_before_the_supervisors_sigkill(self, graceful: float) -> None:
        handlers, stop, end = stop_budget(graceful)
        assert 0 < handlers < stop < end < graceful
        assert graceful - end <= 2.0


class TestWorkers:
    def test_sigterm_drains_every_worker(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str, tmp_path: Path
    ) -> None:
        """Handled messages are acked, the rest stay queued: none lost, none unacked."""
        ids = [f"r-{n}" for n in range(1500)]
        out = tmp_path / "out"
        out.mkdir()
        runner = start_runner(
            f"{TARGET}:consumer",
            "--workers",
            "2",
            "--metrics-port",
            "0",
            RUNNER_TEST_QUEUE=rqueue,
            RUNNER_TEST_OUT=str(out),
            RUNNER_TEST_SLEEP="0.02",
        )
        runner.wait_port()
        wait_for(lambda: (r := runner.readiness()) and r["ready"], 90, "readiness")
        _publish(broker_url, rqueue, ids)  # into the queue the consumers declared
        wait_for(lambda: len(_handled(out)) >= 200, 90, "200 handled messages")
        metrics = runner.get("/metrics")
        assert metrics is not None and metrics[0] == 200
        assert b"reliable_mq_consumed_messages_total" in metrics[1]
        assert runner.stop() == 0, runner.tail()
        handled = _handled(out)
        remaining = [m.message_id for m in drain_queue_sync(broker_url, rqueue)]
        assert len(handled) == len(set(handled))  # none ran twice
        assert set(handled).isdisjoint(remaining)  # handled ones were acked, not requeued
        assert sorted(handled + remaining) == sorted(ids)  # type: ignore[operator]
        assert len(remaining) > 0  # the drain stopped mid-queue: the test proves something
        events = runner.events()
        drained = {e["pid"] for e in events if e.get("event") == "worker_draining"}
        assert len(drained) == 2
        assert any(e.get("event") == "supervisor_stopped" and e["clean"] for e in events)

    def test_a_killed_worker_is_restarted(
        self, start_runner: Callable[..., Runner], rqueue: str
    ) -> None:
        runner = start_runner(
            f"{TARGET}:consumer", "--workers", "2", "--metrics-port", "0", RUNNER_TEST_QUEUE=rqueue
        )
        runner.wait_port()
        first = wait_for(lambda: (r := runner.readiness()) and r["ready"] and r, 90, "readiness")
        victim = first["workers"][0]["pid"]
        os.kill(victim, signal.SIGKILL)

        def replaced() -> dict[str, Any] | None:
            report = runner.readiness()
            if report is None:
                return None
            worker = report["workers"][0]
            done = report["ready"] and worker["pid"] != victim and worker["restarts"] == 1
            return report if done else None

        report = wait_for(replaced, 90, "the killed worker to be replaced")
        assert report["workers"][0]["last_exit"] == -signal.SIGKILL
        assert report["workers"][1]["pid"] == first["workers"][1]["pid"]  # the other one lives on
        assert runner.stop() == 0, runner.tail()

    def test_workers_exit_when_the_supervisor_is_killed(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str
    ) -> None:
        """SIGKILL the supervisor alone: each worker sees its status pipe break,
        drains and exits within WORKER_ORPHAN_BOUND seconds; nobody consumes after."""
        runner = start_runner(
            f"{TARGET}:consumer", "--workers", "2", "--metrics-port", "0", RUNNER_TEST_QUEUE=rqueue
        )
        runner.wait_port()
        report = wait_for(lambda: (r := runner.readiness()) and r["ready"] and r, 90, "readiness")
        pids = [worker["pid"] for worker in report["workers"]]
        assert _consumers(broker_url, rqueue) == 2
        os.kill(runner.process.pid, signal.SIGKILL)  # the supervisor only, not its group
        killed = time.monotonic()
        runner.process.wait(30)
        wait_for(
            lambda: not any(_alive(pid) for pid in pids),
            WORKER_ORPHAN_BOUND,
            "the orphaned workers to exit",
        )
        took = time.monotonic() - killed
        events = runner.events()
        gone = {e["pid"] for e in events if e.get("event") == "supervisor_gone"}
        stopped = {e["pid"] for e in events if e.get("event") == "worker_stopped"}
        assert gone == stopped == set(pids), runner.tail()
        assert _consumers(broker_url, rqueue) == 0
        assert took < WORKER_ORPHAN_BOUND

    def test_a_worker_whose_handler_ignores_the_drain_exits_within_the_graceful_timeout(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str, tmp_path: Path
    ) -> None:
        """SIGTERM with a handler that swallows cancellation for ever: the worker fits its
        drain into --graceful-timeout (the handler's delivery is requeued), then ends
        itself before the supervisor's SIGKILL, with an error line; exit 1."""
        graceful = 3.0
        out = tmp_path / "out"
        out.mkdir()
        runner = start_runner(
            f"{TARGET}:stubborn",
            "--metrics-port",
            "0",
            "--graceful-timeout",
            str(graceful),
            RUNNER_TEST_QUEUE=rqueue,
            RUNNER_TEST_OUT=str(out),
        )
        runner.wait_port()
        report = wait_for(lambda: (r := runner.readiness()) and r["ready"] and r, 90, "readiness")
        [pid] = [worker["pid"] for worker in report["workers"]]
        _publish(broker_url, rqueue, ["stuck"])
        # In the handler, not only sent by the broker: a SIGTERM between the two would
        # find no handler to wait for (the delivery goes back, the worker exits 0).
        wait_for(lambda: _handled(out) == ["stuck"], 30, "the handler to start")
        runner.process.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = runner.process.wait(60)
        took = time.monotonic() - asked
        assert code == 1, runner.tail()
        assert took < graceful, took  # before the SIGKILL, by itself
        assert not _alive(pid)
        events = [e.get("event") for e in runner.events()]
        assert "worker_draining" in events and "worker_exit_forced" in events, runner.tail()
        assert "workers_not_drained" not in events  # no SIGKILL was needed
        exits = [e for e in runner.events() if e.get("event") == "worker_exited"]
        assert not exits  # the supervisor was stopping: no restart
        [message] = drain_queue_sync(broker_url, rqueue)
        assert (message.message_id, message.redelivered) == ("stuck", True)

    def test_a_wedged_worker_is_killed_after_the_graceful_timeout(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str, tmp_path: Path
    ) -> None:
        """A handler that holds the GIL for ever: no Python code of the worker runs, so
        SIGKILL after --graceful-timeout is what ends it; the broker requeues its delivery."""
        graceful = 3.0
        out = tmp_path / "out"
        out.mkdir()
        runner = start_runner(
            f"{TARGET}:wedged",
            "--metrics-port",
            "0",
            "--graceful-timeout",
            str(graceful),
            RUNNER_TEST_QUEUE=rqueue,
            RUNNER_TEST_OUT=str(out),
        )
        runner.wait_port()
        wait_for(lambda: (r := runner.readiness()) and r["ready"], 90, "readiness")
        _publish(broker_url, rqueue, ["wedge"])
        wait_for(lambda: _handled(out) == ["wedge"], 30, "the handler to start")
        runner.process.send_signal(signal.SIGTERM)
        asked = time.monotonic()
        code = runner.process.wait(60)
        took = time.monotonic() - asked
        assert code == 1, runner.tail()
        assert graceful <= took < graceful + 10, took
        events = [e.get("event") for e in runner.events()]
        assert "workers_not_drained" in events, runner.tail()
        [message] = drain_queue_sync(broker_url, rqueue)
        assert (message.message_id, message.redelivered) == ("wedge", True)

    def test_a_loop_ended_by_system_exit_does_not_wait_on_its_cancelled_io(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str, tmp_path: Path
    ) -> None:
        """The event loop ends with SystemExit while the internal publisher has a retry
        copy unconfirmed (the link stalled): asyncio.run cancels every task, I/O included,
        and the consumer's stop must not wait close_timeout (30 s) for a confirm that can
        no longer come. The worker exits with 3 well within that; the supervisor restarts
        it, and the message is handled again (it was never acked)."""
        out = tmp_path / "out"
        out.mkdir()
        go = tmp_path / "go"
        with ThreadedProxy(5672) as proxy:
            runner = start_runner(
                f"{TARGET}:exits",
                "--metrics-port",
                "0",
                url=proxy.url,
                RUNNER_TEST_QUEUE=rqueue,
                RUNNER_TEST_OUT=str(out),
                RUNNER_TEST_GO=str(go),
            )
            runner.wait_port()
            report = wait_for(lambda: (r := runner.readiness()) and r["ready"] and r, 90, "ready")
            [pid] = [worker["pid"] for worker in report["workers"]]
            _publish(broker_url, rqueue, ["exit"])
            wait_for(lambda: _handled(out) == ["exit"], 30, "the handler to start")
            proxy.set_stall(True)
            go.touch()
            stalled = time.monotonic()

            def exited() -> dict[str, Any] | None:
                found = [e for e in runner.events() if e.get("event") == "worker_exited"]
                return found[0] if found else None

            event = wait_for(exited, 60, "the worker to exit")
            took = time.monotonic() - stalled
            proxy.set_stall(False)
            assert event["pid"] == pid and event["code"] == 3, runner.tail()
            assert took < 10, (took, runner.tail())  # was 31 s: close_timeout
            wait_for(lambda: _handled(out).count("exit") >= 2, 90, "the message handled again")
            assert runner.stop() == 0, runner.tail()

    def test_a_handlers_sys_exit_ends_the_worker_promptly_and_sigterm_is_answered(
        self, start_runner: Callable[..., Runner], broker_url: str, rqueue: str, tmp_path: Path
    ) -> None:
        """A handler's sys.exit(3): the worker exits 3 within seconds (it waited the
        internal publisher's close_timeout, 30 s, for confirms its cancelled I/O could
        not bring), is restarted, handles the retry, and the runner stops cleanly."""
        out = tmp_path / "out"
        out.mkdir()
        runner = start_runner(
            f"{TARGET}:sys_exit",
            "--metrics-port",
            "0",
            RUNNER_TEST_QUEUE=rqueue,
            RUNNER_TEST_OUT=str(out),
        )
        runner.wait_port()
        wait_for(lambda: (r := runner.readiness()) and r["ready"], 90, "readiness")
        _publish(broker_url, rqueue, ["bye"])
        wait_for(lambda: _handled(out) == ["bye"], 30, "the handler to run")
        ran = time.monotonic()

        def exited() -> dict[str, Any] | None:
            found = [e for e in runner.events() if e.get("event") == "worker_exited"]
            return found[0] if found else None

        event = wait_for(exited, 60, "the worker to exit")
        took = time.monotonic() - ran
        assert event["code"] == 3 and took < 10, (took, runner.tail())
        wait_for(lambda: _handled(out).count("bye") == 2, 90, "the retry handled")
        asked = time.monotonic()
        assert runner.stop() == 0, runner.tail()
        assert time.monotonic() - asked < 30
        assert _queue_counts(broker_url, rqueue)[0] == 0

    def test_readiness_follows_the_broker_connection(
        self, start_runner: Callable[..., Runner], rqueue: str
    ) -> None:
        """Cut the link: /readyz says 503; let it reconnect: 200 again (a Router target)."""
        with ThreadedProxy(5672) as proxy:
            runner = start_runner(
                f"{TARGET}:router", "--metrics-port", "0", url=proxy.url, RUNNER_TEST_QUEUE=rqueue
            )
            runner.wait_port()
            wait_for(lambda: (r := runner.readiness()) and r["ready"], 90, "readiness")
            assert runner.get("/livez") is not None
            proxy.set_refuse(True)
            assert proxy.cut() >= 1
            wait_for(lambda: (r := runner.readiness()) and not r["ready"], 60, "not ready")
            live = runner.get("/livez")
            assert live is not None and live[0] == 200  # alive while the broker is away
            proxy.set_refuse(False)
            wait_for(lambda: (r := runner.readiness()) and r["ready"], 90, "ready again")
            assert runner.stop() == 0, runner.tail()


class TestHttp:
    def test_unknown_paths_methods_and_garbage(
        self, start_runner: Callable[..., Runner], rqueue: str
    ) -> None:
        runner = start_runner(f"{TARGET}:consumer", "--metrics-port", "0", RUNNER_TEST_QUEUE=rqueue)
        port = runner.wait_port()
        assert runner.get("/nope") is not None and runner.get("/nope")[0] == 404  # type: ignore[index]
        for raw in (b"POST /readyz HTTP/1.1\r\n\r\n", b"\x00\xff garbage\r\n\r\n", b"A" * 20000):
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
                answer = sock.recv(200)
            assert answer.startswith((b"HTTP/1.1 405", b"HTTP/1.1 400")), answer
        assert runner.readiness() is not None  # still serving
        assert runner.stop() == 0, runner.tail()
