"""A handler that ends the process (``SystemExit``, ``KeyboardInterrupt``), restarted as a
supervisor would, against the real broker.

Each run is a fresh process. Every handler exits; several deliveries are in
their handlers at once (``concurrency=8``), so several exits race. Each exit
is one failed attempt of its own delivery, settled once: its retry copy is
published and the original acked, before the consumer stops cleanly and
``run()`` re-raises the exit. So the queue set (work + retry + DLQ) holds
exactly one copy of each message after every run, and after ``max_attempts``
runs each message is in the DLQ with the reason. (It used to hold 14-19 copies
after 8 runs: the first exit closed the channel before the others' acks, whose
originals were requeued next to their retry copies; some runs hung.)
"""

from __future__ import annotations

import asyncio
import collections
import signal
import sys
import textwrap
import time
from pathlib import Path

import aio_pika
import pytest

from reliable_mq.delivery import Delivery
from reliable_mq.headers import ATTEMPTS_HEADER, ERROR_TYPE_HEADER, REASON_HEADER
from tests.consume.test_consumer_broker import URL, Env, _env, drain  # noqa: F401 (_env: fixture)

pytestmark = pytest.mark.rabbitmq

RUN_TIMEOUT = 20.0
"""Seconds one process may take from start to exit (it used to hang past this)."""

_SCRIPT = """
import asyncio, sys, threading, time
from pydantic import SecretStr
from reliable_mq import ConnectionSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery

url, queue, out, kind, style, concurrency, mode = sys.argv[1:8]
consumer = ReliableConsumer(
    ConnectionSettings(url=SecretStr(url), connection_name="test-exits"),
    prefetch=50, concurrency=int(concurrency), max_attempts=3, retry_delays=(0.05,),
    shutdown_grace=10,
)
arrived = []
everyone = threading.Event()

def exit_now(delivery):
    with open(out, "a") as f:
        f.write(f"{delivery.message_id} {delivery.attempt}\\n")
    arrived.append(delivery.message_id)
    if len(arrived) >= 3:
        everyone.set()
    everyone.wait(0.5)  # let the exits race: every delivery is in its handler
    raise SystemExit(3) if kind == "exit" else KeyboardInterrupt()

if style == "sync":
    @consumer.handler(queue)
    def handler(delivery: Delivery) -> None:
        exit_now(delivery)
else:
    @consumer.handler(queue)
    async def handler(delivery: Delivery) -> None:
        await asyncio.sleep(0.05)
        exit_now(delivery)

async def without_run() -> None:
    async with consumer:  # start() and stop(): the exit is raised in the loop once stopped
        await asyncio.Event().wait()

asyncio.run(consumer.run() if mode == "run" else without_run())
"""


async def _counts(queues: list[str]) -> dict[str, int]:
    """Ready messages per queue (no consumer is connected between runs)."""
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        counts = {}
        for name in queues:
            declared = await channel.declare_queue(name, passive=True)
            counts[name] = declared.declaration_result.message_count or 0
        return counts
    finally:
        await connection.close()


class TestExitRestarted:
    @pytest.mark.parametrize(
        ("kind", "style", "concurrency", "mode"),
        [
            ("exit", "async", 8, "run"),
            ("exit", "sync", 8, "run"),
            ("interrupt", "async", 8, "run"),
            ("interrupt", "sync", 8, "run"),
            ("exit", "sync", 1, "run"),
            ("exit", "async", 8, "with"),
        ],
    )
    async def test_every_exit_is_one_attempt_and_no_copy_multiplies(
        self, env: Env, tmp_path: Path, kind: str, style: str, concurrency: int, mode: str
    ) -> None:
        """3 messages, every handler exits, the process restarted until the queue set is
        quiet: one copy of each message after every run, each run exits promptly with the
        handler's code, and each message ends in the DLQ after max_attempts (3) runs."""
        out = tmp_path / "runs.txt"
        script = tmp_path / "consume.py"
        script.write_text(textwrap.dedent(_SCRIPT))
        probe = env.consumer(retry_delays=(0.05,))  # the topology's names, and its cleanup

        @probe.handler(env.queue)
        async def unused(delivery: Delivery) -> None: ...

        env.track(probe)
        async with probe:  # declares the topology the script uses
            pass
        topology = probe.topology(env.queue)
        retry = list(topology.retry_queues)
        work_and_retry = [env.queue, *retry]
        every = [*work_and_retry, topology.dead_letter_queue]
        ids = ["a", "b", "c"]
        await env.publish([b"a", b"b", b"c"], ids=ids)
        expected_code = 3 if kind == "exit" else -signal.SIGINT
        runs = 0
        while runs < 10:
            # Wait for the retry copies to come back to the work queue (TTL 0.05 s).
            deadline = time.monotonic() + 10
            while (counts := await _counts(every)) and any(counts[q] for q in retry):
                assert time.monotonic() < deadline, counts
                await asyncio.sleep(0.05)
            assert sum(counts.values()) == 3, (runs, counts)  # never a multiplied copy
            if not counts[env.queue]:
                break
            runs += 1
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                URL,
                env.queue,
                str(out),
                kind,
                style,
                str(concurrency),
                mode,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            started = time.monotonic()
            try:
                _, stderr = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT)
            except TimeoutError:
                process.kill()
                await process.wait()
                pytest.fail(f"run {runs} hung past {RUN_TIMEOUT}s")
            took = time.monotonic() - started
            assert process.returncode == expected_code, stderr.decode(errors="replace")[-3000:]
            assert took < RUN_TIMEOUT
            assert b"never retrieved" not in stderr  # the exit leaves no stray task behind
        handled = [tuple(line.split()) for line in out.read_text().splitlines()]
        attempts = collections.defaultdict(list)
        for message_id, attempt in handled:
            attempts[message_id].append(int(attempt))
        # Each message ran once per attempt (never twice at one attempt), 3 attempts.
        assert {m: sorted(a) for m, a in attempts.items()} == {m: [1, 2, 3] for m in ids}
        dead = {m.message_id: dict(m.headers) for m in await drain(topology.dead_letter_queue)}
        assert sorted(dead) == ids
        for headers in dead.values():
            assert headers[REASON_HEADER] == "max_attempts"
            assert headers[ERROR_TYPE_HEADER] == (
                "SystemExit" if kind == "exit" else "KeyboardInterrupt"
            )
            assert headers[ATTEMPTS_HEADER] == 3
        for name in work_and_retry:
            assert await drain(name) == []


