"""Consume throughput: aio-pika, pika and ReliableConsumer side by side, in one run.

For each mode a durable queue is pre-filled with persistent messages (not
timed), then drained; the rate is measured from the first delivery to the last
one handled. Modes run one after another, round after round (interleaved), and
the table shows medians: the rate, its ratio against aio-pika with auto-ack
and against pika with auto-ack from the same run, and CPU per delivery of this
process (client) and of the broker (the process listening on the broker's port,
read from /proc; "n/a" where it cannot be read), both over the same window.

The default modes:

* aio-pika ``queue.consume(callback, no_ack=True)``: auto-ack, the baseline
  (not loss-proof: a crash loses what was delivered);
* aio-pika ``queue.consume(callback)`` with ``message.ack()`` per message;
* pika ``BlockingConnection`` ``basic_consume(auto_ack=True)`` (in a thread);
* pika ``BlockingConnection`` with manual acks, ``basic_ack(multiple=True)``
  every 50th delivery, at prefetch 300 whatever ``--prefetch`` says: the same
  safety as reliable_mq's batched acks (issue 22's reference);
* reliable_mq with its defaults: batched acks, in-memory de-duplication;
* reliable_mq without de-duplication (``dedup=None``);
* reliable_mq with a no-op batch handler (``max_size`` 100, or the prefetch if
  lower; default de-duplication).

After the table, each reliable_mq mode's rate over pika-with-batched-acks' of
the same round, round by round (median, min, max): the machine's speed drifts
between rounds, and a ratio within a round cancels most of that drift.

``--all`` adds: aio-pika acking ``multiple=true`` every 50th delivery (a
reference ceiling for manual acks), reliable_mq with one ack frame per
message, and reliable_mq de-duplicating in SQLite (a file in a temporary
directory) and in Redis (``RELIABLE_MQ_BENCH_REDIS``, default
``redis://127.0.0.1:6379/0``; skipped when Redis does not answer). Every
message has its own id, so the de-duplication rows measure claim + complete per
message, not skipping.

    .venv/bin/python bench/consume.py                          # 20,000 per mode, 3 rounds
    .venv/bin/python bench/consume.py --messages 2000 --rounds 1   # a quick check
    .venv/bin/python bench/consume.py --all --json consume.json

``--tracing`` adds, for the two default reliable_mq modes, three rows measured
in a fresh child process each, interleaved with the others round by round:
opentelemetry not importable, the API without an SDK (the default), and an SDK
sampling everything into a no-op exporter through a ``BatchSpanProcessor``
(see ``bench/_tracing_modes.py``). Without it the run is the same as before.

    .venv/bin/python bench/consume.py --tracing --rounds 5

It prints which reliable_mq it imported (path and commit) and records it in the
JSON with ``--label``; with ``PYTHONPATH`` pointing at an older reliable_mq it
measures that one (see docs/performance.md, "Reproduce").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import tempfile
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import _provenance
import _tracing_modes
import aio_pika
import aiormq
import pika
from aio_pika.abc import AbstractIncomingMessage
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry

import reliable_mq
from reliable_mq.consumer import ReliableConsumer
from reliable_mq.dedup import DedupStore, SQLiteDedupStore
from reliable_mq.topology import QueueTopology, declare_topology, delete_topology

URL = os.environ.get("RELIABLE_MQ_BENCH_URL", "amqp://guest:guest@127.0.0.1:5672/")
REDIS_URL = os.environ.get("RELIABLE_MQ_BENCH_REDIS", "redis://127.0.0.1:6379/0")

AIO_AUTO = "aio-pika auto-ack"
PIKA_AUTO = "pika BlockingConnection auto-ack"
PIKA_BATCHED = "pika acks every 50, prefetch 300"
PIKA_BATCHED_PREFETCH = 300
RMQ_BATCH = "reliable_mq batch handler (max_size 100)"
BATCH_MAX_SIZE = 100
RMQ_DEFAULTS = "reliable_mq defaults (dedup memory)"
RMQ_NO_DEDUP = "reliable_mq, dedup off"
TRACED = [RMQ_DEFAULTS, RMQ_NO_DEDUP]
"""The modes ``--tracing`` measures in each tracing set-up."""

TRACER_PROVIDER: object | None = None
"""Set in a ``--child sdk`` process only: the SDK provider every ReliableConsumer gets."""


def broker_pid() -> int | None:
    """The pid of the process listening on the broker's AMQP port (ss needs no root for it)."""
    port = URL.rsplit(":", 1)[-1].split("/", 1)[0] or "5672"
    with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
        listing = subprocess.run(
            ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, check=False
        ).stdout
        for part in listing.split("pid=")[1:]:
            return int(part.split(",", 1)[0])
    return None


