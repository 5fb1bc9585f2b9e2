"""The AMQP seam's hooks: verified when a connection opens; a changed aiormq or pamqp
is refused loudly (``fast_path="on"``) or falls back to the plain path with one
warning (``"auto"``), never a silent downgrade.

A changed dependency is simulated by removing or altering the part a hook relies
on (monkeypatch), then opening real connections to the shared broker.
"""

from __future__ import annotations

import asyncio
import re
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aio_pika
import aiormq
import aiormq.connection
import pytest
import structlog
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from reliable_mq import (
    ConnectionSettings,
    FastPath,
    ReliableConsumer,
    ReliablePublisher,
    UnsupportedDependency,
)
from reliable_mq._amqp import hooks
from reliable_mq._amqp.confirm import FastConfirmChannel, PlainConfirmChannel
from reliable_mq._amqp.inbound import decode_frame
from reliable_mq.delivery import Delivery
from reliable_mq.settings import ConsumerSettings
from reliable_mq.topology import QueueTopology, delete_topology

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _fresh_checks(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test checks the hooks anew and may warn once (the process caches both)."""
    monkeypatch.setattr(hooks, "_verified", {})
    monkeypatch.setattr(hooks, "_warned", False)
    yield


def settings(url: str, mode: FastPath) -> ConnectionSettings:
    return ConnectionSettings(
        url=SecretStr(url), connection_name=f"test-seam-{uuid.uuid4().hex[:6]}", fast_path=mode
    )


def warnings_in(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [entry for entry in logs if entry["event"] == "fast_path_unavailable"]


class TestVerify:
    def test_every_hook_verifies_on_the_installed_versions(self) -> None:
        """The aiormq and pamqp that CI installs (newest and lowest) pass every check."""
        assert hooks.verify(decode_frame) == []
        hooks.check_plain()

    def test_the_supported_ranges_are_the_declared_ones(self) -> None:
        """The range a refusal names is the one pyproject.toml declares (and CI tests)."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        declared = {}
        for requirement in project["dependencies"]:
            name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()  # type: ignore[union-attr]
            declared[name.lower()] = spec.replace(" ", "")
        for dependency, supported in hooks.SUPPORTED.items():
            assert declared[dependency] == supported, dependency

    def test_a_missing_handler_is_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """aiormq without ``Channel._on_confirm_frame``: the hook, aiormq, its version, the range."""
        monkeypatch.delattr(aiormq.Channel, "_on_confirm_frame")
        failures = hooks.verify(decode_frame)
        assert [f.hook for f in failures] == ["aiormq.Channel._on_confirm_frame"]
        text = failures[0].describe()
        assert "missing" in text
        assert f"aiormq {hooks.installed('aiormq')} installed" in text
        assert hooks.SUPPORTED["aiormq"] in text

    def test_a_changed_signature_is_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        async def on_deliver(self: Any, frame: Any, extra: Any) -> None: ...

        monkeypatch.setattr(aiormq.Channel, "_on_deliver_frame", on_deliver)
        (failure,) = hooks.verify(decode_frame)
        assert failure.hook == "aiormq.Channel._on_deliver_frame"
        assert "parameters" in failure.problem

    def test_a_handler_no_longer_dispatched_is_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """A channel reader that no longer calls the handler we replace: found in its source."""

        async def reader(self: Any) -> None:
            await self._on_confirm_frame_v2(None)

        monkeypatch.setattr(aiormq.Channel, "_reader", reader)
        hooks_failed = {f.hook for f in hooks.verify(decode_frame)}
        assert "aiormq.Channel._on_confirm_frame" in hooks_failed
        assert "aiormq.Channel._on_deliver_frame" in hooks_failed

    def test_a_changed_frame_queue_shape_is_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """``channel.frames`` holding frames instead of ``(weight, frame)`` pairs."""

        async def get_frame(self: Any) -> Any:
            frame = await self.frames.get()
            self.frames.task_done()
            return frame

        monkeypatch.setattr(aiormq.Channel, "_get_frame", get_frame)
        (failure,) = hooks.verify(decode_frame)
        assert failure.hook == "aiormq.Channel._get_frame"
        assert "(weight, frame)" in failure.problem

    def test_a_receiver_reader_without_the_receiver_is_named(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        original = aiormq.connection.Connection._Connection__reader  # type: ignore[attr-defined]

        async def reader(self: Any, receiver: Any) -> None:
            await original(self, receiver)

        monkeypatch.setattr(aiormq.connection.Connection, "_Connection__reader", reader)
        (failure,) = hooks.verify(decode_frame)
        assert failure.hook == "aiormq.connection.FrameReceiver"

    def test_changed_pamqp_properties_are_named(self, monkeypatch: pytest.MonkeyPatch) -> None:
        flags = dict(Basic.Properties.flags)
        flags["message_id"], flags["app_id"] = flags["app_id"], flags["message_id"]
        monkeypatch.setattr(Basic.Properties, "flags", flags)
        (failure,) = hooks.verify(decode_frame)
        assert failure.dependency == "pamqp"
        assert f"pamqp {hooks.installed('pamqp')} installed" in failure.describe()

    def test_the_checks_run_once_per_process(self, monkeypatch: pytest.MonkeyPatch) -> None:
        calls = []
        hook = hooks.HOOKS["aiormq.Channel._get_frame"]
        monkeypatch.setitem(
            hooks.HOOKS,
            hook.name,
            hooks.Hook(hook.name, hook.dependency, hook.use, lambda: calls.append(1)),
        )
        hooks.verify(decode_frame)
        hooks.verify(decode_frame)
        assert calls == [1]


class TestResolve:
    def test_on_refuses_with_a_typed_error(self) -> None:
        failure = hooks.HookFailure("aiormq.Channel._on_return_frame", "aiormq", "missing")
        with pytest.raises(UnsupportedDependency) as caught:
            hooks.resolve(FastPath.ON, [failure])
        error = caught.value
        assert error.dependency == "aiormq"
        assert error.installed == hooks.installed("aiormq")
        assert error.supported == hooks.SUPPORTED["aiormq"]
        assert "aiormq.Channel._on_return_frame" in str(error)

    def test_auto_warns_once_per_process(self) -> None:
        failure = hooks.HookFailure("aiormq.Channel._on_return_frame", "aiormq", "missing")
        with structlog.testing.capture_logs() as logs:
            assert hooks.resolve(FastPath.AUTO, [failure]) is False
            assert hooks.resolve(FastPath.AUTO, [failure]) is False
        (warning,) = warnings_in(logs)
        assert warning["log_level"] == "warning"
        assert warning["hook"] == "aiormq.Channel._on_return_frame"
        assert warning["dependency"] == "aiormq"
        assert warning["installed"] == hooks.installed("aiormq")
        assert warning["supported"] == hooks.SUPPORTED["aiormq"]
        assert "closes the connection" in warning["plain_path"]  # what the plain path lacks

    def test_off_is_the_plain_path_without_a_word(self) -> None:
        failure = hooks.HookFailure("aiormq.Channel._on_return_frame", "aiormq", "missing")
        with structlog.testing.capture_logs() as logs:
            assert hooks.resolve(FastPath.OFF, [failure]) is False
        assert warnings_in(logs) == []

    def test_the_setting_comes_from_the_environment(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setenv("RELIABLE_MQ_FAST_PATH", "off")
        assert ConnectionSettings().fast_path is FastPath.OFF
        monkeypatch.setenv("RELIABLE_MQ_FAST_PATH", "sometimes")
        with pytest.raises(ValueError, match="fast_path"):
            ConnectionSettings()


# -- against the broker: a changed aiormq, end to end ---------------------------------------


@pytest.fixture
async def declared(broker_url: str) -> AsyncIterator[str]:
    name = f"test-seam-{uuid.uuid4().hex[:10]}"
    connection = await aio_pika.connect(broker_url)
    async with connection:
        channel = await connection.channel()
        yield name
        await delete_topology(channel, QueueTopology(name))


def _without_confirm_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A changed aiormq: ``Channel._on_confirm_frame`` takes other arguments.

    aiormq itself still works (its plain path must); only what our hook
    relies on has changed.
    """
    original = aiormq.Channel._on_confirm_frame

    async def on_confirm(self: Any, frame: Any, *, source: str = "reader") -> None:
        await original(self, frame)

    monkeypatch.setattr(aiormq.Channel, "_on_confirm_frame", on_confirm)


@pytest.mark.rabbitmq
class TestChangedAiormq:
    async def test_on_refuses_to_start(
        self, broker_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``fast_path="on"``: start() raises UnsupportedDependency naming aiormq and its range."""
        _without_confirm_hook(monkeypatch)
        publisher = ReliablePublisher(
            settings(broker_url, FastPath.ON), registry=CollectorRegistry()
        )
        with pytest.raises(UnsupportedDependency) as caught:
            await publisher.start()
        await publisher.close()
        assert caught.value.dependency == "aiormq"
        assert "aiormq.Channel._on_confirm_frame" in str(caught.value)
        assert hooks.SUPPORTED["aiormq"] in str(caught.value)

    async def test_auto_falls_back_with_one_warning_and_still_delivers(
        self, broker_url: str, declared: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """``fast_path="auto"``: one warning for the process, then the plain path publishes
        (confirmed) and consumes (settled) as the fast path would."""
        _without_confirm_hook(monkeypatch)
        seen: list[str] = []
        consumer = ReliableConsumer(
            settings(broker_url, FastPath.AUTO),
            settings=ConsumerSettings(prefetch=10),
            registry=CollectorRegistry(),
        )

        @consumer.handler(declared)
        async def handle(delivery: Delivery) -> None:
            seen.append(delivery.message_id)

        with structlog.testing.capture_logs() as logs:
            async with consumer:
                link = consumer._supervisor.connection
                assert link is not None and not link.fast
                async with ReliablePublisher(
                    settings(broker_url, FastPath.AUTO), registry=CollectorRegistry()
                ) as publisher:
                    channel = publisher._engine._stream.current
                    assert channel is not None
                    assert isinstance(channel.channel, PlainConfirmChannel)
                    results = await asyncio.gather(
                        *(
                            publisher.publish(
                                f"m{n}".encode(), routing_key=declared, message_id=f"m{n}"
                            )
                            for n in range(50)
                        )
                    )
                    assert len(results) == 50
                deadline = asyncio.get_running_loop().time() + 30
                while len(seen) < 50 and asyncio.get_running_loop().time() < deadline:
                    await asyncio.sleep(0.02)
        assert sorted(seen) == sorted(f"m{n}" for n in range(50))
        assert consumer.stats().acked == 50
        (warning,) = warnings_in(logs)  # two connections, one warning
        assert warning["hook"] == "aiormq.Channel._on_confirm_frame"

    async def test_the_installed_aiormq_takes_the_fast_path(self, broker_url: str) -> None:
        async with ReliablePublisher(
            settings(broker_url, FastPath.ON), registry=CollectorRegistry()
        ) as publisher:
            generation = publisher._engine._stream.current
            assert generation is not None
            assert isinstance(generation.channel, FastConfirmChannel)

    async def test_off_takes_the_plain_path(self, broker_url: str, queue: str) -> None:
        with structlog.testing.capture_logs() as logs:
            async with ReliablePublisher(
                settings(broker_url, FastPath.OFF), registry=CollectorRegistry()
            ) as publisher:
                generation = publisher._engine._stream.current
                assert generation is not None
                assert isinstance(generation.channel, PlainConfirmChannel)
                await publisher.publish(b"x", routing_key=queue)
        assert warnings_in(logs) == []


@pytest.mark.rabbitmq
class TestChangedChannel:
    """The per-channel shapes are checked too: a channel's failed check is no quieter."""

    @staticmethod
    def _broken_channels(monkeypatch: pytest.MonkeyPatch) -> None:
        failure = hooks.HookFailure(
            "aiormq.Channel._get_frame", "aiormq", "channel.frames is no Queue"
        )
        monkeypatch.setattr(hooks, "check_channel", lambda channel: failure)

    async def test_on_refuses_when_the_first_channel_opens(
        self, broker_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._broken_channels(monkeypatch)
        publisher = ReliablePublisher(
            settings(broker_url, FastPath.ON), registry=CollectorRegistry()
        )
        started = asyncio.get_running_loop().time()
        with pytest.raises(UnsupportedDependency, match=r"channel\.frames is no Queue"):
            await publisher.start()
        await publisher.close()
        assert asyncio.get_running_loop().time() - started < 5  # at once, not at a timeout

    async def test_auto_warns_and_the_channel_is_plain(
        self, broker_url: str, queue: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        self._broken_channels(monkeypatch)
        with structlog.testing.capture_logs() as logs:
            async with ReliablePublisher(
                settings(broker_url, FastPath.AUTO), registry=CollectorRegistry()
            ) as publisher:
                generation = publisher._engine._stream.current
                assert generation is not None
                assert isinstance(generation.channel, PlainConfirmChannel)
                await publisher.publish(b"x", routing_key=queue)
        (warning,) = warnings_in(logs)
        assert warning["hook"] == "aiormq.Channel._get_frame"


@pytest.mark.rabbitmq
class TestPlainPathFidelity:
    async def test_the_plain_path_sends_the_properties_as_encoded(
        self, broker_url: str, queue: str, amqp: aio_pika.abc.AbstractChannel
    ) -> None:
        """Through aiormq's public basic_publish, the properties are still ours: a float
        header stays a double (pamqp's own encoding narrows it to 32 bits)."""
        async with ReliablePublisher(
            settings(broker_url, FastPath.OFF), registry=CollectorRegistry()
        ) as publisher:
            await publisher.publish(
                b"x",
                routing_key=queue,
                message_id="fidelity",
                headers={"f": 0.1, "big": 2**40, "flag": True},
            )
        got = await (await amqp.get_queue(queue)).get(timeout=10)
        assert got is not None
        await got.ack()
        headers = got.headers
        assert headers["f"] == 0.1 and isinstance(headers["f"], float)
        assert headers["big"] == 2**40 and headers["flag"] is True
        assert got.message_id == "fidelity"
