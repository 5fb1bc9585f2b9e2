"""Issue 19, item 10: ``reliable-mq run`` writes for a person on a terminal, JSON elsewhere.

The command runs on a real pseudo-terminal (``pty.openpty``) or on pipes, as
systemd and Kubernetes run it; one run starts a real worker against the
shared broker and is stopped with SIGTERM.
"""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import aio_pika
import pytest

from reliable_mq import QueueTopology
from reliable_mq.topology import delete_topology
from tests.support.amqp import run_sync

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [sys.executable, "-m", "reliable_mq.cli", "run"]


class Terminal:
    """A process whose stdout and stderr are one pseudo-terminal; its output as read so far."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self._master, slave = pty.openpty()
        self.process = subprocess.Popen(
            [*COMMAND, *args],
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            start_new_session=True,
        )
        os.close(slave)
        self.output = ""

    def read_until(self, predicate: object, timeout: float) -> str:
        """Read until ``predicate(output)`` holds, the process has ended, or ``timeout``."""
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while not predicate(self.output) and time.monotonic() < deadline:
            ready, _, _ = select.select([self._master], [], [], 0.2)
            if not ready:
                continue
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                break
            if not chunk:
                break
            self.output += chunk.decode(errors="replace").replace("\r\n", "\n")
        return self.output

    def finish(self, timeout: float) -> int:
        self.read_until(lambda _: False, timeout)
        try:
            return self.process.wait(timeout)
        finally:
            self.close()

    def close(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        os.close(self._master)


def _json_lines(text: str) -> list[dict[str, object]]:
    found = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            found.append(value)
    return found


@pytest.fixture(name="rqueue")
def _rqueue(broker_url: str) -> Iterator[str]:
    name = f"test-run-tty-{uuid.uuid4().hex[:10]}"
    yield name

    async def delete() -> None:
        connection = await aio_pika.connect(broker_url)
        async with connection:
            await delete_topology(await connection.channel(), QueueTopology(name))

    run_sync(delete)


class TestErrorLines:
    def test_plain_text_on_a_terminal(self) -> None:
        """A bad target on a terminal: one readable line, exit 2, no JSON."""
        terminal = Terminal(["no_such_module_x:consumer"])
        code = terminal.finish(60)
        assert code == 2, terminal.output
        lines = terminal.output.strip().splitlines()
        assert lines[-1].startswith("reliable-mq: error: cannot import"), terminal.output
        assert _json_lines(terminal.output) == []

    def test_json_on_a_pipe_and_when_asked(self) -> None:
        """As documented for services: a JSON object on a pipe, and with --log-json anywhere."""
        piped = subprocess.run(
            [*COMMAND, "no_such_module_x:consumer"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert piped.returncode == 2
        [record] = _json_lines(piped.stderr)
        assert str(record["message"]).startswith("reliable-mq: error: cannot import")
        assert record["level"] == "error"
        terminal = Terminal(["no_such_module_x:consumer", "--log-json"])
        assert terminal.finish(60) == 2
        [record] = _json_lines(terminal.output)
        assert "cannot import" in str(record["message"])
        plain = subprocess.run(
            [*COMMAND, "no_such_module_x:consumer", "--no-log-json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert plain.stderr.startswith("reliable-mq: error: cannot import")


class TestLogLines:
    def test_a_worker_logs_readable_lines_on_a_terminal(self, broker_url: str, rqueue: str) -> None:
        """Supervisor and worker events are console lines on a terminal; SIGTERM still drains."""
        terminal = Terminal(
            ["tests.support.runner_app:consumer"],
            env={"RELIABLE_MQ_URL": broker_url, "RUNNER_TEST_QUEUE": rqueue},
        )
        try:
            text = terminal.read_until(lambda out: "worker_ready" in out, 90)
            assert "supervisor_started" in text and "worker_ready" in text, text
            os.killpg(terminal.process.pid, signal.SIGTERM)
            assert terminal.finish(90) == 0, terminal.output
        finally:
            if terminal.process.poll() is None:
                terminal.close()
        assert "supervisor_stopped" in terminal.output
        assert _json_lines(terminal.output) == []
