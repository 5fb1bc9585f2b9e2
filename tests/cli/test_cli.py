"""The ``reliable-mq`` CLI, driven as a subprocess against the real broker."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import pytest
from prometheus_client import CollectorRegistry

from reliable_mq import (
    ConsumerSettings,
    Message,
    QueueTopology,
    ReliableConsumer,
    ReliablePublisher,
)
from reliable_mq.streams import StreamReader
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import declare_topology, delete_topology
from tests.conftest import proxied_url
from tests.support.amqp import ESCAPED, MARK, drain_queue, hostile_frames
from tests.support.cli_fork import CliForkServer, Run
from tests.support.private_node import free_port

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parents[2]


_FORK_SERVER: dict[str, CliForkServer] = {}
"""The module's fork server (see `tests.support.cli_fork`), while its tests run."""


@pytest.fixture(scope="module", autouse=True)
def _cli_fork_server(cli_fork_server: CliForkServer) -> Iterator[None]:
    _FORK_SERVER["server"] = cli_fork_server
    yield
    del _FORK_SERVER["server"]


async def cli(*args: str, stdin: bytes = b"", url: str | None = None, timeout: float = 120) -> Run:
    """Run ``reliable-mq ARGS`` in a process of its own and capture its exit code and output.

    The process is forked from a server that imported the CLI once (`CliForkServer`):
    a fresh process's pipes, environment and exit status, without a second of start-up.
    """
    env = dict(os.environ)
    env.pop("RELIABLE_MQ_URL", None)
    if url is not None:
        env["RELIABLE_MQ_URL"] = url
    server = _FORK_SERVER["server"]
    return await asyncio.to_thread(
        server.run, list(args), env=env, cwd=ROOT, stdin=stdin, timeout=timeout
    )


class TestPublish:
    async def test_lines_from_stdin_land_in_the_queue(self, broker_url: str, queue: str) -> None:
        """Each non-blank stdin line becomes one confirmed message, in order."""
        lines = [f"line {n} é" for n in range(500)]
        stdin = ("\n".join(lines[:250]) + "\n\n" + "\n".join(lines[250:]) + "\n").encode()
        run = await cli("publish", "--routing-key", queue, stdin=stdin, url=broker_url)
        assert run.code == 0, run.stderr
        assert "confirmed    500" in run.stdout.replace(",", "")
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [m.body.decode() for m in drained] == lines
        assert len({m.message_id for m in drained}) == 500

    async def test_json_lines_from_a_file_with_ids_and_headers(
        self, broker_url: str, queue: str, tmp_path: Path
    ) -> None:
        """--format json sends each value as JSON; --id-field makes the message ids stable."""
        path = tmp_path / "orders.jsonl"
        rows = [{"order_id": n, "total": n * 1.5} for n in range(100)]
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        run = await cli(
            "publish", "-k", queue, "--file", str(path), "--format", "json",
            "--id-field", "order_id", "-H", "source=test", "--progress", "--url", broker_url,
        )  # fmt: skip
        assert run.code == 0, run.stderr
        assert "100%" in run.stderr  # the forced progress bar was drawn
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [json.loads(m.body) for m in drained] == rows
        assert [m.message_id for m in drained] == [str(n) for n in range(100)]
        assert all(m.headers == {"source": "test"} for m in drained)

    async def test_unroutable_and_bad_lines_exit_1(self, broker_url: str, queue: str) -> None:
        """Any message that is not confirmed makes the exit code 1, with a reason per line."""
        run = await cli("publish", "-k", f"{queue}-nobody-bound", stdin=b"a\nb\n", url=broker_url)
        assert run.code == 1
        assert "line 1: PublishUnroutable" in run.stderr
        assert "PublishUnroutable  2" in run.stdout

        run = await cli(
            "publish", "-k", queue, "--format", "json", stdin=b'{"ok": 1}\n{nope\n', url=broker_url
        )
        assert run.code == 1
        assert "invalid JSON" in run.stderr
        drained = await drain_queue(broker_url, queue, settled=True)
        assert [json.loads(m.body) for m in drained] == [{"ok": 1}]


