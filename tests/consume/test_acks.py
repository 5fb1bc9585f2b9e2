"""Unit tests of the batched-ack bookkeeping (reliable_mq._consume.acks), no broker."""

from __future__ import annotations

import asyncio
import random
import struct
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry

from reliable_mq._consume.acks import AckTracker, TagState
from reliable_mq._consume.session import Session, Shared
from reliable_mq.handlers import AckPolicy
from reliable_mq.metrics import Metrics
from reliable_mq.settings import ConsumerSettings


class _Broker:
    """The broker's view of one channel: outstanding tags and what settled them."""

    def __init__(self) -> None:
        self.outstanding: set[int] = set()
        self.acked: list[int] = []
        self.nacked: list[int] = []
        self.next_tag = 1

    def deliver(self) -> int:
        tag = self.next_tag
        self.next_tag += 1
        self.outstanding.add(tag)
        return tag

    def ack(self, tag: int, *, multiple: bool) -> None:
        assert tag in self.outstanding, f"PRECONDITION_FAILED - unknown delivery tag {tag}"
        covered = sorted(t for t in self.outstanding if t <= tag) if multiple else [tag]
        for t in covered:
            self.outstanding.remove(t)
            self.acked.append(t)

    def nack(self, tag: int) -> None:
        assert tag in self.outstanding, f"PRECONDITION_FAILED - unknown delivery tag {tag}"
        self.outstanding.remove(tag)
        self.nacked.append(tag)


def _send_prefix(tracker: AckTracker, broker: _Broker) -> None:
    tag, count = tracker.take_prefix()
    if tag is not None:
        broker.ack(tag, multiple=count > 1)


class TestAckTracker:
    def test_in_order_prefix_is_one_multiple_ack(self) -> None:
        """Five finished deliveries in order are acked by one frame naming the last."""
        tracker = AckTracker()
        for tag in range(1, 6):
            tracker.delivered(tag)
            tracker.finish(tag)
        assert tracker.pending == 5
        assert tracker.take_prefix() == (5, 5)
        assert len(tracker) == 0
        assert tracker.pending == 0

    def test_in_progress_head_blocks_the_prefix(self) -> None:
        """A delivery still in its handler is never covered by a multiple ack."""
        tracker = AckTracker()
        for tag in range(1, 5):
            tracker.delivered(tag)
        for tag in (2, 3, 4):
            tracker.finish(tag)
        assert tracker.blocked()
        assert tracker.take_prefix() == (None, 0)
        tracker.finish(1)
        assert tracker.take_prefix() == (4, 4)

    def test_prefix_stops_at_the_first_in_progress(self) -> None:
        """Only the contiguous finished run is taken; later finished tags wait."""
        tracker = AckTracker()
        for tag in range(1, 7):
            tracker.delivered(tag)
        for tag in (1, 2, 4, 5):
            tracker.finish(tag)
        assert tracker.take_prefix() == (2, 2)
        assert tracker.state(3) is TagState.IN_PROGRESS
        assert tracker.pending == 2

    def test_settled_tag_is_never_named_by_an_ack(self) -> None:
        """A nacked tag at the end of the prefix does not become the multiple-ack tag."""
        tracker = AckTracker()
        for tag in range(1, 4):
            tracker.delivered(tag)
        tracker.finish(1)
        tracker.finish(2)
        assert tracker.settle(3)
        assert tracker.take_prefix() == (2, 2)
        assert len(tracker) == 0

    def test_prefix_of_only_settled_tags_sends_nothing(self) -> None:
        """A prefix of individually settled tags is dropped without a frame."""
        tracker = AckTracker()
        tracker.delivered(1)
        tracker.delivered(2)
        tracker.settle(1)
        tracker.settle(2)
        assert tracker.take_prefix() == (None, 0)
        assert len(tracker) == 0

    def test_stragglers_are_taken_once(self) -> None:
        """Finished tags behind a slow one are handed out once, then never again."""
        tracker = AckTracker()
        for tag in range(1, 5):
            tracker.delivered(tag)
        tracker.finish(3)
        tracker.finish(4)
        assert tracker.take_prefix() == (None, 0)
        assert tracker.take_stragglers() == [3, 4]
        assert tracker.pending == 0
        assert tracker.take_stragglers() == []
        tracker.finish(1)
        tracker.finish(2)
        assert tracker.take_prefix() == (2, 2)
        assert len(tracker) == 0

    def test_double_finish_and_settle_are_refused(self) -> None:
        """A tag can leave IN_PROGRESS only once."""
        tracker = AckTracker()
        tracker.delivered(1)
        assert tracker.finish(1)
        assert not tracker.finish(1)
        assert not tracker.settle(1)
        assert tracker.pending == 1
        assert not tracker.finish(99)

    def test_out_of_order_delivery_is_an_error(self) -> None:
        """Tags must be consecutive (one consumer per channel)."""
        tracker = AckTracker()
        tracker.delivered(1)
        with pytest.raises(ValueError, match="out of order"):
            tracker.delivered(3)

    def test_empty_tracker_may_start_at_any_tag(self) -> None:
        """After everything was taken, the next tag may skip ahead."""
        tracker = AckTracker()
        tracker.delivered(5)
        tracker.finish(5)
        assert tracker.take_prefix() == (5, 1)
        tracker.delivered(9)
        assert tracker.in_progress() == [9]

    @pytest.mark.parametrize("seed", range(25))
    def test_random_schedule_settles_each_tag_exactly_once(self, seed: int) -> None:
        """Random out-of-order finishes, nacks and flushes: no loss, no double settle."""
        rng = random.Random(seed)
        broker = _Broker()
        tracker = AckTracker()
        in_progress: list[int] = []
        expected_acks: set[int] = set()
        expected_nacks: set[int] = set()
        for _ in range(2000):
            roll = rng.random()
            if roll < 0.35 and len(in_progress) < 50:
                tag = broker.deliver()
                tracker.delivered(tag)
                in_progress.append(tag)
            elif roll < 0.75 and in_progress:
                tag = in_progress.pop(rng.randrange(len(in_progress)))
                if rng.random() < 0.1:
                    assert tracker.settle(tag)
                    broker.nack(tag)
                    expected_nacks.add(tag)
                else:
                    assert tracker.finish(tag)
                    expected_acks.add(tag)
                    if tracker.pending >= 8:
                        _send_prefix(tracker, broker)
            elif roll < 0.85:
                _send_prefix(tracker, broker)
                for tag in tracker.take_stragglers():
                    broker.ack(tag, multiple=False)
            # every tag the broker considers acked must have finished
            assert set(broker.acked) <= expected_acks
        for tag in in_progress:
            tracker.finish(tag)
            expected_acks.add(tag)
        _send_prefix(tracker, broker)
        assert tracker.take_stragglers() == []
        assert not broker.outstanding
        assert sorted(broker.acked) == sorted(expected_acks)
        assert len(broker.acked) == len(set(broker.acked))
        assert set(broker.nacked) == expected_nacks