BROKER_PID = broker_pid()


def broker_cpu_seconds() -> float | None:
    """CPU seconds used so far by the broker process (None if it cannot be read)."""
    if BROKER_PID is None:
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open(f"/proc/{BROKER_PID}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return None


@dataclass
class Sample:
    rate: float
    client_us: float
    broker_us: float | None


class Clock:
    """First-to-last delivery timing, CPU of this process and of the broker included.

    ``tick`` may be called from another thread (pika); ``done`` is then set
    through the loop.
    """

    def __init__(self, expected: int) -> None:
        self.expected = expected
        self.count = 0
        self.first = self.last = 0.0
        self.cpu_first = self.cpu_last = 0.0
        self.broker_first: float | None = None
        self.broker_last: float | None = None
        self.done = asyncio.Event()
        self._loop = asyncio.get_running_loop()

    def tick(self) -> None:
        if not self.count:
            self.first = time.perf_counter()
            self.cpu_first = time.process_time()
            self.broker_first = broker_cpu_seconds()
        self.count += 1
        if self.count == self.expected:
            self.last = time.perf_counter()
            self.cpu_last = time.process_time()
            self.broker_last = broker_cpu_seconds()
            if threading.current_thread() is threading.main_thread():
                self.done.set()
            else:
                self._loop.call_soon_threadsafe(self.done.set)

    def sample(self) -> Sample:
        deliveries = max(self.count - 1, 1)
        broker = None
        if self.broker_first is not None and self.broker_last is not None:
            broker = 1e6 * (self.broker_last - self.broker_first) / deliveries
        return Sample(
            rate=deliveries / (self.last - self.first),
            client_us=1e6 * (self.cpu_last - self.cpu_first) / deliveries,
            broker_us=broker,
        )


async def prefill(queue: str, count: int, size: int, arguments: dict[str, Any]) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        await channel.declare_queue(queue, durable=True, arguments=arguments)
        raw = cast(aiormq.Channel, await channel.get_underlay_channel())
        body = os.urandom(size // 2).hex().encode()[:size]
        for start in range(0, count, 1000):
            await asyncio.gather(
                *(
                    raw.basic_publish(
                        body,
                        routing_key=queue,
                        properties=Basic.Properties(
                            delivery_mode=2,
                            content_type="application/octet-stream",
                            message_id=f"m{start + i}",
                        ),
                    )
                    for i in range(min(1000, count - start))
                )
            )
    finally:
        await connection.close()


Runner = Callable[[str, Clock, int], Awaitable[None]]


async def aio_pika_consume(queue: str, clock: Clock, prefetch: int, *, ack: str) -> None:
    connection = await aio_pika.connect(URL)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        amqp_queue = await channel.get_queue(queue)
        seen = 0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal seen
            seen += 1
            if ack == "each":
                await message.ack()
            elif ack == "every-50" and (seen % 50 == 0 or seen == clock.expected):
                await message.ack(multiple=True)
            clock.tick()

        await amqp_queue.consume(on_message, no_ack=ack == "auto")
        await clock.done.wait()
    finally:
        await connection.close()


async def aio_auto(queue: str, clock: Clock, prefetch: int) -> None:
    await aio_pika_consume(queue, clock, prefetch, ack="auto")


async def aio_manual(queue: str, clock: Clock, prefetch: int) -> None:
    await aio_pika_consume(queue, clock, prefetch, ack="each")


async def aio_multiple(queue: str, clock: Clock, prefetch: int) -> None:
    await aio_pika_consume(queue, clock, prefetch, ack="every-50")


async def pika_consume(queue: str, clock: Clock, prefetch: int, *, ack_every: int) -> None:
    """pika's BlockingConnection in a thread: auto-ack (``ack_every=0``) or acks every n-th."""

    def run() -> None:
        connection = pika.BlockingConnection(pika.URLParameters(URL))
        try:
            channel = connection.channel()
            channel.basic_qos(prefetch_count=prefetch)

            def on_message(ch: Any, method: Any, properties: Any, body: bytes) -> None:
                last = clock.count + 1 >= clock.expected
                if ack_every and (last or (clock.count + 1) % ack_every == 0):
                    ch.basic_ack(method.delivery_tag, multiple=True)
                clock.tick()
                if last:
                    ch.stop_consuming()

            channel.basic_consume(queue, on_message, auto_ack=not ack_every)
            channel.start_consuming()
        finally:
            connection.close()

    await asyncio.to_thread(run)
    await clock.done.wait()


async def pika_auto(queue: str, clock: Clock, prefetch: int) -> None:
    """pika's BlockingConnection, basic_consume with auto_ack, in a thread."""
    await pika_consume(queue, clock, prefetch, ack_every=0)


async def pika_batched(queue: str, clock: Clock, prefetch: int) -> None:
    """pika with manual acks, ``multiple=True`` every 50th, at prefetch 300 (issue 22)."""
    await pika_consume(queue, clock, PIKA_BATCHED_PREFETCH, ack_every=50)


class Unavailable(Exception):
    """A mode's dependency (Redis) is not there: skip the mode."""


async def make_store(kind: str, tmp: str) -> DedupStore | str | None:
    if kind == "off":
        return None
    if kind == "memory":
        return "memory"
    if kind == "sqlite":
        return SQLiteDedupStore(os.path.join(tmp, f"dedup-{uuid.uuid4().hex[:8]}.db"))
    try:
        from reliable_mq.dedup.redis import RedisDedupStore  # noqa: PLC0415 (optional extra)
    except ImportError as exc:
        raise Unavailable(str(exc)) from None
    store = RedisDedupStore(REDIS_URL, prefix=f"reliable_mq:bench:{uuid.uuid4().hex}:")
    try:
        await store.claim("ping", owner="bench", lease=1)
        await store.release("ping", owner="bench")
    except Exception as exc:
        await store.close()
        raise Unavailable(f"Redis at {REDIS_URL}: {exc}") from None
    return store


def reliable(dedup: str = "memory", *, batch_ack: bool = True, batches: bool = False) -> Runner:
    async def run(queue: str, clock: Clock, prefetch: int) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            store = await make_store(dedup, tmp)
            traced = {"tracer_provider": TRACER_PROVIDER} if TRACER_PROVIDER is not None else {}
            consumer = ReliableConsumer(
                URL,
                prefetch=prefetch,
                batch_ack=batch_ack,
                registry=CollectorRegistry(),
                dedup=store,  # type: ignore[arg-type]
                **traced,
            )

            if batches:

                async def many(bodies: list[bytes]) -> None:
                    for _ in bodies:
                        clock.tick()

                size = min(BATCH_MAX_SIZE, prefetch) if prefetch else BATCH_MAX_SIZE
                consumer.add_batch_handler(queue, many, max_size=size)
            else:

                async def handler(body: bytes) -> None:
                    clock.tick()

                consumer.add_handler(queue, handler)

            try:
                async with consumer:
                    await clock.done.wait()
            finally:
                if store is not None and not isinstance(store, str):
                    await store.close()

    return run


# name: (runner, uses the reliable_mq topology, shown without --all)
MODES: dict[str, tuple[Runner, bool, bool]] = {
    AIO_AUTO: (aio_auto, False, True),
    "aio-pika manual ack per message": (aio_manual, False, True),
    PIKA_AUTO: (pika_auto, False, True),
    PIKA_BATCHED: (pika_batched, False, True),
    RMQ_DEFAULTS: (reliable("memory"), True, True),
    RMQ_NO_DEDUP: (reliable("off"), True, True),
    RMQ_BATCH: (reliable("memory", batches=True), True, True),
    "aio-pika ack multiple every 50 (ref)": (aio_multiple, False, False),
    "reliable_mq, ack per message, no dedup": (reliable("off", batch_ack=False), True, False),
    "reliable_mq, dedup SQLite": (reliable("sqlite"), True, False),
    "reliable_mq, dedup Redis": (reliable("redis"), True, False),
}


def _paired_ratios(samples: dict[str, list[Sample]], reference: str) -> dict[str, list[float]]:
    """Each reliable_mq mode's rate over ``reference``'s in the same round, round by round.

    The machine's speed drifts between rounds; a ratio taken within a round
    cancels most of that drift, which a ratio of medians does not. Modes with a
    round missing (skipped) are left out.
    """
    base = samples.get(reference) or []
    return {
        name: [mine.rate / theirs.rate for mine, theirs in zip(found, base, strict=True)]
        for name, found in samples.items()
        if name.startswith("reliable_mq") and found and len(found) == len(base)
    }


def _print_paired(samples: dict[str, list[Sample]], rows: list[dict[str, Any]], width: int) -> None:
    """Print (and add to ``rows``) the round-by-round ratios against pika with batched acks."""
    paired = _paired_ratios(samples, PIKA_BATCHED)
    if not paired:
        return
    print(f"\nround by round, each rate over {PIKA_BATCHED!r} of the same round:")
    for name, ratios in paired.items():
        print(
            f"  {name:<{width}} median {statistics.median(ratios):.2f}x "
            f"(min {min(ratios):.2f}x, max {max(ratios):.2f}x, {len(ratios)} rounds)"
        )
    for row in rows:
        if row["mode"] in paired:
            row["vs_pika_batched_by_round"] = paired[row["mode"]]


async def measure(name: str, count: int, prefetch: int, size: int) -> Sample:
    runner, managed, _ = MODES[name]
    queue = f"bench-consume-{uuid.uuid4().hex[:8]}"
    topology = QueueTopology(queue)
    arguments: dict[str, Any] = dict(topology.work_queue_arguments()) if managed else {}
    if managed:
        connection = await aio_pika.connect(URL)
        await declare_topology(await connection.channel(), topology)
        await connection.close()
    await prefill(queue, count, size, arguments)
    try:
        clock = Clock(count)
        await runner(queue, clock, prefetch)
        return clock.sample()
    finally:
        connection = await aio_pika.connect(URL)
        channel = await connection.channel()
        if managed:
            await delete_topology(channel, topology)
        else:
            await channel.queue_delete(queue)
        await connection.close()


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


async def child(args: argparse.Namespace) -> None:
    """One measurement of ``args.variant`` in tracing mode ``args.child`` (see ``--tracing``)."""
    global TRACER_PROVIDER  # noqa: PLW0603 - this process measures one set-up
    _tracing_modes.check_mode(args.child)
    TRACER_PROVIDER = _tracing_modes.provider(args.child)
    sample = await measure(args.variant, args.messages, args.prefetch, args.size)
    _tracing_modes.emit(sample.__dict__, args.messages, TRACER_PROVIDER)


def _child_argv(args: argparse.Namespace) -> list[str]:
    return [
        *("--messages", str(args.messages), "--prefetch", str(args.prefetch)),
        *("--size", str(args.size)),
        *(["--uvloop"] if args.uvloop else []),
    ]


async def _traced_round(
    args: argparse.Namespace, round_no: int, samples: dict[str, list[Sample]]
) -> None:
    """Each traced mode in each tracing set-up, in a child process; the set-ups' order
    turns round by round, so no set-up always runs first."""
    modes = _tracing_modes.MODES[round_no % 3 :] + _tracing_modes.MODES[: round_no % 3]
    for name in TRACED:
        for mode in modes:
            found = await asyncio.to_thread(
                _tracing_modes.run_child, __file__, mode, name, _child_argv(args)
            )
            spans = found.pop("spans_per_message")
            row = _tracing_modes.row_name(name, mode)
            samples.setdefault(row, []).append(Sample(**found))
            print(
                f"round {round_no + 1}: {row:<72} {found['rate']:>9,.0f} msgs/s "
                f"{found['client_us']:>6.1f} us client CPU/msg, {spans:.2f} spans/msg",
                flush=True,
            )


async def main(args: argparse.Namespace) -> None:
    if args.child:
        await child(args)
        return
    origin = _provenance.origin(reliable_mq, args.label)
    print(_provenance.describe(origin), flush=True)
    names = [name for name, (_, _, default) in MODES.items() if default or args.all]
    if args.only:
        keep = (AIO_AUTO, PIKA_AUTO, PIKA_BATCHED)  # the references every table shows
        names = [n for n in MODES if n in keep or any(part in n for part in args.only)]
    samples: dict[str, list[Sample]] = {name: [] for name in names}
    skipped: dict[str, str] = {}
    load_before = os.getloadavg()
    for round_no in range(args.rounds):
        for name in names:
            if name in skipped:
                continue
            try:
                sample = await measure(name, args.messages, args.prefetch, args.size)
            except Unavailable as exc:
                skipped[name] = str(exc)
                print(f"skipped {name}: {exc}", flush=True)
                continue
            samples[name].append(sample)
            print(
                f"round {round_no + 1}: {name:<40} {sample.rate:>9,.0f} msgs/s "
                f"{sample.client_us:>6.1f} us client CPU/msg",
                flush=True,
            )
        if args.tracing:
            await _traced_round(args, round_no, samples)
    names = list(samples)

    rates = {n: statistics.median(s.rate for s in found) for n, found in samples.items() if found}
    auto, pik = rates[AIO_AUTO], rates[PIKA_AUTO]
    load_after = os.getloadavg()
    loop_name = type(asyncio.get_running_loop()).__module__.split(".")[0]
    print()
    print(
        f"consume: {args.messages:,} persistent {args.size}-byte messages per mode, prefetch "
        f"{args.prefetch}, {args.rounds} interleaved round(s), medians; loop: {loop_name}; "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after "
        f"({os.cpu_count()} CPUs)\n{_provenance.describe(origin)}"
    )
    width = max(40, *(len(name) for name in names))
    header = (
        f"{'mode':<{width}} {'msgs/s':>9} {'vs aio-pika auto':>17} {'vs pika auto':>13} "
        f"{'client µs/msg':>14} {'broker µs/msg':>14}"
    )
    print(header)
    print("-" * len(header))
    rows = []
    for name in names:
        found = samples[name]
        if not found:
            print(f"{name:<{width}} skipped: {skipped.get(name, 'no data')}")
            continue
        rate = rates[name]
        client = _median([s.client_us for s in found])
        broker = _median([s.broker_us for s in found])
        broker_text = f"{broker:>14.1f}" if broker is not None else f"{'n/a':>14}"
        print(
            f"{name:<{width}} {rate:>9,.0f} {rate / auto:>16.2f}x {rate / pik:>12.2f}x "
            f"{client or 0:>14.1f} {broker_text}"
        )
        rows.append(
            {
                "mode": name,
                "rate": rate,
                "vs_aio_pika_auto": rate / auto,
                "vs_pika_auto": rate / pik,
                "client_us": client,
                "broker_us": broker,
                "rounds": [s.__dict__ for s in found],
                "spans_per_message": _tracing_modes.spans_per_message(name),
            }
        )
    _print_paired(samples, rows, width)
    if args.tracing:
        client_us = {row["mode"]: row["client_us"] for row in rows}
        print("\n".join(_tracing_modes.summary(TRACED, client_us, "client CPU", "µs/msg")))
        print("\n".join(_tracing_modes.summary(TRACED, rates, "rate", "msgs/s")))
        per_round = {row: [s.client_us for s in found] for row, found in samples.items()}
        print("\n".join(_tracing_modes.paired(TRACED, per_round, "client CPU")))
    if args.json:
        with open(args.json, "w") as out:  # noqa: ASYNC230 - once, after the measurements
            json.dump(
                {
                    "bench": "consume",
                    "label": origin["label"],
                    "reliable_mq": origin,
                    "messages": args.messages,
                    "prefetch": args.prefetch,
                    "size": args.size,
                    "rounds": args.rounds,
                    "loop": loop_name,
                    "rows": rows,
                },
                out,
                indent=2,
            )


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--messages", type=int, default=20_000)
    parser.add_argument(
        "--prefetch", type=int, default=200, help="basic.qos (reliable_mq's default)"
    )
    parser.add_argument("--size", type=int, default=256, help="body bytes")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians")
    parser.add_argument(
        "--all", action="store_true", help="also the reference and dedup-store rows"
    )
    parser.add_argument(
        "--only",
        action="append",
        help="only the modes whose name contains this text (repeat for more), "
        "besides the aio-pika and pika references",
    )
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop (if installed)")
    parser.add_argument("--label", help="a name for this run in the JSON (default: the commit)")
    parser.add_argument("--json", help="also write the medians to this file")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="also the default reliable_mq modes without opentelemetry, with the API only, "
        "and with an SDK sampling everything, each in a child process",
    )
    parser.add_argument("--child", choices=_tracing_modes.MODES, help=argparse.SUPPRESS)
    parser.add_argument("--variant", choices=list(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.uvloop:
        import uvloop  # noqa: PLC0415 - optional

        uvloop.run(main(args))
    else:
        asyncio.run(main(args))


if __name__ == "__main__":
    cli()