class TestErrors:
    async def test_unreachable_broker_exits_2_without_the_password(self) -> None:
        """A broker nobody listens for: exit 2, one line on stderr, the password redacted."""
        url = f"amqp://guest:Sup3rS3cretPw@127.0.0.1:{free_port()}/"
        for command in (
            ["publish", "-k", "q"],
            ["bench", "--messages", "10"],
            ["consume", "q", "--idle-timeout", "1"],
            ["topology", "q"],
            ["dlq", "list", "q"],
            ["dlq", "move", "q", "--all"],
        ):
            run = await cli(*command, "--url", url, stdin=b"x\n", timeout=60)
            assert run.code == 2, run
            assert "Sup3rS3cretPw" not in run.stderr + run.stdout
            assert run.stderr.count("\n") == 1
            assert run.stderr.startswith("reliable-mq: error: cannot reach the broker")

    async def test_password_from_the_environment_is_hidden_in_help(self) -> None:
        """--help shows the default URL from RELIABLE_MQ_URL without its password."""
        run = await cli("publish", "--help", url="amqp://app:Hidden%Pw@10.0.0.1:5672/")
        assert run.code == 0
        assert "Hidden" not in run.stdout
        assert "10.0.0.1" in run.stdout

    @pytest.mark.parametrize(
        "args",
        [
            [],
            ["nonsense"],
            ["publish"],  # --routing-key is required
            ["publish", "-k", "q", "--window", "0"],
            ["publish", "-k", "q", "--timeout", "-1"],
            ["publish", "-k", "q", "--format", "xml"],
            ["publish", "-k", "q", "--id-field", "id"],  # needs --format json
            ["publish", "-k", "q", "--file", "/nonexistent/input.txt"],
            ["publish", "-k", "q", "--url", "http://127.0.0.1/"],
            ["bench", "--messages", "ten"],
            ["bench", "--size", "-5"],
            ["consume"],  # QUEUE is required
            ["consume", "q", "--ack-mode", "drop"],
            ["consume", "q", "--count", "0"],
            ["consume", "q", "--prefetch", "70000"],
            ["consume", "q", "--idle-timeout", "soon"],
            ["consume", "q", "--output", "/nonexistent/dir/out.txt"],
            ["topology"],
            ["topology", "q", "--retry-delays", "1,x"],
            ["topology", "q", "--retry-delays", "0"],
            ["dlq"],
            ["dlq", "list"],
            ["dlq", "purge", "q"],
            ["dlq", "show", "q"],  # --message-id is required
            ["dlq", "move", "q"],  # --message-id or --all
            ["dlq", "move", "q", "--all", "--message-id", "x"],
        ],
    )
    async def test_bad_arguments_exit_2(self, args: list[str]) -> None:
        """Bad arguments exit 2 with a message on stderr, before touching the broker."""
        run = await cli(*args)
        assert run.code == 2, run
        assert run.stderr.strip()

    @pytest.mark.parametrize(
        "command",
        [
            [],
            ["publish"],
            ["bench"],
            ["consume"],
            ["topology"],
            ["dlq"],
            ["dlq", "list"],
            ["dlq", "show"],
            ["dlq", "move"],
        ],
    )
    async def test_help_everywhere(self, command: list[str]) -> None:
        """Every level answers --help with exit code 0."""
        run = await cli(*command, "--help")
        assert run.code == 0
        assert run.stdout.startswith("usage: reliable-mq")


class TestBench:
    async def test_bench_publishes_and_prints_a_summary(self, broker_url: str) -> None:
        """bench --messages 2000 confirms all of them and prints the summary table."""
        run = await cli("bench", "--messages", "2000", "--size", "100", "--window", "200",
                        "--progress", url=broker_url)  # fmt: skip
        assert run.code == 0, run.stderr
        table = dict(
            line.split(None, 1) if "  " not in line else line.split("  ", 1)
            for line in run.stdout.splitlines()
        )
        assert table["confirmed"].strip() == "2,000"
        assert table["failed"].strip() == "0"
        assert table["window"].strip() == "200"
        assert "msg/s" in table["throughput"]
        assert "100%" in run.stderr
        assert "(deleted)" in run.stdout

    async def test_bench_into_a_named_queue_keeps_it(self, broker_url: str, queue: str) -> None:
        """With --queue the messages stay there for inspection."""
        run = await cli("bench", "-n", "50", "--queue", queue, "--no-persistent", url=broker_url)
        assert run.code == 0, run.stderr
        drained = await drain_queue(broker_url, queue, settled=True)
        assert len(drained) == 50


@pytest.fixture(name="topology")
async def _topology(broker_url: str) -> AsyncIterator[QueueTopology]:
    """A fresh work queue with retry queues (0.2 s, 0.5 s) and a DLQ, deleted after."""
    topology = QueueTopology(queue=f"test-cli-{uuid.uuid4().hex[:12]}", retry_delays=(0.2, 0.5))
    connection = await aio_pika.connect(broker_url)
    async with connection:
        await declare_topology(await connection.channel(), topology)
        yield topology
        await delete_topology(await connection.channel(), topology)


async def _publish(url: str, queue: str, bodies: list[bytes]) -> list[str]:
    async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
        return [
            (await publisher.publish(body, routing_key=queue, message_id=f"m{n}")).message_id
            for n, body in enumerate(bodies)
        ]


async def _queue_depth(url: str, queue: str) -> int:
    connection = await aio_pika.connect(url)
    async with connection:
        declared = await (await connection.channel()).declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


