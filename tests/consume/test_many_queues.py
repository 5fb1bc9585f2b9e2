"""One consumer, many queues: batched acks of every channel leave on the one timer.

Against the shared broker, through a TCP proxy: the connection is cut once the
acks should all have been written (``ack_flush_interval`` and some slack after
the last handler returned). The broker requeues whatever it still holds
unacked and delivers it again on the new channels, so an ack that was not
written within the bound shows as a redelivery: its handler runs again (no
de-duplication here), or the lost-ack memory acks it unrun
(``stats().duplicates``). A frame naming a wrong tag would have closed a
channel before the cut (``channel_reopens``).
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import AsyncIterator

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import ConnectionSettings, ReliablePublisher
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.testing import TCPProxy
from reliable_mq.topology import QueueTopology, delete_topology
from tests.conftest import proxied_url
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

QUEUES = 30
PER_QUEUE = 10
INTERVAL = 0.2


@pytest.fixture
async def queues(broker_url: str) -> AsyncIterator[list[str]]:
    """QUEUES fresh queue names; their topologies are deleted afterwards."""
    run = uuid.uuid4().hex[:10]
    names = [f"test-many-{run}-{n}" for n in range(QUEUES)]
    yield names
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        for name in names:
            await delete_topology(channel, QueueTopology(name))


class TestManyQueues:
    async def test_every_channel_acked_within_the_interval(
        self, broker_url: str, queues: list[str], proxy: TCPProxy
    ) -> None:
        """300 messages over 30 queues, batches never full (ack_batch_size 1000): every
        ack reaches the broker within ack_flush_interval, each tag once; a cut after
        that brings nothing back, and no channel was closed for an unknown tag."""
        consumer = ReliableConsumer(
            ConnectionSettings(url=SecretStr(proxied_url(proxy)), reconnect_initial_delay=0.1),
            registry=CollectorRegistry(),
            dedup=None,
            ack_batch_size=1000,
            ack_flush_interval=INTERVAL,
        )
        effects: collections.Counter[str] = collections.Counter()

        async def handler(delivery: Delivery) -> None:
            effects[delivery.message_id] += 1

        for name in queues:
            consumer.add_handler(name, handler)
        ids = [f"{name}/{n}" for name in queues for n in range(PER_QUEUE)]
        async with consumer, ReliablePublisher(broker_url, registry=CollectorRegistry()) as pub:
            await asyncio.gather(
                *(
                    pub.publish(b"x", routing_key=message_id.split("/")[0], message_id=message_id)
                    for message_id in ids
                )
            )
            await wait_until(lambda: len(effects) == len(ids), timeout=20, what="all handled")
            await asyncio.sleep(INTERVAL + 1.0)  # the bound, and slack for a loaded machine
            before = consumer.stats()
            assert await proxy.cut() > 0
            await wait_until(
                lambda: consumer.stats().channel_reopens >= QUEUES,
                timeout=20,
                what="every channel open again",
            )
            await asyncio.sleep(1.0)  # whatever the broker held unacked is delivered again
            after = consumer.stats()
        assert dict(effects) == dict.fromkeys(ids, 1)
        assert (before.delivered, before.acked, before.stale) == (len(ids), len(ids), 0)
        assert before.channel_reopens == 0  # no frame named an unknown tag
        assert QUEUES <= before.ack_frames < len(ids)  # batched, per channel
        assert (after.delivered, after.duplicates) == (len(ids), 0)
