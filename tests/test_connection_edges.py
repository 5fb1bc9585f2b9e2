"""Issue 19, item 10: connection failures the user reads, against the shared broker.

* A vhost that does not exist is named (``BrokerUnavailable``: ``vhost 'x' not
  found, or access to it refused``), not aiormq's ``InvalidFrameError:
  Expected one of ['Connection.OpenOk'], got <Connection.Close ...>``: for the
  publisher, the consumer, the blocking publisher and the CLI.
* A publisher pointed at a dead port raises its typed error and prints
  nothing else: aiormq's ``error when creating transport`` record is dropped
  for our own connect attempts only.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from yarl import URL

from reliable_mq import BrokerUnavailable, ReliableConsumer, ReliablePublisher
from reliable_mq.sync import BlockingPublisher
from tests.support.cli_fork import CliForkServer
from tests.support.private_node import free_port

pytestmark = pytest.mark.rabbitmq

ROOT = Path(__file__).resolve().parent.parent


def _in_vhost(broker_url: str, vhost: str) -> str:
    return str(URL(broker_url).with_path("/" + vhost.replace("/", "%2F"), encoded=True))


def _named(text: str, vhost: str) -> None:
    assert f"vhost {vhost!r} not found, or access to it refused" in text, text
    assert "InvalidFrameError" not in text and "Connection.OpenOk" not in text, text


class TestMissingVhost:
    async def test_publisher_and_consumer_name_the_vhost(self, broker_url: str) -> None:
        """Both raise BrokerUnavailable naming the vhost, at once (no retry loop)."""
        vhost = f"no-such-vhost-{uuid.uuid4().hex[:8]}"
        url = _in_vhost(broker_url, vhost)
        with pytest.raises(BrokerUnavailable) as caught:
            async with ReliablePublisher(url, registry=CollectorRegistry()):
                pass
        _named(str(caught.value), vhost)
        consumer = ReliableConsumer(url, registry=CollectorRegistry())

        @consumer.handler("q")
        async def handle(body: bytes) -> None:
            """Never called."""

        with pytest.raises(BrokerUnavailable) as caught:
            await asyncio.wait_for(consumer.run(), 20)
        _named(str(caught.value), vhost)

    def test_blocking_publisher_names_the_vhost(self, broker_url: str) -> None:
        """An encoded slash in the path is the vhost's own slash, as aiormq reads it."""
        vhost = f"no/such-{uuid.uuid4().hex[:8]}"
        with (
            pytest.raises(BrokerUnavailable) as caught,
            BlockingPublisher(_in_vhost(broker_url, vhost)),
        ):
            pass
        _named(str(caught.value), vhost)

    @pytest.mark.parametrize(
        "command",
        [["topology", "q"], ["consume", "q", "--idle-timeout", "1"], ["dlq", "list", "q"]],
    )
    def test_cli_names_the_vhost(
        self, broker_url: str, command: list[str], cli_fork_server: CliForkServer
    ) -> None:
        """One line on stderr naming the vhost, exit 2, the password not shown."""
        vhost = f"no-such-vhost-{uuid.uuid4().hex[:8]}"
        run = cli_fork_server.run(
            command,
            env={**os.environ, "RELIABLE_MQ_URL": _in_vhost(broker_url, vhost)},
            cwd=ROOT,
            stdin=b"",
            timeout=60,
        )
        assert run.code == 2, run
        assert run.stderr.count("\n") == 1, run.stderr
        _named(run.stderr, vhost)
        assert ":guest@" not in run.stderr


_DEAD_PORT = """
    import asyncio, logging, sys
    import aiormq
    from reliable_mq import BrokerUnavailable, ReliablePublisher
    from reliable_mq.sync import BlockingPublisher

    url = sys.argv[1]
    try:
        with BlockingPublisher(url) as publisher:
            publisher.publish(b"x", routing_key="q")
    except BrokerUnavailable as exc:
        print("blocking:", type(exc).__name__)

    async def main() -> None:
        try:
            async with ReliablePublisher(url):
                pass
        except BrokerUnavailable as exc:
            print("async:", type(exc).__name__)
        if sys.argv[2] == "also-aiormq":
            try:
                await aiormq.connect(url)  # not ours: its record must stay
            except Exception:
                print("aiormq: raised")

    asyncio.run(main())
"""


class TestDeadPort:
    @pytest.mark.parametrize("others", ["only-ours", "also-aiormq"])
    def test_nothing_but_the_typed_error(self, others: str) -> None:
        """No logging configured: stdout has the typed errors, stderr only what aiormq's own
        connect logs (our attempts add nothing)."""
        url = f"amqp://guest:guest@127.0.0.1:{free_port()}/"
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(_DEAD_PORT), url, others],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
            check=False,
        )
        assert run.returncode == 0, run
        assert run.stdout.splitlines()[:2] == [
            "blocking: BrokerUnavailable",
            "async: BrokerUnavailable",
        ]
        if others == "only-ours":
            assert run.stderr == ""
        else:
            assert run.stderr.count("error when creating transport") == 1, run.stderr