async def _queue_exists(url: str, queue: str) -> bool:
    """A passive declare on a channel of its own (404 closes it)."""
    connection = await aio_pika.connect(url)
    async with connection:
        try:
            await (await connection.channel()).declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return False
        return True


async def _dead_letter(url: str, topology: QueueTopology) -> None:
    """Publish one poison order and one malformed body; a real consumer dead-letters both."""
    async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
        await publisher.publish({"order_id": 13}, routing_key=topology.queue, message_id="poison")
        await publisher.publish(
            b"{nope", routing_key=topology.queue, message_id="bad", content_type="application/json"
        )
    consumer = ReliableConsumer(
        url,
        settings=ConsumerSettings(max_attempts=2, retry_delays=topology.retry_delays),
        registry=CollectorRegistry(),
    )

    @consumer.handler(topology.queue)
    async def fail(order: dict[str, int]) -> None:
        raise RuntimeError(f"cannot ship order {order['order_id']}")

    async with consumer:
        async with asyncio.timeout(20):
            while consumer.stats().dead_lettered < 2:
                await asyncio.sleep(0.05)


class TestConsume:
    async def test_ack_mode_prints_bodies_and_empties_the_queue(
        self, broker_url: str, queue: str
    ) -> None:
        """Default mode: each body on its own line, in order, and acked."""
        await _publish(broker_url, queue, [f"body {n}".encode() for n in range(20)])
        run = await cli("consume", queue, "--count", "20", url=broker_url)
        assert run.code == 0, run.stderr
        assert run.stdout.splitlines() == [f"body {n}" for n in range(20)]
        assert "20 message(s)" in run.stderr and "acked" in run.stderr
        assert await drain_queue(broker_url, queue) == []

    async def test_count_stops_early_and_returns_prefetched_extras(
        self, broker_url: str, queue: str
    ) -> None:
        """--count 3 acks three; messages prefetched beyond them go back to the queue."""
        await _publish(broker_url, queue, [f"{n}".encode() for n in range(10)])
        run = await cli("consume", queue, "-n", "3", "--prefetch", "10", url=broker_url)
        assert run.code == 0, run.stderr
        assert run.stdout.splitlines() == ["0", "1", "2"]
        rest = await drain_queue(broker_url, queue)
        assert [m.body for m in rest] == [f"{n}".encode() for n in range(3, 10)]

    async def test_requeue_peeks_without_removing(self, broker_url: str, queue: str) -> None:
        """--ack-mode requeue shows the messages once each and leaves all of them queued."""
        ids = await _publish(broker_url, queue, [b"a", b"b", b"c"])
        run = await cli("consume", queue, "--ack-mode", "requeue", "--json", "--idle-timeout",
                        "1", url=broker_url)  # fmt: skip
        assert run.code == 0, run.stderr
        records = [json.loads(line) for line in run.stdout.splitlines()]
        assert [r["message_id"] for r in records] == ids
        assert [r["body"] for r in records] == ["a", "b", "c"]
        assert all(set(r) >= {"message_id", "headers", "body"} for r in records)
        rest = await drain_queue(broker_url, queue)
        assert [m.message_id for m in rest] == ids  # same order, nothing lost

    async def test_reject_dead_letters_and_json_output_to_a_file(
        self, broker_url: str, topology: QueueTopology, tmp_path: Path
    ) -> None:
        """--ack-mode reject with --output: written to the file, then dead-lettered."""
        ids = await _publish(broker_url, topology.queue, [b"x", b"\xff\xfe"])
        out = tmp_path / "dump.jsonl"
        out.write_text('{"earlier": true}\n')
        run = await cli("consume", topology.queue, "--ack-mode", "reject", "--json", "-o",
                        str(out), "--idle-timeout", "1", url=broker_url)  # fmt: skip
        assert run.code == 0, run.stderr
        assert run.stdout == ""
        lines = [json.loads(line) for line in out.read_text().splitlines()]
        assert lines[0] == {"earlier": True}  # appended, never truncated
        assert [r["message_id"] for r in lines[1:]] == ids
        assert lines[2]["body_encoding"] == "base64"
        assert await _queue_depth(broker_url, topology.queue) == 0
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 2

    @pytest.mark.parametrize("queued", [10, 5, 3])
    async def test_head_takes_three_and_the_rest_stays_queued(
        self, broker_url: str, queue: str, queued: int
    ) -> None:
        """`consume Q | head -3` through a real pipe: three shown and acked, exit 141 as
        soon as head is gone (also while waiting for more messages), every other message
        still in the queue. (It used to ack what sat in the pipe buffer unread, and with
        nothing more to write, wait for messages until killed.)"""
        await _publish(broker_url, queue, [f"{n}".encode() for n in range(queued)])
        read_end, write_end = os.pipe()
        head = await asyncio.create_subprocess_exec(
            "head", "-3", stdin=read_end, stdout=asyncio.subprocess.PIPE
        )
        os.close(read_end)
        consume = await _spawn(
            "consume", queue, url=broker_url, stdout=write_end, stderr=asyncio.subprocess.PIPE
        )
        os.close(write_end)
        shown, _ = await asyncio.wait_for(head.communicate(), 30)
        try:
            _, err = await asyncio.wait_for(consume.communicate(), 20)
        except TimeoutError:
            consume.kill()
            await consume.wait()
            pytest.fail("consume did not notice that its reader was gone")
        assert shown.decode().splitlines() == ["0", "1", "2"]
        assert consume.returncode == 141, err
        assert b"Traceback" not in err
        rest = await drain_queue(broker_url, queue)
        assert sorted(int(m.body) for m in rest) == list(range(3, queued))  # none lost

    async def test_a_cut_connection_exits_1_without_showing_twice(
        self, broker_url: str, queue: str, proxy: TCPProxy
    ) -> None:
        """The connection drops mid-run: exit 1 with a one-line reason, and the command
        does not go on on a new channel (it would show the unsettled messages again)."""
        await _publish(broker_url, queue, [b"first"])
        consume = await _spawn(
            "consume", queue, url=proxied_url(proxy), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert consume.stdout is not None
        line = await asyncio.wait_for(consume.stdout.readline(), 30)
        assert line == b"first\n"
        await proxy.cut()
        await _publish(broker_url, queue, [b"second"])
        out, err = await asyncio.wait_for(consume.communicate(), 30)
        assert consume.returncode == 1, err
        assert b"the channel to the broker closed" in err and b"Traceback" not in err
        assert out == b""  # nothing shown after the cut
        rest = [m.body for m in await drain_queue(broker_url, queue)]
        assert rest in ([b"second"], [b"first", b"second"])  # "first" again if its ack was cut

    async def test_missing_queue_exits_1(self, broker_url: str) -> None:
        """A queue that does not exist: exit 1 and a one-line reason."""
        run = await cli("consume", f"missing-{uuid.uuid4().hex}", "--idle-timeout", "1",
                        url=broker_url)  # fmt: skip
        assert run.code == 1
        assert "does not exist" in run.stderr


class TestTopology:
    async def test_declare_then_delete(self, broker_url: str) -> None:
        """topology declares work, retry and dead-letter queues; --delete removes them."""
        name = f"test-cli-topo-{uuid.uuid4().hex[:8]}"
        expected = QueueTopology(queue=name, retry_delays=(1.0, 5.0)).all_queues
        run = await cli("topology", name, "--retry-delays", "1,5", url=broker_url)
        try:
            assert run.code == 0, run.stderr
            for queue in expected:
                assert queue in run.stdout
                assert await _queue_depth(broker_url, queue) == 0
            again = await cli("topology", name, "--retry-delays", "1,5", url=broker_url)
            assert again.code == 0, again.stderr  # idempotent
            other = await cli("topology", name, "--quorum", "--retry-delays", "1,5",
                              url=broker_url)  # fmt: skip
            assert other.code == 1
            assert "other arguments" in other.stderr
            await _publish(broker_url, name, [b"keep me"])
            refused = await cli("topology", name, "--retry-delays", "1,5", "--delete",
                                url=broker_url)  # fmt: skip
            assert refused.code == 1
            assert "hold messages" in refused.stderr
            assert await _queue_depth(broker_url, name) == 1
            wrong = await cli("topology", name, "--delete", "--force", url=broker_url)
            assert wrong.code == 1  # other retry delays: nothing deleted
            assert await _queue_depth(broker_url, name) == 1
        finally:
            run = await cli("topology", name, "--retry-delays", "1,5", "--delete", "--force",
                            url=broker_url)  # fmt: skip
        assert run.code == 0, run.stderr
        assert run.stdout.count("deleted,") == len(expected)
        gone = await cli("topology", name, "--retry-delays", "1,5", "--delete", url=broker_url)
        assert gone.code == 1

    async def test_other_delays_on_an_existing_set_exit_1_and_declare_nothing(
        self, broker_url: str
    ) -> None:
        """Issue 19: 2,7 (or 1,5,30,60, or another DLQ) on a 1/5/30 set: exit 1, nothing new.

        --force declares the missing queues next to the old ones.
        """
        name = f"test-cli-delays-{uuid.uuid4().hex[:8]}"
        old = QueueTopology(queue=name, retry_delays=(1.0, 5.0, 30.0))
        new = QueueTopology(queue=name, retry_delays=(2.0, 7.0))
        assert (await cli("topology", name, "--retry-delays", "1,5,30", url=broker_url)).code == 0
        try:
            run = await cli("topology", name, "--retry-delays", "2,7", url=broker_url)
            assert run.code == 1, run
            assert f"{name}.retry.2s, {name}.retry.7s do(es) not" in run.stderr
            assert f"{name}.dlq exist(s)" in run.stderr
            assert "other --retry-delays" in run.stderr
            assert run.stdout == ""
            for queue in new.retry_queues:
                assert await _queue_exists(broker_url, queue) is False
            longer = await cli("topology", name, "--retry-delays", "1,5,30,60", url=broker_url)
            assert longer.code == 1, longer
            assert f"{name}.retry.60s do(es) not" in longer.stderr
            assert await _queue_exists(broker_url, f"{name}.retry.60s") is False
            other_dlq = await cli(
                "topology", name, "--retry-delays", "1,5,30", "--dlq", f"{name}.dead",
                url=broker_url,
            )  # fmt: skip
            assert other_dlq.code == 1, other_dlq
            assert await _queue_exists(broker_url, f"{name}.dead") is False
            forced = await cli("topology", name, "--retry-delays", "2,7", "--force", url=broker_url)
            assert forced.code == 0, forced
            for queue in (*old.all_queues, *new.all_queues):
                assert await _queue_exists(broker_url, queue), queue
        finally:
            for topology in (old, new):
                await cli("topology", name, "--retry-delays",
                          ",".join(f"{d:g}" for d in topology.retry_delays),
                          "--delete", "--ignore-missing", url=broker_url)  # fmt: skip
        for queue in (*old.all_queues, *new.all_queues):
            assert await _queue_exists(broker_url, queue) is False

    async def test_quorum_topology(self, broker_url: str) -> None:
        """--quorum declares quorum queues (and deletes them again)."""
        name = f"test-cli-quorum-{uuid.uuid4().hex[:8]}"
        run = await cli("topology", name, "--quorum", "--retry-delays", "2", url=broker_url)
        try:
            assert run.code == 0, run.stderr
            assert "quorum" in run.stdout
        finally:
            deleted = await cli("topology", name, "--quorum", "--retry-delays", "2",
                                "--delete", url=broker_url)  # fmt: skip
        assert deleted.code == 0, deleted.stderr

    async def test_stream_topology(self, broker_url: str) -> None:
        """--stream declares a stream with its retention (again: a no-op); queue-set flags and
        retention without --stream are refused."""
        name = f"test-cli-stream-{uuid.uuid4().hex[:8]}"
        args = ("topology", "--stream", name, "--max-length-bytes", "1000000", "--max-age", "7D")
        try:
            run = await cli(*args, url=broker_url)
            assert run.code == 0, run.stderr
            assert f"declared stream {name}" in run.stdout
            assert "x-max-age" in run.stdout and "1000000" in run.stdout
            again = await cli(*args, url=broker_url)
            assert again.code == 0, again.stderr
            other = await cli("topology", "--stream", name, url=broker_url)
            assert other.code == 1 and "x-max-length-bytes" in other.stderr
            async with StreamReader(broker_url, name) as reader:  # a stream: not refused
                assert await reader.tail() == 0
        finally:
            connection = await aio_pika.connect(broker_url)
            async with connection:
                await (await connection.channel()).queue_delete(name)
        refused = await cli("topology", "--stream", name, "--quorum", url=broker_url)
        assert refused.code == 1 and "do not apply" in refused.stderr
        needs = await cli("topology", name, "--max-age", "7D", url=broker_url)
        assert needs.code == 1 and "need --stream" in needs.stderr


class TestDlq:
    async def test_list_and_show_leave_messages_in_place(
        self, broker_url: str, topology: QueueTopology
    ) -> None:
        """list summarizes reasons, show prints one in full; the DLQ keeps both."""
        await _dead_letter(broker_url, topology)
        run = await cli("dlq", "list", topology.queue, url=broker_url)
        assert run.code == 0, run.stderr
        assert f"{topology.dead_letter_queue}: 2 message(s)" in run.stdout
        assert "max_attempts" in run.stdout and "invalid_body" in run.stdout
        assert "RuntimeError: cannot ship order 13" in run.stdout

        listed = await cli("dlq", "list", topology.queue, "--json", url=broker_url)
        records = {json.loads(line)["message_id"]: json.loads(line) for line in
                   listed.stdout.splitlines()}  # fmt: skip
        assert set(records) == {"poison", "bad"}
        assert records["poison"]["dead_letter"]["attempts"] == "2"

        show = await cli("dlq", "show", topology.queue, "--message-id", "poison", url=broker_url)
        assert show.code == 0, show.stderr
        shown = json.loads(show.stdout)
        assert json.loads(shown["body"]) == {"order_id": 13}
        assert shown["headers"]["x-reliable-mq-reason"] == "max_attempts"
        assert shown["headers"]["x-reliable-mq-queue"] == topology.queue

        missing = await cli("dlq", "show", topology.queue, "--message-id", "nope", url=broker_url)
        assert missing.code == 1
        assert "no message with message_id 'nope'" in missing.stderr
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 2

    async def test_move_one_then_all_back_with_attempts_reset(
        self, broker_url: str, topology: QueueTopology
    ) -> None:
        """move sends messages back to their queue without attempt or reason headers."""
        await _dead_letter(broker_url, topology)
        run = await cli("dlq", "move", topology.queue, "--message-id", "poison", url=broker_url)
        assert run.code == 0, run.stderr
        assert f"moved poison to {topology.queue}" in run.stdout
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 1

        again = await cli("dlq", "move", topology.queue, "--message-id", "poison", url=broker_url)
        assert again.code == 1  # no longer there

        run = await cli("dlq", "move", topology.queue, "--all", url=broker_url)
        assert run.code == 0, run.stderr
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 0
        back = await drain_queue(broker_url, topology.queue)
        assert sorted(m.message_id or "" for m in back) == ["bad", "poison"]
        for message in back:
            assert not any(
                key.startswith("x-reliable-mq-")
                and key
                not in (
                    "x-reliable-mq-moved-from",
                    "x-reliable-mq-original-exchange",
                    "x-reliable-mq-original-routing-key",
                    "x-reliable-mq-no-content-type",
                )
                for key in message.headers
            ), message.headers
            assert message.headers["x-reliable-mq-moved-from"] == topology.dead_letter_queue
        assert {m.message_id: m.body for m in back}["bad"] == b"{nope"

    async def test_move_to_a_missing_queue_keeps_the_message(
        self, broker_url: str, topology: QueueTopology
    ) -> None:
        """A target queue that does not exist: exit 1 and the message stays in the DLQ."""
        await _publish(broker_url, topology.dead_letter_queue, [b"orphan"])
        run = await cli("dlq", "move", topology.queue, "--all", "--to",
                        f"missing-{uuid.uuid4().hex}", url=broker_url)  # fmt: skip
        assert run.code == 1
        assert "does not exist" in run.stderr
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 1

    async def test_missing_dlq_exits_1(self, broker_url: str) -> None:
        run = await cli("dlq", "list", f"missing-{uuid.uuid4().hex}", url=broker_url)
        assert run.code == 1
        assert "dead-letter queue" in run.stderr and "does not exist" in run.stderr


_STOPS = [(signal.SIGINT, 130), (signal.SIGTERM, 143)]
"""The signals that stop a command that does a job, with the documented exit codes."""


def _env(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["RELIABLE_MQ_URL"] = url
    return env


async def _spawn(*args: str, url: str, **kwargs: object) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, "-m", "reliable_mq.cli", *args, cwd=ROOT, env=_env(url), **kwargs
    )  # type: ignore[arg-type]


async def _hostile_dead_letter(url: str, topology: QueueTopology) -> None:
    """A dead letter whose id, reason and body carry terminal escapes and newlines."""
    async with ReliablePublisher(url, registry=CollectorRegistry()) as publisher:
        await publisher.publish(
            b"body\x1b[2J\nline2",
            routing_key=topology.dead_letter_queue,
            message_id="evil\x1b]0;pwned\x07id",
            headers={
                "x-reliable-mq-reason": "rejected\x1b[31m",
                "x-reliable-mq-error-type": "Reject",
                "x-reliable-mq-error-message": "bad\nnews\u202e",
            },
        )


class TestEdges:
    """The first-hour edges of issue 11 and the escaping of issue 10 item 6."""

    async def test_broken_pipe_ends_quietly(self, broker_url: str, topology: QueueTopology) -> None:
        """`dlq list Q | head` where head is gone: exit 141, no traceback, the DLQ untouched."""
        await _publish(broker_url, topology.dead_letter_queue, [b"x"] * 50)
        read_end, write_end = os.pipe()
        os.close(read_end)  # the reader is gone before the first write: EPIPE for sure
        process = await _spawn(
            "dlq", "list", topology.queue, url=broker_url, stdout=write_end,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        os.close(write_end)
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 141, err
        assert b"Traceback" not in err and b"BrokenPipe" not in err
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 50

    async def test_dlq_of_a_dlq_gets_a_hint(self, broker_url: str, topology: QueueTopology) -> None:
        run = await cli("dlq", "list", topology.dead_letter_queue, url=broker_url)
        assert run.code == 1
        assert f"try `reliable-mq dlq list {topology.queue}`" in run.stderr

    async def test_missing_queue_summary_counts_the_rest_and_hints(self, broker_url: str) -> None:
        """15 unroutable lines: 10 shown, '5 more', and the topology command as the fix."""
        name = f"nobody-{uuid.uuid4().hex[:8]}"
        run = await cli("publish", "-k", name, stdin=b"x\n" * 15, url=broker_url)
        assert run.code == 1
        assert run.stderr.count("PublishUnroutable") == 10
        assert "and 5 more failure(s) not shown" in run.stderr
        assert f"`reliable-mq topology {name}`" in run.stderr
        assert "PublishUnroutable  15" in run.stdout

    @pytest.mark.parametrize(("sig", "code"), _STOPS, ids=["SIGINT", "SIGTERM"])
    async def test_a_signal_stops_publish_with_a_partial_summary(
        self, broker_url: str, queue: str, sig: signal.Signals, code: int
    ) -> None:
        """Input still open, 100 lines confirmed: the signal prints the summary; 130 or 143."""
        process = await _spawn(
            "publish", "-k", queue, url=broker_url, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdin is not None
        process.stdin.write(b"".join(b"line %d\n" % n for n in range(100)))
        await process.stdin.drain()
        async with asyncio.timeout(60):
            while await _queue_depth(broker_url, queue) < 100:
                await asyncio.sleep(0.05)
        process.send_signal(sig)
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == code, err
        summary = out.decode().replace(",", "")
        assert "read         100" in summary and "confirmed    100" in summary
        assert "interrupted" in summary
        assert b"Traceback" not in err

    @pytest.mark.parametrize(("sig", "code"), _STOPS, ids=["SIGINT", "SIGTERM"])
    async def test_a_signal_stops_consume_with_a_partial_summary(
        self, broker_url: str, queue: str, sig: signal.Signals, code: int
    ) -> None:
        """consume without --count or --idle-timeout: a signal after 20 messages; 130 or 143."""
        await _publish(broker_url, queue, [b"m%d" % n for n in range(20)])
        process = await _spawn(
            "consume", queue, url=broker_url, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stdout is not None
        lines = [await asyncio.wait_for(process.stdout.readline(), 60) for _ in range(20)]
        assert lines[-1] == b"m19\n"
        await asyncio.sleep(0.2)  # the acks of the written batch go out
        process.send_signal(sig)
        _, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == code, err
        assert b"20 message(s)" in err and b"interrupted" in err
        assert await _queue_depth(broker_url, queue) == 0

    async def test_consume_into_head_ends_quietly(self, broker_url: str, queue: str) -> None:
        """`consume Q | head -1`: head leaves after one line; exit 141, the unwritten stay queued.

        2,000 bodies of 200 bytes are more than a pipe holds, so consume is still
        writing when head goes away. Exactly the messages its summary reports as
        acked (whole batches written before the pipe broke; possibly none) left
        the queue; the batch being written when it broke went back.
        """
        total = 2_000
        async with ReliablePublisher(broker_url, registry=CollectorRegistry()) as publisher:
            await publisher.publish_many(
                Message(b"%04d" % n + b"x" * 196, routing_key=queue) for n in range(total)
            )
        script = (
            f"{sys.executable} -m reliable_mq.cli consume {queue} | head -1; "
            'echo "consume=${PIPESTATUS[0]}" >&2'
        )
        process = await asyncio.create_subprocess_exec(
            "bash", "-c", script, cwd=ROOT, env=_env(broker_url),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert out.startswith(b"0000x") and out.count(b"\n") == 1
        assert err.decode().strip().endswith("consume=141"), err
        assert b"Traceback" not in err and b"BrokenPipe" not in err
        acked = re.search(rb"reliable-mq: ([\d,]+) message\(s\) .* written and acked", err)
        assert acked is not None, err
        taken = int(acked.group(1).replace(b",", b""))
        assert taken < total
        assert await _queue_depth(broker_url, queue) == total - taken

    @pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
    async def test_outbox_relay_stops_cleanly_on_a_signal(
        self, broker_url: str, tmp_path: Path, sig: signal.Signals
    ) -> None:
        """The relay is a service: SIGTERM or SIGINT drains it and it exits 0, like `run`."""
        database = str(tmp_path / "outbox.db")
        assert (await cli("outbox", "init", "--dsn", database)).code == 0
        process = await _spawn(
            "outbox", "relay", "--dsn", database, "--log-level", "INFO", url=broker_url,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert process.stderr is not None
        async with asyncio.timeout(60):
            while b"outbox_relay_started" not in await process.stderr.readline():
                assert process.returncode is None
        process.send_signal(sig)
        out, err = await asyncio.wait_for(process.communicate(), 60)
        assert process.returncode == 0, err
        assert "dispatched" in out.decode()

    async def test_log_json_is_pure_json_lines(self, broker_url: str, queue: str) -> None:
        """Every stderr line is JSON, aio-pika's and aiormq's own records and the report too."""
        await _publish(broker_url, queue, [b"one"])
        run = await cli(
            "consume", queue, "--count", "1", "--log-json", "--log-level", "DEBUG", url=broker_url
        )
        assert run.code == 0, run.stderr
        records = [json.loads(line) for line in run.stderr.splitlines()]
        loggers = {record.get("logger", "") for record in records}
        assert any(name.startswith(("aiormq", "aio_pika")) for name in loggers), loggers
        assert any(record["event"] == "cli_report" for record in records)
        assert run.stdout == "one\n"

    async def test_message_data_is_escaped(self, broker_url: str, topology: QueueTopology) -> None:
        """Ids, reasons, errors and bodies never reach the terminal with raw control characters."""
        await _hostile_dead_letter(broker_url, topology)
        outputs = [
            await cli("dlq", "list", topology.queue, url=broker_url),
            await cli("dlq", "list", topology.queue, "--json", url=broker_url),
            await cli("dlq", "show", topology.queue, "--message-id", "evil\x1b]0;pwned\x07id",
                      url=broker_url),
            await cli("consume", topology.dead_letter_queue, "--count", "1", "--ack-mode",
                      "requeue", url=broker_url),
            await cli("consume", topology.dead_letter_queue, "--count", "1", "--ack-mode",
                      "requeue", "--json", url=broker_url),
        ]  # fmt: skip
        for run in outputs:
            assert run.code == 0, run.stderr
            text = run.stdout + run.stderr
            assert not any(ch in text for ch in "\x1b\x07\u202e"), repr(text)
        listing = outputs[0].stdout
        assert "evil\\x1b]0;pwned\\x07id" in listing and "rejected\\x1b[31m" in listing
        assert outputs[3].stdout == "body\\x1b[2J\\nline2\n"
        assert json.loads(outputs[4].stdout)["body"] == "body\x1b[2J\nline2"  # exact, escaped

    async def test_strings_not_utf8_are_shown_escaped(
        self, broker_url: str, topology: QueueTopology
    ) -> None:
        """A message id and a header name that are not UTF-8 (from another client; the
        broker dead-lettered it as is): listed and consumed escaped, not a broker error."""
        connection = await aio_pika.connect(broker_url)
        async with connection:
            channel = await connection.channel()
            message = aio_pika.Message(b"x", message_id=f"id-{MARK}", headers={MARK: 1})
            with hostile_frames():
                await channel.default_exchange.publish(
                    message, routing_key=topology.dead_letter_queue
                )
        listed = await cli("dlq", "list", topology.queue, url=broker_url)
        consumed = await cli("consume", topology.dead_letter_queue, "--count", "1", "--json",
                             url=broker_url)  # fmt: skip
        assert listed.code == 0 and consumed.code == 0, listed.stderr + consumed.stderr
        assert f"id-{ESCAPED}" in listed.stdout
        record = json.loads(consumed.stdout)
        assert record["message_id"] == f"id-{ESCAPED}"
        assert record["headers"] == {ESCAPED: 1}
        assert await _queue_depth(broker_url, topology.dead_letter_queue) == 0

    async def test_topology_on_an_existing_plain_queue(self, broker_url: str, queue: str) -> None:
        """A durable queue made elsewhere: side queues declared, the queue kept, a correct note."""
        topology = QueueTopology(queue, retry_delays=(1.0,))
        try:
            run = await cli("topology", queue, "--retry-delays", "1", url=broker_url)
            assert run.code == 0, run.stderr
            assert "used as it is" in run.stdout
            assert "no dead-letter exchange" in run.stderr
            assert "rabbitmqctl set_policy" in run.stderr
            assert await _queue_depth(broker_url, topology.dead_letter_queue) == 0
        finally:
            connection = await aio_pika.connect(broker_url)
            async with connection:
                channel = await connection.channel()
                for name in topology.side_queues:
                    await channel.queue_delete(name)


class TestEventLoop:
    def test_uvloop_is_used_when_installed(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """The CLI picks uvloop's loop if it is importable, and asyncio's on request."""
        import uvloop

        from reliable_mq.cli import loop_factory

        assert loop_factory() is uvloop.new_event_loop
        monkeypatch.setenv("RELIABLE_MQ_NO_UVLOOP", "1")
        assert loop_factory() is None

    async def test_a_command_runs_on_uvloop(self, broker_url: str, queue: str) -> None:
        """A real publish through the CLI runs on uvloop and confirms every line."""
        run = await cli(
            "publish", "-k", queue, "--log-json", "--log-level", "DEBUG",
            stdin=b"a\nb\n", url=broker_url,
        )  # fmt: skip
        assert run.code == 0, run.stderr
        events = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
        assert {"event": "event_loop", "loop": "uvloop"}.items() <= next(
            e for e in events if e.get("event") == "event_loop"
        ).items()
        assert len(await drain_queue(broker_url, queue, settled=True)) == 2
