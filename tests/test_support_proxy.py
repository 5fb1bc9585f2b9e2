"""TCPProxy against the shared broker: pass-through, cut, blackhole, stall, refuse.

The ``proxy`` fixture (tests/conftest.py) puts a started TCPProxy in front of
the shared broker on 127.0.0.1:5672.
"""

from __future__ import annotations

import asyncio
import uuid

import aio_pika
import pytest
from aio_pika.abc import AbstractConnection

from reliable_mq.testing import TCPProxy
from tests.support.waiting import wait_until

BROKER_HOST = "127.0.0.1"
BROKER_PORT = 5672
DIRECT_URL = f"amqp://guest:guest@{BROKER_HOST}:{BROKER_PORT}/"

CONNECT_ERRORS = (OSError, asyncio.TimeoutError, aio_pika.exceptions.AMQPError)


def proxied_url(proxy: TCPProxy) -> str:
    host, port = proxy.address
    return f"amqp://guest:guest@{host}:{port}/"


def queue_name() -> str:
    return f"test.proxy.{uuid.uuid4().hex}"


def on_close_event(connection: AbstractConnection) -> asyncio.Event:
    closed = asyncio.Event()
    connection.close_callbacks.add(lambda *_: closed.set())
    return closed


async def test_start_close_and_restart_on_same_port() -> None:
    tcp_proxy = TCPProxy(BROKER_HOST, BROKER_PORT)
    with pytest.raises(RuntimeError):
        _ = tcp_proxy.port
    await tcp_proxy.start()
    port = tcp_proxy.port
    assert port > 0
    assert tcp_proxy.address == ("127.0.0.1", port)
    with pytest.raises(RuntimeError):
        await tcp_proxy.start()
    await tcp_proxy.close()
    await tcp_proxy.close()  # idempotent
    assert not tcp_proxy.is_running
    async with tcp_proxy:
        assert tcp_proxy.port == port
    with pytest.raises(ConnectionRefusedError):
        await asyncio.open_connection("127.0.0.1", port)


async def test_unreachable_target_drops_client() -> None:
    # Port 1 on loopback: nothing listens there.
    async with TCPProxy("127.0.0.1", 1) as tcp_proxy:
        reader, writer = await asyncio.open_connection(*tcp_proxy.address)
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()
        assert tcp_proxy.active_connections == 0


async def test_traffic_counts_reads_and_bytes_per_direction() -> None:
    """Each direction's forwarded reads and bytes are counted; a blackhole forwards nothing."""

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            writer.write(data.upper())
        writer.close()

    server = await asyncio.start_server(echo, "127.0.0.1", 0)
    target = server.sockets[0].getsockname()[1]
    async with server, TCPProxy("127.0.0.1", target) as tcp_proxy:
        assert tcp_proxy.traffic == (0, 0, 0, 0)
        reader, writer = await asyncio.open_connection(*tcp_proxy.address)
        for chunk in (b"one", b"three", b"fifteen"):
            writer.write(chunk)
            assert await asyncio.wait_for(reader.readexactly(len(chunk)), 5) == chunk.upper()
        assert tcp_proxy.traffic == (3, 15, 3, 15)
        assert tcp_proxy.traffic.to_upstream_bytes == 15
        tcp_proxy.set_blackhole(True)
        writer.write(b"lost")
        await asyncio.sleep(0.1)
        assert tcp_proxy.traffic == (3, 15, 3, 15)
        writer.close()


@pytest.mark.rabbitmq
async def test_cut_closes_connection_and_new_ones_work(proxy: TCPProxy) -> None:
    connection = await aio_pika.connect(proxied_url(proxy), timeout=5)
    closed = on_close_event(connection)
    name = queue_name()
    channel = await connection.channel()
    queue = await channel.declare_queue(name, auto_delete=True, exclusive=True)
    await channel.default_exchange.publish(aio_pika.Message(b"via proxy"), routing_key=name)
    message = await queue.get(timeout=5)
    assert message.body == b"via proxy"
    await message.ack()
    assert proxy.active_connections == 1
    assert proxy.connections_total == 1

    assert await proxy.cut() == 1
    await asyncio.wait_for(closed.wait(), 5)
    # Note: aio-pika's `is_closed` only turns True once close() is called.
    assert not connection.connected.is_set()
    assert proxy.active_connections == 0

    # The broker saw its side go too: the exclusive queue is gone.
    direct = await aio_pika.connect(DIRECT_URL, timeout=5)
    try:
        for _ in range(50):
            check = await direct.channel()
            try:
                await check.declare_queue(name, passive=True)
            except aio_pika.exceptions.ChannelNotFoundEntity:
                break
            await check.close()
            await asyncio.sleep(0.1)
        else:
            pytest.fail("the broker kept the connection open after cut()")
    finally:
        await direct.close()

    # The proxy still accepts new connections.
    again = await aio_pika.connect(proxied_url(proxy), timeout=5)
    try:
        channel = await again.channel()
        await channel.declare_queue(queue_name(), auto_delete=True, exclusive=True)
        assert proxy.connections_total == 2
    finally:
        await again.close()
    await wait_until(lambda: proxy.active_connections == 0, timeout=5.0, interval=0.01)
    assert await proxy.cut() == 0


