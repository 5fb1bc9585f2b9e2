"""Slow tier: a 3-node cluster of private nodes, a quorum queue, kill -9 the leader.

The publisher and the consumer get all three addresses (comma separated) and
fail over. First the node the publisher is connected to is killed and started
again, then the queue's current leader; the stream goes on throughout and the
oracle must come out clean.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from reliable_mq.topology import QueueType
from tests.faults.harness import Faults, check, run_stream, wait_for
from tests.support.private_node import PrivateBroker, find_rabbitmq_sbin, free_port

pytestmark = [pytest.mark.private_broker, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster() -> Iterator[list[PrivateBroker]]:
    """Three clustered private nodes sharing one Erlang cookie (about 40 s to form)."""
    if find_rabbitmq_sbin() is None:
        pytest.skip("RabbitMQ is not installed")
    root = Path(tempfile.mkdtemp(prefix="rmq-cluster-"))
    cookie = secrets.token_hex(16).upper()
    tag = f"{os.getpid()}{uuid.uuid4().hex[:4]}"
    nodes: list[PrivateBroker] = []
    try:
        for n in (1, 2, 3):
            home = root / f"c{n}" / "home"
            home.mkdir(parents=True)
            (home / ".erlang.cookie").write_text(cookie)  # PrivateBroker keeps an existing one
            nodes.append(
                PrivateBroker(
                    root / f"c{n}",
                    node_name=f"c{n}x{tag}@localhost",
                    amqp_port=free_port(),
                    dist_port=free_port(),
                    mgmt_port=free_port(),
                )
            )
        with ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda node: node.start(), nodes))
        for node in nodes[1:]:
            node.rabbitmqctl("stop_app")
            node.rabbitmqctl("join_cluster", nodes[0].node_name)
            node.rabbitmqctl("start_app")
        status = nodes[0].rabbitmqctl("cluster_status")
        assert all(node.node_name in status for node in nodes), status
        yield nodes
    finally:
        for node in nodes:
            node.cleanup()
        shutil.rmtree(root, ignore_errors=True)


def leader_of(nodes: list[PrivateBroker], queue: str) -> PrivateBroker:
    """The node leading ``queue`` (asked of any running node)."""
    for asker in nodes:
        if not asker.is_running():
            continue
        out = asker.rabbitmqctl("list_queues", "name", "leader", "--quiet", "--no-table-headers")
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[0] == queue:
                return next(node for node in nodes if node.node_name == parts[1])
    raise AssertionError(f"no leader found for {queue}")


class TestCluster:
    async def test_quorum_leader_and_connected_node_killed(
        self, cluster: list[PrivateBroker]
    ) -> None:
        """kill -9 the publisher's node, then the quorum leader: failover, clean oracle."""
        urls = [node.url for node in cluster]
        killed: list[str] = []
        failover_confirms: list[int] = []

        async def crash(ctx: Faults, node: PrivateBroker) -> None:
            await asyncio.to_thread(node.kill)
            ctx.scenario.faults += 1
            killed.append(node.node_name)
            before = ctx.publisher.stats().confirmed
            # Failed over and publishing again (bounded, so a stuck queue fails the oracle
            # checks below instead of hanging the suite).
            await wait_for(lambda: ctx.publisher.stats().confirmed >= before + 1000, 60)
            failover_confirms.append(ctx.publisher.stats().confirmed - before)
            await asyncio.to_thread(node.start, 120)
            await asyncio.sleep(2)  # let it rejoin the quorum before the next kill

        async def faults(ctx: Faults) -> None:
            while ctx.publisher.stats().confirmed < 1500:
                await asyncio.sleep(0.01)
            port = ctx.publisher._supervisor._current_address().url.port
            await crash(ctx, next(node for node in cluster if node.amqp_port == port))
            await crash(ctx, leader_of(cluster, ctx.queue))
            ctx.enough.set()

        run = await run_stream(
            "cluster failover",
            cluster[0].url,
            faults=faults,
            publisher_urls=urls,
            consumer_url=[urls[1], urls[2], urls[0]],
            min_messages=6000,
            queue_type=QueueType.QUORUM,
            timeout=120,
        )
        assert all(n >= 1000 for n in failover_confirms), (
            f"confirms within 60 s after each kill: {failover_confirms} (killed {killed})"
        )
        check(run)
        assert run.scenario.faults == 2, killed
        assert run.publisher_stats.channel_generation >= 2
