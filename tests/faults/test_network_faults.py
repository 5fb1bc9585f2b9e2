"""Network faults mid-stream: cuts, server-side closes, a blackhole, TCP resets.

Each scenario streams thousands of confirmed publishes into a queue while a
consumer with a dedup store applies their effects, injects its fault again
and again, then drains every queue. The oracle must find nothing lost,
nothing unexpected, no effect applied twice and no publish left hanging.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from reliable_mq.testing import TCPProxy
from tests.faults.harness import Faults, check, run_stream
from tests.support.private_node import PrivateBroker

pytestmark = [pytest.mark.private_broker, pytest.mark.timeout(240)]


def proxy_url(proxy: TCPProxy) -> str:
    return f"amqp://guest:guest@127.0.0.1:{proxy.port}/"


class TestNetworkFaults:
    async def test_cut_storm(self, fault_node: PrivateBroker) -> None:
        """5,000+ messages while publisher and consumer links are cut every 0.3-0.8 s."""
        async with (
            TCPProxy("127.0.0.1", fault_node.amqp_port) as pub_proxy,
            TCPProxy("127.0.0.1", fault_node.amqp_port) as con_proxy,
        ):

            async def faults(ctx: Faults) -> None:
                publisher_cuts = 0

                async def cut() -> int:
                    # Every other publisher cut is sure to catch messages unconfirmed
                    # (the rest land wherever the timer puts them).
                    nonlocal publisher_cuts
                    publisher_cuts += 1
                    if publisher_cuts % 2:
                        return await ctx.cut_with_unconfirmed(pub_proxy)
                    return await pub_proxy.cut()

                cut_publisher = ctx.then_publisher_reopens(cut)
                await ctx.repeat(cut_publisher, con_proxy.cut, low=0.3, high=0.8, min_times=10)

            run = await run_stream(
                "cut storm",
                fault_node.url,
                faults=faults,
                publisher_url=proxy_url(pub_proxy),
                consumer_url=proxy_url(con_proxy),
                min_messages=5000,
            )
        check(run)
        assert run.scenario.faults >= 20
        # Deterministic: five of the cuts held messages written after their link stalled.
        assert run.publisher_stats.republished >= 5
        assert run.publisher_stats.channel_generation > 10

    async def test_server_side_closes(self, fault_node: PrivateBroker) -> None:
        """rabbitmqctl close_all_connections again and again (320 CONNECTION_FORCED)."""

        async def close_all() -> None:
            await asyncio.to_thread(fault_node.close_all_connections, "fault suite")

        async def faults(ctx: Faults) -> None:
            await ctx.repeat(ctx.then_publisher_reopens(close_all), low=0.2, high=0.6, min_times=4)

        run = await run_stream("server closes", fault_node.url, faults=faults, min_messages=5000)
        check(run)
        assert run.scenario.faults >= 4
        assert run.publisher_stats.channel_generation >= 5

    async def test_blackhole_detected_by_heartbeats(self, fault_node: PrivateBroker) -> None:
        """Traffic vanishes without a close; heartbeats (1 s) notice, everything pending is republished."""
        async with TCPProxy("127.0.0.1", fault_node.amqp_port) as proxy:
            lifted_generation: list[int] = []

            async def faults(ctx: Faults) -> None:
                while ctx.publisher.stats().confirmed < 1500:
                    await asyncio.sleep(0.01)
                before = ctx.publisher.stats().channel_generation
                proxy.set_blackhole(True)
                ctx.scenario.faults += 1
                # aiormq gives up after (heartbeat + 1) * 3 = 6 s of silence.
                await asyncio.sleep(8)
                proxy.set_blackhole(False)
                lifted_generation.append(before)
                ctx.enough.set()

            run = await run_stream(
                "blackhole",
                fault_node.url,
                faults=faults,
                publisher_url=proxy_url(proxy),
                consumer_url=proxy_url(proxy),
                min_messages=5000,
                heartbeat=1,
            )
        check(run)
        # Pending confirms were on the silent channel: they were republished on a new one.
        assert run.publisher_stats.republished > 0
        assert run.publisher_stats.channel_generation > lifted_generation[0]

    async def test_tcp_reset_mid_publish(self, fault_node: PrivateBroker) -> None:
        """The kernel resets every client socket to the node (ss -K) while publishes are in flight."""
        if os.geteuid() != 0:
            pytest.skip("ss -K needs root")
        port = fault_node.amqp_port

        async def reset() -> None:
            proc = await asyncio.create_subprocess_exec(
                "ss", "-K", "dst", "127.0.0.1", "dport", "=", f":{port}",
                stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.DEVNULL,
            )  # fmt: skip
            assert await proc.wait() == 0

        async def faults(ctx: Faults) -> None:
            await ctx.repeat(ctx.then_publisher_reopens(reset), low=0.3, high=0.8, min_times=8)

        run = await run_stream("tcp reset", fault_node.url, faults=faults, min_messages=5000)
        check(run)
        assert run.scenario.faults >= 8
        # Every reset struck a live publisher connection. Whether one also caught a
        # message unconfirmed is up to timing (the stream is paced, and a confirm
        # takes well under a millisecond): CI once saw 8 resets and nothing to
        # republish, so that is reported in the FAULTS line, not asserted.
        assert run.publisher_stats.channel_generation >= 9