@pytest.mark.rabbitmq
async def test_many_messages_pass_intact(proxy: TCPProxy) -> None:
    connection = await aio_pika.connect(proxied_url(proxy), timeout=5)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(queue_name(), auto_delete=True, exclusive=True)
        bodies = [f"{i}:".encode() + bytes([i % 256]) * (i % 3000) for i in range(2000)]
        await asyncio.gather(
            *(
                channel.default_exchange.publish(aio_pika.Message(body), routing_key=queue.name)
                for body in bodies
            )
        )
        received: list[bytes] = []
        async with queue.iterator(no_ack=True) as messages:
            async for message in messages:
                received.append(message.body)
                if len(received) == len(bodies):
                    break
        assert received == bodies
    finally:
        await connection.close()


@pytest.mark.rabbitmq
async def test_blackhole_stalls_then_lifting_it_lets_new_connections_through(
    proxy: TCPProxy,
) -> None:
    connection = await aio_pika.connect(proxied_url(proxy), timeout=5)
    try:
        channel = await connection.channel()
        proxy.set_blackhole(True)
        assert proxy.blackhole
        # Requests vanish, and the connection stays open.
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(
                channel.declare_queue(queue_name(), auto_delete=True, exclusive=True), 0.5
            )
        assert not connection.is_closed
        assert proxy.active_connections == 1
        # New connections are accepted but their handshake goes nowhere.
        with pytest.raises(CONNECT_ERRORS):
            await aio_pika.connect(proxied_url(proxy), timeout=0.5)
        assert proxy.connections_total == 2

        proxy.set_blackhole(False)
        fresh = await aio_pika.connect(proxied_url(proxy), timeout=5)
        try:
            fresh_channel = await fresh.channel()
            await fresh_channel.declare_queue(queue_name(), auto_delete=True, exclusive=True)
        finally:
            await fresh.close()
    finally:
        await proxy.cut()  # the blackholed connection lost bytes: drop it
        await connection.close()


@pytest.mark.rabbitmq
async def test_stall_holds_bytes_and_the_connection_survives(proxy: TCPProxy) -> None:
    connection = await aio_pika.connect(proxied_url(proxy), timeout=5)
    try:
        channel = await connection.channel()
        proxy.set_stall(True)
        declare = asyncio.ensure_future(
            channel.declare_queue(queue_name(), auto_delete=True, exclusive=True)
        )
        done, _ = await asyncio.wait({declare}, timeout=0.5)
        assert not done
        proxy.set_stall(False)
        queue = await asyncio.wait_for(declare, 5)
        await channel.default_exchange.publish(aio_pika.Message(b"after"), routing_key=queue.name)
        message = await queue.get(timeout=5)
        assert message.body == b"after"
        assert proxy.connections_total == 1
    finally:
        await connection.close()


@pytest.mark.rabbitmq
async def test_refuse_closes_new_connections_only(proxy: TCPProxy) -> None:
    existing = await aio_pika.connect(proxied_url(proxy), timeout=5)
    try:
        proxy.set_refuse(True)
        assert proxy.refusing
        with pytest.raises(CONNECT_ERRORS):
            await aio_pika.connect(proxied_url(proxy), timeout=2)
        assert proxy.refused_total >= 1
        assert proxy.connections_total == 1
        # The connection made before keeps working.
        channel = await existing.channel()
        await channel.declare_queue(queue_name(), auto_delete=True, exclusive=True)

        proxy.set_refuse(False)
        fresh = await aio_pika.connect(proxied_url(proxy), timeout=5)
        await fresh.close()
        assert proxy.connections_total == 2
    finally:
        await existing.close()
