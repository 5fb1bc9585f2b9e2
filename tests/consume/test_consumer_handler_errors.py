"""Hostile exceptions from a handler, against the real broker (found by the consumer fuzz tier).

* ``GeneratorExit``, or a ``BaseException`` subclass of the handler's own, is a
  handler error like any other: retried, then the DLQ naming it. (It used to be
  requeued at once, forever: a hot loop on one message.)
* ``KeyboardInterrupt`` and ``SystemExit`` end the process: asyncio lets only
  these two out of the event loop. The delivery counts as a failed attempt
  first, and reaches the broker before the process ends, so a handler that
  always exits (``argparse`` on message data, say) stops crash-looping its
  process after ``max_attempts`` restarts: the message is then in the DLQ.
  (It used to be requeued, unchanged: the process crashed on it for good.)
* An exception (or a ``Reject`` reason) whose ``__str__`` raises is retried and
  dead-lettered like any other, with a placeholder for its text. (Building the
  copy raised, the settle took the "bug of ours" path, and the delivery was
  requeued at the same attempt, forever.) A copy that cannot be built at all
  walks the fallback ladder like one that cannot be published.
* ``Retry(delay=...)`` with a delay that is not a number raises ``TypeError``
  in the handler (it used to break the copy, the same loop).
* ``handler_timeout`` does not cut a settle the handler asked for
  (``delivery.retry()`` publishing its copy on a slow link): the watchdog used to
  cancel it half-way, so the original was requeued next to its copy, the
  attempt ran twice and ``stats()`` counted no retry.
* A handler that swallows the ``CancelledError`` it gets when its channel dies
  (a bare ``except:``) has not succeeded: its delivery runs again once
  redelivered. (It counted as a success: with de-duplication on, the id was
  recorded as done and the redelivery skipped; the message was lost.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import textwrap
from pathlib import Path

import pytest
from pydantic import BaseModel, SecretStr, field_validator

from reliable_mq import ConnectionSettings
from reliable_mq._consume import republish as _republish
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery
from reliable_mq.handlers import Reject, Retry
from reliable_mq.headers import (
    ATTEMPTS_HEADER,
    ERROR_MESSAGE_HEADER,
    ERROR_TYPE_HEADER,
    REASON_HEADER,
)
from reliable_mq.testing import TCPProxy
from tests.conftest import proxied_url
from tests.consume.test_consumer_broker import URL, Env, _env, drain  # noqa: F401 (_env: fixture)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.rabbitmq

FAST = {"prefetch": 1, "retry_delays": (0.05,), "max_attempts": 2, "handler_timeout": 30.0}


class Halt(BaseException):
    """A BaseException of the handler's own: neither an exit nor a cancel."""


class Closing(BaseModel):
    n: int

    @field_validator("n")
    @classmethod
    def _check(cls, value: int) -> int:
        if value == 0:
            raise GeneratorExit  # pydantic lets a BaseException through
        return value