class _YieldingChannel:
    """An aiormq channel stand-in with the broker's rules for one channel.

    Every awaited write yields to the loop (as a real frame write may), so
    concurrent settles interleave; a frame naming a tag that is not
    outstanding raises, as the broker would close the channel with
    PRECONDITION_FAILED. Frames queued by `write_now` (any channel's of the same
    `_Link`) reach their channel's broker at once, in order, as one write.
    """

    def __init__(
        self, broker: _Broker, rng: random.Random, link: _Link | None = None, number: int = 1
    ) -> None:
        self.broker = broker
        self.rng = rng
        self.link = link if link is not None else _Link(rng)
        self.link.channels[number] = self
        self.number = number
        self.link_key = id(self.link)
        self.is_closed = False
        self.errors: list[str] = []

    def ack_frame(self, tag: int, *, multiple: bool) -> bytes:
        return _ACK.pack(self.number, tag, multiple)

    def has_room(self) -> bool:
        return self.link.has_room()

    def write_now(self, frames: bytes) -> None:
        self.link.write(frames)

    async def _yield(self) -> None:
        for _ in range(self.rng.randrange(3)):
            await asyncio.sleep(0)

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool = False) -> None:
        await self._yield()
        try:
            self.broker.ack(tag, multiple=multiple)
        except AssertionError as exc:
            self.errors.append(str(exc))
            raise

    async def basic_nack(
        self, tag: int, *, multiple: bool, requeue: bool, wait: bool = False
    ) -> None:
        await self._yield()
        try:
            self.broker.nack(tag)
        except AssertionError as exc:
            self.errors.append(str(exc))
            raise


_ACK = struct.Struct(">HQ?")
"""The stand-in's ack frame: channel, tag, multiple."""


