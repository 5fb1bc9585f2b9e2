"""Shared fixtures: the real broker, per-test queues, fresh metric registries.

Under CI (``CI=true``) a missing broker fails the run; on a laptop without one
the broker tests skip, and say so.

Hypothesis: under CI every property test runs a fixed set of examples (the
``ci`` profile, ``derandomize``), so a CI run can be repeated exactly; anywhere
else each run draws new ones (and ``FUZZ_RANDOM=1`` makes the fuzz tier explore
too). A counterexample found while exploring becomes an ``@example``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import aio_pika
import pytest
import structlog
from hypothesis import settings
from prometheus_client import CollectorRegistry

from reliable_mq.testing import TCPProxy
from tests.support.amqp import wait_for_amqp_sync

if TYPE_CHECKING:
    from tests.support.private_node import PrivateBroker

pytest_plugins = [
    "tests.support.spark",  # the shared SparkSession (spark, spark_queue)
    "tests.support.cli_fork",  # the CLI's fork server (cli_fork_server)
]

settings.register_profile("ci", derandomize=True, database=None, print_blob=True)
if os.environ.get("CI") and not os.environ.get("FUZZ_RANDOM"):
    settings.load_profile("ci")

BROKER_URL = os.environ.get("RELIABLE_MQ_TEST_URL", "amqp://guest:guest@127.0.0.1:5672/")
BROKER_PORT = 5672


@pytest.fixture(autouse=True)
def _structlog_left_as_found() -> Iterator[None]:
    """A test that configures structlog (``capture_logs()`` does) must not leak it."""
    configured = structlog.is_configured()
    yield
    if structlog.is_configured() and not configured:
        structlog.reset_defaults()


@pytest.fixture(autouse=True)
def _fast_path_where_tested(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A test of a protection only the fast path has (``@pytest.mark.fast_path``) runs on
    the fast path, even in CI's plain-path run (``RELIABLE_MQ_FAST_PATH=off``)."""
    if request.node.get_closest_marker("fast_path") is not None:
        monkeypatch.setenv("RELIABLE_MQ_FAST_PATH", "auto")


@pytest.fixture(scope="session")
def broker_url() -> str:
    """The shared broker's URL, after a real AMQP handshake succeeded."""
    try:
        wait_for_amqp_sync(BROKER_URL, timeout=20)
    except Exception as exc:
        message = f"RabbitMQ is not reachable at 127.0.0.1:{BROKER_PORT}: {exc}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return BROKER_URL


@pytest.fixture
async def amqp(broker_url: str) -> AsyncIterator[aio_pika.abc.AbstractChannel]:
    """A plain aio-pika channel for test set-up and inspection."""
    connection = await aio_pika.connect(broker_url)
    async with connection:
        yield await connection.channel()


@pytest.fixture
async def queue(amqp: aio_pika.abc.AbstractChannel) -> AsyncIterator[str]:
    """A fresh durable queue, deleted after the test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    declared = await amqp.declare_queue(name, durable=True)
    yield name
    await declared.delete(if_unused=False, if_empty=False)


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
async def proxy(broker_url: str) -> AsyncIterator[TCPProxy]:
    """A TCP proxy in front of the shared broker, for cutting connections."""
    async with TCPProxy("127.0.0.1", BROKER_PORT) as running:
        yield running


def proxied_url(proxy: TCPProxy) -> str:
    return f"amqp://guest:guest@127.0.0.1:{proxy.port}/"


@pytest.fixture(scope="session")
def private_node_session() -> Iterator[PrivateBroker]:
    """The run's one private RabbitMQ node (own ports, data and cookie), started once.

    A start costs about 8 s (far more on a loaded machine): one per module that
    asked for it added up. Every test names its own queues, so tests share it;
    `private_broker` starts it again if an earlier test left it down.
    """
    from tests.support.private_node import running_private_node

    with running_private_node("rtest") as node:
        yield node


@pytest.fixture
def private_broker(private_node_session: PrivateBroker) -> PrivateBroker:
    """A private RabbitMQ node that tests may kill or restart: the session's, running."""
    if not private_node_session.is_running():
        private_node_session.start()
    return private_node_session