class TestNotAnExit:
    @pytest.mark.parametrize("error", [GeneratorExit, Halt])
    async def test_handler_base_exception_is_a_handler_error(
        self, env: Env, error: type[BaseException]
    ) -> None:
        """GeneratorExit or a custom BaseException: retried, then the DLQ; never a hot loop."""
        consumer = env.consumer(**FAST)
        attempts: list[int] = []
        handled: list[str] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            if delivery.message_id == "bad":
                attempts.append(delivery.attempt)
                raise error()
            handled.append(delivery.message_id)

        env.track(consumer)
        async with consumer:
            await env.publish([b"x", b"y"], ids=["bad", "good"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await wait_until(lambda: handled == ["good"], timeout=10, what="the good message")
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            stats = consumer.stats()
        assert attempts == [1, 2]
        assert (stats.requeued, stats.retried, stats.channel_reopens) == (0, 1, 0)
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert dead["bad"][REASON_HEADER] == "max_attempts"
        assert dead["bad"][ERROR_TYPE_HEADER] == error.__name__
        assert await drain(env.queue) == []

    async def test_validator_raising_generator_exit_is_an_invalid_body(self, env: Env) -> None:
        """A validator raising a BaseException: the DLQ as invalid_body, the handler never runs."""
        consumer = env.consumer(**FAST)
        handled: list[int] = []

        @consumer.handler(env.queue)
        async def handler(body: Closing) -> None:
            handled.append(body.n)

        env.track(consumer)
        async with consumer:
            await env.publish([{"n": 0}, {"n": 1}], ids=["bad", "good"])
            await wait_until(lambda: handled == [1], timeout=10, what="the good message")
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert dead["bad"][REASON_HEADER] == "invalid_body"
        assert dead["bad"][ERROR_TYPE_HEADER] == "GeneratorExit"


class BadStr(Exception):
    """An exception that cannot be turned into text."""

    def __str__(self) -> str:
        raise RuntimeError("no text for you")


class TestUndescribable:
    async def test_exception_whose_str_raises_is_retried_then_dead_lettered(self, env: Env) -> None:
        """str(error) raises: retried, then the DLQ with a placeholder text; never a loop."""
        consumer = env.consumer(**FAST)
        attempts: list[int] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            attempts.append(delivery.attempt)
            raise BadStr

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["bad"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            stats = consumer.stats()
        assert attempts == [1, 2]
        assert (stats.retried, stats.requeued, stats.fallbacks) == (1, 0, 0)
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert dead["bad"][REASON_HEADER] == "max_attempts"
        assert dead["bad"][ERROR_TYPE_HEADER] == "BadStr"
        assert dead["bad"][ERROR_MESSAGE_HEADER] == "<BadStr: str() failed>"

    async def test_reject_reason_whose_str_raises(self, env: Env) -> None:
        """Reject(reason) with a reason that cannot be shown: our DLQ copy, reason headers."""
        consumer = env.consumer(**FAST)

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            raise Reject(BadStr())  # type: ignore[arg-type]

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["bad"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert dead["bad"][REASON_HEADER] == "rejected"
        assert dead["bad"][ERROR_TYPE_HEADER] == "Reject"

    def test_retry_delay_must_be_a_number(self) -> None:
        """Retry(delay="soon") is refused where it is raised, naming the delay."""
        with pytest.raises(TypeError, match="soon"):
            Retry("x", delay="soon")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            Retry("x", delay=True)
        assert Retry("x", delay=0).delay == 0

    async def test_a_retry_with_a_text_delay_is_a_handler_error(self, env: Env) -> None:
        """delivery.retry(delay="soon") raises TypeError in the handler: retried, then the DLQ."""
        consumer = env.consumer(**FAST)

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            await delivery.retry(delay="soon")  # type: ignore[arg-type]

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["bad"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            stats = consumer.stats()
        assert (stats.retried, stats.requeued) == (1, 0)
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert dead["bad"][ERROR_TYPE_HEADER] == "TypeError"

    async def test_a_copy_that_cannot_be_built_walks_the_ladder(
        self, env: Env, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """build_copy raising (a bug of ours, injected): the broker dead-letters it; no loop."""

        def broken(*args: object, **kwargs: object) -> object:
            raise RuntimeError("injected")

        monkeypatch.setattr(_republish, "build_copy", broken)
        consumer = env.consumer(**FAST)
        runs: list[int] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            runs.append(delivery.attempt)
            raise ValueError("retry me")

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["bad"])
            await wait_until(
                lambda: consumer.stats().dead_lettered == 1, timeout=10, what="dead-lettered"
            )
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            stats = consumer.stats()
        assert runs == [1]
        assert (stats.fallbacks, stats.requeued) == (2, 0)  # full copy, trimmed copy, broker
        dead = await drain(f"{env.queue}.dlq")
        assert [m.message_id for m in dead] == ["bad"]
        assert dead[0].headers["x-first-death-reason"] == "rejected"


class TestDeadlineDuringSettle:
    async def test_the_deadline_waits_for_a_settle_the_handler_asked_for(
        self, env: Env, proxy: TCPProxy
    ) -> None:
        """delivery.retry() on a stalled link past handler_timeout: one copy, the original
        acked; the handler, still running afterwards, is cancelled at a later tick."""
        consumer = ReliableConsumer(
            ConnectionSettings(url=SecretStr(proxied_url(proxy)), connection_name=env.queue),
            registry=env.registry,
            prefetch=1,
            retry_delays=(0.05,),
            max_attempts=3,
            handler_timeout=0.3,
        )
        runs: list[int] = []
        returned: list[bool] = []
        cancelled: list[int] = []

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            runs.append(delivery.attempt)
            if delivery.attempt > 1:
                return
            proxy.set_stall(True)  # the copy's confirm cannot come back before the deadline
            asyncio.get_running_loop().call_later(0.8, proxy.set_stall, False)
            returned.append(await delivery.retry("slow link"))
            try:
                await asyncio.sleep(30)  # past the deadline
            except asyncio.CancelledError:
                cancelled.append(delivery.attempt)
                raise

        env.track(consumer)
        async with consumer:
            await env.publish([b"x"], ids=["slow"])
            await wait_until(lambda: runs == [1, 2], timeout=10, what="the retry copy handled")
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            stats = consumer.stats()
        assert returned == [True]
        assert cancelled == [1]
        assert (stats.retried, stats.requeued, stats.duplicates, stats.acked) == (1, 0, 0, 1)
        assert await drain(env.queue) == []


class TestSwallowedCancel:
    async def test_a_swallowed_cancel_of_a_dead_channel_is_not_a_success(
        self, env: Env, proxy: TCPProxy
    ) -> None:
        """The link is cut while the handler runs; it swallows the cancel and returns:
        with dedup on (the default) the redelivery still runs; nothing is lost."""
        consumer = ReliableConsumer(
            ConnectionSettings(
                url=SecretStr(proxied_url(proxy)),
                connection_name=env.queue,
                reconnect_initial_delay=0.05,
            ),
            registry=env.registry,
            prefetch=5,
            retry_delays=(0.05,),
            handler_timeout=30.0,
        )
        runs: list[tuple[int, bool]] = []
        done: list[bool] = []
        running = asyncio.Event()

        @consumer.handler(env.queue)
        async def handler(delivery: Delivery) -> None:
            runs.append((delivery.attempt, delivery.redelivered))
            if len(runs) == 1:
                running.set()
                try:
                    await asyncio.sleep(30)
                except asyncio.CancelledError:
                    return  # swallowed: the work was not done
            done.append(delivery.redelivered)

        env.track(consumer)
        async with consumer:
            assert consumer.dedup is not None
            await env.publish([b"x"], ids=["cut"])
            await asyncio.wait_for(running.wait(), 10)
            assert await proxy.cut() > 0
            await wait_until(lambda: done == [True], timeout=10, what="the redelivery handled")
            await wait_until(lambda: consumer.stats().in_progress == 0, timeout=10, what="settled")
            stats = consumer.stats()
        assert runs == [(1, False), (1, True)]
        assert (stats.duplicates, stats.stale, stats.acked, stats.channel_reopens) == (0, 1, 1, 1)
        assert await drain(env.queue) == []


_SCRIPT = """
import asyncio, sys
from pydantic import SecretStr
from reliable_mq import ConnectionSettings
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.delivery import Delivery

url, queue, out, kind = sys.argv[1:5]
consumer = ReliableConsumer(
    ConnectionSettings(url=SecretStr(url), connection_name="test-exits"),
    prefetch=1, max_attempts=2, retry_delays=(0.05,), shutdown_grace=5,
)

@consumer.handler(queue)
async def handler(delivery: Delivery) -> None:
    with open(out, "a") as f:
        f.write(f"{delivery.message_id} {delivery.attempt}\\n")
    if delivery.message_id == "bad":
        raise SystemExit(3) if kind == "exit" else KeyboardInterrupt()

asyncio.run(consumer.run())
"""


class TestExit:
    @pytest.mark.parametrize("kind", ["exit", "interrupt"])
    async def test_exit_counts_an_attempt_and_ends_the_process(
        self, env: Env, tmp_path: Path, kind: str
    ) -> None:
        """SystemExit/KeyboardInterrupt: the process exits each time, the delivery is a
        failed attempt; after max_attempts (2) it is in the DLQ and the crash loop is over."""
        out = tmp_path / "runs.txt"
        script = tmp_path / "consume.py"
        script.write_text(textwrap.dedent(_SCRIPT))
        probe = env.consumer(**FAST)  # the topology's names, and its cleanup

        @probe.handler(env.queue)
        async def unused(delivery: Delivery) -> None: ...

        env.track(probe)
        async with probe:  # declares the topology the script uses
            pass
        await env.publish([b"x", b"1", b"2", b"3"], ids=["bad", "g1", "g2", "g3"])
        codes: list[int | None] = []
        errors: list[str] = []
        for _ in range(2):
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                str(script),
                URL,
                env.queue,
                str(out),
                kind,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            _, stderr = await asyncio.wait_for(process.communicate(), 30)
            codes.append(process.returncode)
            errors.append(stderr.decode(errors="replace")[-3000:])
        expected = 3 if kind == "exit" else -signal.SIGINT
        assert codes == [expected, expected], errors
        runs = out.read_text().split()
        pairs = list(zip(runs[::2], runs[1::2], strict=True))
        assert [a for m, a in pairs if m == "bad"] == ["1", "2"]  # one attempt per process
        assert sorted(m for m, _ in pairs if m != "bad") == ["g1", "g2", "g3"]  # each once
        dead = {m.message_id: dict(m.headers) for m in await drain(f"{env.queue}.dlq")}
        assert list(dead) == ["bad"]
        assert dead["bad"][REASON_HEADER] == "max_attempts"
        assert dead["bad"][ERROR_TYPE_HEADER] == (
            "SystemExit" if kind == "exit" else "KeyboardInterrupt"
        )
        assert dead["bad"][ATTEMPTS_HEADER] == 2
        assert await drain(env.queue) == []
        assert await drain(f"{env.queue}.retry.0.05s") == []