_MIXED = """
import asyncio, sys, time
from pydantic import SecretStr
from reliable_mq import ConnectionSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery

url, queue, out, style = sys.argv[1:5]
consumer = ReliableConsumer(
    ConnectionSettings(url=SecretStr(url), connection_name="test-exits-mixed"),
    prefetch=50, concurrency=8, max_attempts=3, retry_delays=(0.05,), shutdown_grace=1.5,
)

def note(text):
    with open(out, "a") as f:
        f.write(text + "\\n")

def work(delivery: Delivery):
    note(f"start {delivery.message_id}")
    if delivery.message_id == "exit":
        time.sleep(0.3)
        sys.exit(3)
    time.sleep(0.6 if delivery.message_id == "quick" else 30)
    note(f"effect {delivery.message_id}")

if style == "sync":
    consumer.handler(queue)(work)
else:
    @consumer.handler(queue)
    async def handler(delivery: Delivery) -> None:
        note(f"start {delivery.message_id}")
        if delivery.message_id == "exit":
            await asyncio.sleep(0.3)
            sys.exit(3)
        await asyncio.sleep(0.6 if delivery.message_id == "quick" else 30)
        note(f"effect {delivery.message_id}")

asyncio.run(consumer.run())
"""


class TestExitWithOthersInFlight:
    @pytest.mark.parametrize("style", ["async", "sync"])
    async def test_others_finish_within_grace_or_go_back_once(
        self, env: Env, tmp_path: Path, style: str
    ) -> None:
        """One handler exits while two others run: the exit is one attempt (a retry copy),
        the one that finishes within shutdown_grace is acked, the one still running after
        it is requeued without a copy; the process exits with code 3 soon after the grace."""
        out = tmp_path / "runs.txt"
        script = tmp_path / "consume.py"
        script.write_text(textwrap.dedent(_MIXED))
        probe = env.consumer(retry_delays=(0.05,))

        @probe.handler(env.queue)
        async def unused(delivery: Delivery) -> None: ...

        env.track(probe)
        async with probe:
            pass
        topology = probe.topology(env.queue)
        await env.publish([b"e", b"q", b"l"], ids=["exit", "quick", "long"])
        started = time.monotonic()
        process = await asyncio.create_subprocess_exec(
            sys.executable, str(script), URL, env.queue, str(out), style,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, stderr = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT)
        took = time.monotonic() - started
        assert process.returncode == 3, stderr.decode(errors="replace")[-3000:]
        assert took < 15  # the grace (1.5 s) and a start, not the long handler's 30 s
        lines = out.read_text().splitlines()
        assert sorted(lines) == ["effect quick", "start exit", "start long", "start quick"]
        await asyncio.sleep(0.3)  # the retry copy's 0.05 s TTL
        counts = await _counts([env.queue, *topology.retry_queues, topology.dead_letter_queue])
        assert sum(counts.values()) == 2, counts  # exit (attempt 2) and long (requeued)
        left = {
            m.message_id: m.headers.get("x-reliable-mq-attempt") for m in await drain(env.queue)
        }
        assert left == {"exit": 2, "long": None}


_SILENT_BROKER_SCRIPT = """
import asyncio, sys
from pydantic import SecretStr
from reliable_mq import ConnectionSettings
from reliable_mq.consumer import ReliableConsumer

consumer = ReliableConsumer(ConnectionSettings(url=SecretStr(sys.argv[1])))

@consumer.handler("never-consumed")
async def handler(body: bytes) -> None: ...

asyncio.run(consumer.run())
print("exited cleanly")
"""


class TestSignalWhileStarting:
    @pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
    async def test_a_signal_during_start_stops_cleanly(
        self, tmp_path: Path, sig: signal.Signals
    ) -> None:
        """``run()`` listens for signals before it starts: a Ctrl-C (or SIGTERM) while it
        is still connecting (here to a server that accepts and never answers) ends the
        start and ``run()`` returns, exit code 0; it used to be a KeyboardInterrupt
        traceback (SIGINT) or a kill (SIGTERM) when the signal came before consuming."""
        accepted = asyncio.Event()
        held: list[asyncio.StreamWriter] = []

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            held.append(writer)
            accepted.set()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        script = tmp_path / "consume.py"
        script.write_text(_SILENT_BROKER_SCRIPT)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            str(script),
            f"amqp://guest:guest@127.0.0.1:{port}/",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(accepted.wait(), RUN_TIMEOUT)
            await asyncio.sleep(0.3)  # it is waiting for the broker's answer now
            process.send_signal(sig)
            stdout, stderr = await asyncio.wait_for(process.communicate(), RUN_TIMEOUT)
        finally:
            if process.returncode is None:
                process.kill()
            for writer in held:
                writer.close()
            server.close()
        assert process.returncode == 0, stderr.decode()[-2000:]
        assert b"exited cleanly" in stdout