class _Link:
    """One connection's write queue, as `_YieldingChannel.write_now` sees it: now and
    then full (the flusher must wait), every write counted."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.channels: dict[int, _YieldingChannel] = {}
        self.writes: list[int] = []
        """Frames per batched write."""

    def has_room(self) -> bool:
        return self.rng.random() < 0.8

    def write(self, frames: bytes) -> None:
        self.writes.append(len(frames) // _ACK.size)
        for number, tag, multiple in _ACK.iter_unpack(frames):
            channel = self.channels[number]
            try:
                channel.broker.ack(tag, multiple=multiple)
            except AssertionError as exc:
                channel.errors.append(str(exc))
                raise


def _session(
    channel: _YieldingChannel, batch_size: int, shared: Shared | None = None, prefetch: int = 200
) -> Session:
    if shared is None:
        settings = ConsumerSettings(
            ack_batch_size=batch_size, ack_flush_interval=0.001, prefetch=prefetch
        )
        shared = Shared(settings)
    route = SimpleNamespace(
        metrics=Metrics.on(CollectorRegistry()).for_queue("q"),
        dedup=None,
        queue="q",
        spec=SimpleNamespace(ack_policy=AckPolicy.RETRY_ON_ERROR),
    )
    return Session(shared, route, channel)  # type: ignore[arg-type]


class TestSessionFrameOrder:
    """Concurrent settles on one session: frames leave in the order decided."""

    @pytest.mark.parametrize("seed", range(20))
    async def test_concurrent_settles_never_name_a_settled_tag(self, seed: int) -> None:
        rng = random.Random(seed)
        broker = _Broker()
        channel = _YieldingChannel(broker, rng)
        session = _session(channel, batch_size=rng.choice([2, 4, 8]))
        acks: set[int] = set()
        nacks: set[int] = set()

        async def handle(tag: int) -> None:
            await asyncio.sleep(rng.random() * 0.003)
            roll = rng.random()
            if roll < 0.6:
                acks.add(tag)
                await session.ack(tag)  # batched
            elif roll < 0.85:
                acks.add(tag)
                await session.ack_now(tag)  # after a republish: its own frame
            else:
                nacks.add(tag)
                await session.nack(tag, requeue=True)

        tasks = []
        for _ in range(400):
            tag = broker.deliver()
            session.tracker.delivered(tag)
            tasks.append(asyncio.create_task(handle(tag)))
            if rng.random() < 0.3:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.flush(stragglers=True)
        assert channel.errors == []
        assert session.alive
        assert not broker.outstanding
        assert set(broker.acked) == acks
        assert set(broker.nacked) == nacks


class TestOneFlusherForManyChannels:
    """Batched acks of many channels leave on one timer, one write per tick."""

    @pytest.mark.parametrize("seed", range(10))
    async def test_each_tag_settled_once_per_channel(self, seed: int) -> None:
        """Random settles on 30 channels of one link: no frame names a settled tag or
        another channel's tag, every tag is settled once, writes carry many channels."""
        rng = random.Random(seed)
        settings = ConsumerSettings(ack_batch_size=8, ack_flush_interval=0.002)
        shared = Shared(settings)
        link = _Link(rng)
        channels = [_YieldingChannel(_Broker(), rng, link, number) for number in range(1, 31)]
        sessions = [_session(channel, 8, shared) for channel in channels]
        expected: list[tuple[set[int], set[int]]] = [(set(), set()) for _ in channels]

        async def handle(index: int, tag: int) -> None:
            session, (acks, nacks) = sessions[index], expected[index]
            await asyncio.sleep(rng.random() * 0.01)
            roll = rng.random()
            if roll < 0.8:
                acks.add(tag)
                await session.ack(tag)
            elif roll < 0.9:
                acks.add(tag)
                await session.ack_now(tag)
            else:
                nacks.add(tag)
                await session.nack(tag, requeue=False)

        tasks = []
        for _ in range(1500):
            index = rng.randrange(len(channels))
            tag = channels[index].broker.deliver()
            sessions[index].tracker.delivered(tag)
            tasks.append(asyncio.create_task(handle(index, tag)))
            if rng.random() < 0.2:
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        async with asyncio.timeout(5):  # the timer alone settles what is left
            while any(channel.broker.outstanding for channel in channels):
                await asyncio.sleep(0.002)
        for channel, session, (acks, nacks) in zip(channels, sessions, expected, strict=True):
            assert channel.errors == []
            assert session.alive
            assert sorted(channel.broker.acked) == sorted(acks)
            assert sorted(channel.broker.nacked) == sorted(nacks)
        assert max(link.writes) > 1, link.writes  # frames of several channels in one write
        shared.acks.close()

    async def test_ack_waits_at_most_the_interval(self) -> None:
        """One ack on each of 200 channels: all written within ack_flush_interval
        (plus slack), in one write."""
        rng = random.Random(1)
        settings = ConsumerSettings(ack_batch_size=50, ack_flush_interval=0.05)
        shared = Shared(settings)
        link = _Link(random.Random(0))
        link.has_room = lambda: True  # type: ignore[method-assign]
        channels = [_YieldingChannel(_Broker(), rng, link, number) for number in range(1, 201)]
        sessions = [_session(channel, 50, shared) for channel in channels]
        loop = asyncio.get_running_loop()
        started = loop.time()
        for channel, session in zip(channels, sessions, strict=True):
            tag = channel.broker.deliver()
            session.tracker.delivered(tag)
            await session.ack(tag)
        assert link.writes == []
        while any(channel.broker.outstanding for channel in channels):
            await asyncio.sleep(0.005)
            assert loop.time() - started < 0.5  # the interval, and slack for a loaded machine
        assert link.writes == [200]
        assert all(session.metrics.ack_frames == 1 for session in sessions)

    async def test_small_prefetch_flushes_at_half(self) -> None:
        """With prefetch 10 below ack_batch_size 50, five finished deliveries are
        acked at once, not on the timer (the broker would stop at ten unacked)."""
        rng = random.Random(2)
        channel = _YieldingChannel(_Broker(), rng)
        channel.link.has_room = lambda: True  # type: ignore[method-assign]
        session = _session(channel, 50, prefetch=10)
        session.shared.acks.interval = 10.0
        for _ in range(5):
            tag = channel.broker.deliver()
            session.tracker.delivered(tag)
            await session.ack(tag)
        assert channel.broker.acked == [1, 2, 3, 4, 5]
        assert channel.link.writes == [1]
