#!/usr/bin/env python3
"""Mutation testing for the pure codec and bookkeeping modules: do the tests catch real bugs?

Each mutant below is one small, plausible bug (a bound off by one, a check
dropped, a branch taken the wrong way) in the publish codec
(``reliable_mq/_amqp/wire.py``), the consumer's frame decoder
(``_amqp/inbound.py``), the publisher's window (``_publish/window.py``), the
fault classifier (``_amqp/faults.py``), and the pure trackers
(``_publish/confirms.py``, ``_consume/acks.py``, ``_consume/settle.py``). For
each one the script copies the package and its tests to a temporary directory,
replaces the mutant's exact snippet (it must occur exactly once: when the code
changes and a snippet no longer matches, the script fails before running
anything, so the list cannot silently go stale), and runs the unit tests mapped
to that module, broker tests deselected. A failing run kills the mutant; a
passing run lets it survive. A run past the time box counts as killed (the
mutant made a test hang) and is marked so.

Usage (from the repository root, with the project's virtualenv)::

    python scripts/mutate.py                    # every mutant, against this checkout
    python scripts/mutate.py --repo /tmp/mbase  # the same mutants against another checkout
    python scripts/mutate.py --only wire-int16-bound inbound-second-flag-word
    python scripts/mutate.py --list             # names and descriptions, nothing run
    python scripts/mutate.py --check            # only check every snippet applies once
    python scripts/mutate.py -v                 # name the test that killed each mutant

Prints one row per mutant and the score: killed / (mutants - equivalent).
Exit code 0 when every mutant is killed or listed as equivalent (with the
reason it cannot be killed); 1 when any other mutant survives (or a run
errors); 2 when a snippet does not apply exactly once or the unmutated tests
fail.

Runs one mutant at a time (``--jobs`` for more), each in a fresh copy: the
checkout itself is never modified. A mapped test file or class the checkout
lacks (an older commit, scored with ``--repo`` to measure the tests before new
ones) is left out of the runs, and the script says so.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

NO_BROKER = "not rabbitmq and not private_broker and not redis and not spark and not slow"
"""The marker expression: only tests that need no broker or other service."""

WIRE = "reliable_mq/_amqp/wire.py"
INBOUND = "reliable_mq/_amqp/inbound.py"
PLAIN = "reliable_mq/_amqp/plain.py"
WINDOW = "reliable_mq/_publish/window.py"
FAULTS = "reliable_mq/_amqp/faults.py"
CONFIRMS = "reliable_mq/_publish/confirms.py"
ACKS = "reliable_mq/_consume/acks.py"
SETTLE = "reliable_mq/_consume/settle.py"

TESTS: dict[str, tuple[str, ...]] = {
    WIRE: ("tests/amqp/test_wire.py",),
    INBOUND: (
        "tests/consume/test_consumer_fast_path.py::TestDecodeFrame",
        "tests/consume/test_consumer_fast_path.py::TestUndecodable",
        "tests/consume/test_consumer_fast_path.py::TestHeaderEdges",
    ),
    PLAIN: (
        "tests/consume/test_consumer_fast_path.py::TestDecodeFrame",
        "tests/consume/test_consumer_fast_path.py::TestHeaderEdges",
    ),
    WINDOW: ("tests/publish/test_window.py",),
    FAULTS: ("tests/amqp/test_amqp_faults.py",),
    CONFIRMS: (
        "tests/amqp/test_wire.py::TestConfirmTracker",
        "tests/amqp/test_wire.py::TestConfirmTrackerModel",
    ),
    ACKS: ("tests/consume/test_acks.py", "tests/consume/test_lost_acks.py"),
    SETTLE: ("tests/consume/test_settle.py",),
}
"""The unit tests run for a mutant of each module."""


@dataclass(frozen=True)
class Mutant:
    """One bug: ``original`` (exactly once in ``path``) replaced by ``replacement``."""

    name: str
    path: str
    original: str
    replacement: str
    description: str
    equivalent: str = ""
    """Why no test can kill it (it changes no behaviour), if so."""


MUTANTS: tuple[Mutant, ...] = (
    # -- wire.py: the publish codec ---------------------------------------------------
    Mutant(
        "wire-frame-overhead",
        WIRE,
        "FRAME_OVERHEAD = 8\n",
        "FRAME_OVERHEAD = 7\n",
        "body frames one byte over frame_max",
    ),
    Mutant(
        "wire-body-range",
        WIRE,
        "for start in range(0, size, chunk):",
        "for start in range(0, size - 1, chunk):",
        "a body of k*chunk+1 bytes loses its last byte",
    ),
    Mutant(
        "wire-one-frame-boundary",
        WIRE,
        "if size <= chunk:",
        "if size < chunk:",
        "a body of exactly one chunk takes the splitting branch",
        equivalent="the splitting loop makes the same single frame for size == chunk",
    ),
    Mutant(
        "wire-empty-body-frame",
        WIRE,
        "        if size:\n            parts +=",
        "        if True:\n            parts +=",
        "an empty body is sent as an empty body frame (a frame error)",
    ),
    Mutant(
        "wire-shortstr-gt",
        WIRE,
        "if len(data) > limit:",
        "if len(data) >= limit:",
        "a short string of exactly 255 bytes (a header name of 128) refused",
    ),
    Mutant(
        "wire-shortstr-limit",
        WIRE,
        "limit: int = 255",
        "limit: int = 256",
        "a 256-byte short string accepted (the length octet wraps)",
    ),
    Mutant(
        "wire-header-name-limit",
        WIRE,
        "_MAX_KEY = 128",
        "_MAX_KEY = 127",
        "a 128-byte header name refused",
    ),
    Mutant(
        "wire-bool-as-int",
        WIRE,
        "if kind is bool:",
        "if kind is None:",
        "bool header values sent as int8 ('b'), not 't'",
    ),
    Mutant(
        "wire-int8-bound",
        WIRE,
        "if -128 <= value <= 127:",
        "if -128 <= value <= 128:",
        "128 packed as int8: struct.error",
    ),
    Mutant(
        "wire-int16-bound",
        WIRE,
        "if -32768 <= value <= 32767:",
        "if -32768 <= value <= 32768:",
        "32768 packed as int16: struct.error instead of a wider type",
    ),
    Mutant(
        "wire-int32-bound",
        WIRE,
        "if -2_147_483_648 <= value <= 2_147_483_647:",
        "if -2_147_483_649 <= value <= 2_147_483_647:",
        "-2**31 - 1 packed as int32: struct.error",
    ),
    Mutant(
        "wire-int64-bound",
        WIRE,
        "if -(2**63) <= value < 2**63:",
        "if -(2**63) <= value <= 2**63:",
        "2**63 gives struct.error, not InvalidMessage",
    ),
    Mutant(
        "wire-float-narrowed",
        WIRE,
        'return b"d" + _F64(value)',
        'return b"f" + struct.pack(">f", value)',
        "float headers narrowed to 32 bits",
    ),
    Mutant(
        "wire-depth",
        WIRE,
        "    if depth > _MAX_DEPTH:\n",
        "    if depth > _MAX_DEPTH + 1:\n",
        "tables nested one level deeper than the limit accepted",
    ),
    Mutant(
        "wire-before-1970",
        WIRE,
        "if seconds < 0:",
        "if seconds < -1:",
        "the last second of 1969 encoded as 2**64 - 1",
    ),
    Mutant(
        "wire-expiration-limit",
        WIRE,
        "if ms > MAX_EXPIRATION_MS:",
        "if ms >= MAX_EXPIRATION_MS:",
        "the broker's largest TTL refused",
    ),
    Mutant(
        "wire-priority",
        WIRE,
        "not 0 <= priority <= 255",
        "not 0 <= priority <= 256",
        "priority 256 accepted (bytes() raises ValueError)",
    ),
    Mutant(
        "wire-mandatory",
        WIRE,
        'b"\\x01" if mandatory else b"\\x00"',
        'b"\\x00" if mandatory else b"\\x01"',
        "the mandatory bit inverted",
    ),
    Mutant(
        "wire-cluster-id-flag",
        WIRE,
        "_CLUSTER_ID = 1 << 2",
        "_CLUSTER_ID = 1 << 1",
        "cluster_id under the wrong flag bit",
    ),
    # -- inbound.py: the consumer's frame decoder -------------------------------------
    Mutant(
        "inbound-second-flag-word",
        INBOUND,
        "    if flags & 1:\n        return None",
        "    if flags & 0:\n        return None",
        "a second property-flag word ignored: properties read from the wrong offset",
    ),
    Mutant(
        "inbound-escaped-table-overrun",
        INBOUND,
        'raise ValueError("field table overruns its length")',
        "pass",
        "a damaged table in an undecodable header read on as garbage, dead-lettered",
    ),
    Mutant(
        "inbound-escaped-array-overrun",
        INBOUND,
        'raise ValueError("field array overruns its length")',
        "pass",
        "a damaged array in an undecodable header read on as garbage, dead-lettered",
    ),
    Mutant(
        "inbound-escaped-table-past-end",
        INBOUND,
        'raise ValueError("field table past the end of the frame")',
        "pass",
        "an undecodable header whose table runs past the frame end decoded anyway",
        equivalent=(
            "redundant: the table's loop cannot reach an end past the frame without reading "
            "there, and every field read past the frame raises (IndexError, struct.error)"
        ),
    ),
    Mutant(
        "inbound-escaped-string-past-end",
        INBOUND,
        '            raise ValueError("short string past the end of the frame")\n        raw =',
        "            pass\n        raw =",
        "an escaped string running past the frame end cut short, not refused",
        equivalent=(
            "redundant: the next field then reads past the end and fails, or, for the "
            "last field, _read_header's final offset check refuses the frame"
        ),
    ),
    Mutant(
        "inbound-header-past-end",
        INBOUND,
        "if offset > len(data):",
        "if offset > len(data) + 1:",
        "a content header that ends past its frame accepted",
        equivalent=(
            "redundant: every field reader refuses to read past the end (short strings, "
            "tables and timestamps check, an octet past the end raises IndexError)"
        ),
    ),
    Mutant(
        "inbound-escaped-noted-nothing",
        INBOUND,
        "if header is None or undecodable is None:",
        "if header is None:",
        "a header the strict reader refused but nothing undecodable in it: escaped anyway",
        equivalent=(
            "the escaping reader refuses all the damage the strict one does (the same checks; "
            "a name past its table is an overrun there), so where the strict reader raised "
            "it either raises too or has noted a string or timestamp"
        ),
    ),
    Mutant(
        "inbound-redelivered-bit",
        INBOUND,
        "bool(data[offset + 8] & 1)",
        "bool(data[offset + 8] & 2)",
        "the redelivered bit read from the wrong place",
    ),
    Mutant(
        "inbound-cluster-id-default",
        INBOUND,
        'value = "" if name == "cluster_id" else None',
        "value = None",
        "an absent cluster_id None, where pamqp gives ''",
    ),
    Mutant(
        "inbound-whole-header-past-end",
        INBOUND,
        "return None if end > body_at - 1 else",
        "return None if end > body_at else",
        "the direct path takes a delivery whose properties read its header's frame-end byte",
    ),
    # -- plain.py: the hot path's decoder of deliveries -------------------------------
    Mutant(
        "plain-second-flag-word",
        PLAIN,
        "FLAG_WORDS = 1\n",
        "FLAG_WORDS = 0\n",
        "a second property-flag word ignored: properties read from the wrong offset",
    ),
    Mutant(
        "plain-redelivered-bit",
        PLAIN,
        "bool(bits & 1)",
        "bool(bits & 2)",
        "the redelivered bit read from the wrong place",
    ),
    Mutant(
        "plain-cluster-id-default",
        PLAIN,
        'properties.cluster_id = ""',
        "properties.cluster_id = None",
        "an absent cluster_id None, where pamqp gives ''",
    ),
    Mutant(
        "plain-timestamp-width",
        PLAIN,
        "        offset += 8\n",
        "        offset += 4\n",
        "the properties after a timestamp read from the wrong offset",
    ),
    Mutant(
        "plain-reply-to-flag",
        PLAIN,
        "if flags & 0x0200:",
        "if flags & 0x0100:",
        "reply_to read under expiration's flag bit",
    ),
    # -- window.py: the publisher's in-flight window ----------------------------------
    Mutant(
        "window-cancel-after-handoff",
        WINDOW,
        "self.release()  # we were handed a slot",
        "pass  # we were handed a slot",
        "a waiter cancelled right after being handed a slot keeps it: the window shrinks",
    ),
    Mutant(
        "window-sweep-forgets-deadlines",
        WINDOW,
        "earliest = min(earliest, deadline)",
        "pass",
        "a sweep forgets the deadlines of waiters still queued: they wait past them",
    ),
    Mutant(
        "window-deadline-boundary",
        WINDOW,
        "if deadline <= now:",
        "if deadline < now:",
        "a waiter whose deadline is exactly now is not failed",
    ),
    Mutant(
        "window-sweep-early-return",
        WINDOW,
        "if now < self._earliest:",
        "if now <= self._earliest:",
        "the sweep skips the instant of the earliest deadline",
    ),
    Mutant(
        "window-lifo",
        WINDOW,
        "waiter, _ = waiters.popleft()\n            if not waiter.done():\n                waiter.set_result",
        "waiter, _ = waiters.pop()\n            if not waiter.done():\n                waiter.set_result",
        "a released slot goes to the newest waiter, not the oldest",
    ),
    Mutant(
        "window-high-water",
        WINDOW,
        "self.high_water = max(self.high_water, self.taken)",
        "self.high_water = self.taken",
        "the high-water mark forgets its peak",
    ),
    # -- faults.py: the classifier ----------------------------------------------------
    Mutant(
        "faults-channel-closed-400",
        FAULTS,
        "code is not None and code >= 400",
        "code is not None and code > 400",
        "a plain ChannelClosed(400) is a lost channel, not a refusal",
    ),
    Mutant(
        "faults-channel-closed-500",
        FAULTS,
        "code is not None and code >= 400",
        "code is not None and code >= 500",
        "a plain ChannelClosed with a 4xx code is a lost channel, not a refusal",
    ),
    Mutant(
        "faults-close-frame-400",
        FAULTS,
        "elif reply_code >= 400:",
        "elif reply_code > 400:",
        "a close frame with code 400 is a lost channel, not a refusal",
    ),
    Mutant(
        "faults-reader-pamqp",
        FAULTS,
        "return InvalidFrameError(str(exc))",
        "return None",
        "reader_error lets pamqp's exception escape instead of aiormq's InvalidFrameError",
    ),
    Mutant(
        "faults-reader-incomplete",
        FAULTS,
        "Read {len(exc.partial)} bytes but {exc.expected} bytes expected",
        "Read {exc.expected} bytes but {len(exc.partial)} bytes expected",
        "reader_error's text for a short read has its numbers swapped",
    ),
    Mutant(
        "faults-reader-oserror",
        FAULTS,
        '        case OSError():\n            return AMQPConnectionError(f"Server communication',
        '        case KeyError():\n            return AMQPConnectionError(f"Server communication',
        "reader_error lets a socket OSError escape as is",
    ),
    Mutant(
        "faults-connection-403",
        FAULTS,
        "if code == 403:",
        "if code == 404:",
        "a connection closed with 403 is not an auth refusal",
    ),
    # -- confirms.py: ConfirmTracker --------------------------------------------------
    Mutant(
        "confirms-multiple-count",
        CONFIRMS,
        "count = min(tag - self._first + 1, len(items))",
        "count = min(tag - self._first, len(items))",
        "a multiple ack leaves its own tag outstanding",
    ),
    Mutant(
        "confirms-count-positive",
        CONFIRMS,
        "if count > 0:",
        "if count >= 0:",
        "the front moved by a count of zero",
        equivalent="adding a count of 0 to _first changes nothing",
    ),
    Mutant(
        "confirms-holes-once",
        CONFIRMS,
        "while items and items[0] is None:",
        "if items and items[0] is None:",
        "only one hole dropped when the front is acked: residue kept",
    ),
    Mutant(
        "confirms-index-bound",
        CONFIRMS,
        "if not 0 <= index < len(items):",
        "if not 0 <= index <= len(items):",
        "a single ack for the next tag raises IndexError",
    ),
    Mutant(
        "confirms-live-count",
        CONFIRMS,
        "self._live -= len(settled)",
        "self._live -= count",
        "holes counted again by a multiple ack: len() drifts",
    ),
    Mutant(
        "confirms-oldest-hole",
        CONFIRMS,
        "            if item is not None:\n                return item\n        return None",
        "            return item\n        return None",
        "oldest() returns a hole (None) while publishes are outstanding",
    ),
    # -- acks.py: AckTracker and LostAcks ---------------------------------------------
    Mutant(
        "acks-prefix-names-settled",
        ACKS,
        "if head is TagState.ACK_PENDING:",
        "if head is not TagState.IN_PROGRESS:",
        "a multiple ack names a tag already settled on its own",
    ),
    Mutant(
        "acks-prefix-stops",
        ACKS,
        "if head is TagState.IN_PROGRESS:\n                break",
        "if head is TagState.SETTLED:\n                break",
        "the prefix runs over a delivery still in its handler",
    ),
    Mutant(
        "acks-double-finish",
        ACKS,
        "self._states[index] is not TagState.IN_PROGRESS:\n            return False\n"
        "        self._states[index] = TagState.ACK_PENDING",
        "False:\n            return False\n        self._states[index] = TagState.ACK_PENDING",
        "a tag finished twice (or after a nack) is acked",
    ),
    Mutant(
        "acks-gap",
        ACKS,
        "if not self._states and tag > expected:",
        "if tag > expected:",
        "a gap in the tags accepted while deliveries are outstanding",
    ),
    Mutant(
        "acks-stragglers-shortcut",
        ACKS,
        "if not self._pending:\n            return []",
        "if False:\n            return []",
        "the no-pending shortcut removed",
        equivalent="with nothing pending the loop finds no ACK_PENDING tag and returns []",
    ),
    Mutant(
        "acks-stragglers-pending",
        ACKS,
        "self._pending -= len(tags)",
        "self._pending -= 0",
        "stragglers stay counted as pending",
    ),
    Mutant(
        "lost-acks-ttl",
        ACKS,
        "if now >= expires:",
        "if now > expires:",
        "a lost ack still honoured at the instant its ttl ends",
    ),
    Mutant(
        "lost-acks-counts-returns",
        ACKS,
        "attempt == done or (counts_returns and attempt == done + 1)",
        "attempt == done or attempt == done + 1",
        "a retry copy (attempt + 1) skipped on a queue that does not count returns",
    ),
    Mutant(
        "lost-acks-capacity",
        ACKS,
        "while len(entries) > self.capacity:",
        "while len(entries) > self.capacity + 1:",
        "one entry over capacity kept",
    ),
    Mutant(
        "lost-acks-refresh",
        ACKS,
        "        entries.move_to_end(message_id)\n",
        "",
        "an id recorded again keeps its old place: forgotten first",
    ),
    # -- settle.py: decide and the ladder ---------------------------------------------
    Mutant(
        "settle-last-attempt",
        SETTLE,
        "if attempt >= max_attempts:",
        "if attempt > max_attempts:",
        "a retry at the last attempt retried again, not dead-lettered",
    ),
    Mutant(
        "settle-manual-returned",
        SETTLE,
        "if policy is AckPolicy.MANUAL:  # returned without settling\n"
        "                return _retry(attempt, max_attempts)",
        "if policy is AckPolicy.MANUAL:  # returned without settling\n                return _ACK_DONE",
        "a MANUAL handler that returned without settling is acked",
    ),
    Mutant(
        "settle-already-processed-done",
        SETTLE,
        "Decision(Settle.DUPLICATE, mark_done=True)",
        "Decision(Settle.DUPLICATE)",
        "AlreadyProcessed does not mark the id done",
    ),
    Mutant(
        "settle-timeout-reason",
        SETTLE,
        "_DEAD_LETTER_REASON.get(outcome, DeadLetterReason.HANDLER_ERROR)",
        "DeadLetterReason.HANDLER_ERROR",
        "a timed-out handler dead-lettered as a plain handler error",
    ),
    Mutant(
        "settle-ack-first",
        SETTLE,
        "    if policy is AckPolicy.ACK_FIRST:\n        return _ACK\n",
        "",
        "under ACK_FIRST a failed handler's delivery is retried (it was acked already)",
    ),
    Mutant(
        "settle-unrecorded",
        SETTLE,
        "case Outcome.NACK_CALLED | Outcome.UNRECORDED | Outcome.SHUTDOWN:\n"
        "            return _REQUEUE",
        "case Outcome.NACK_CALLED | Outcome.UNRECORDED | Outcome.SHUTDOWN:\n"
        "            return _ACK",
        "an unrecorded success (or a shutdown) acked instead of requeued",
    ),
    Mutant(
        "settle-ladder-no-dlx",
        SETTLE,
        "if purpose is Settle.DEFER or not queue_has_dlx or target_broken:",
        "if purpose is Settle.DEFER or target_broken:",
        "a reject onto a queue without a dead-letter exchange (the message dropped)",
    ),
    Mutant(
        "settle-ladder-trim",
        SETTLE,
        "if rung is Rung.FULL_COPY and fault in (CopyFault.INVALID, CopyFault.REFUSED):",
        "if rung is Rung.FULL_COPY and fault is CopyFault.INVALID:",
        "a refused full copy is not retried trimmed",
    ),
)


def _apply(root: Path, mutant: Mutant) -> None:
    """Apply ``mutant`` under ``root`` (in place: ``root`` is a scratch copy)."""
    path = root / mutant.path
    text = path.read_text()
    path.write_text(text.replace(mutant.original, mutant.replacement, 1))


def check(repo: Path, mutants: Sequence[Mutant]) -> list[str]:
    """Every mutant's snippet occurs exactly once in ``repo``: the problems, if not."""
    problems = []
    for mutant in mutants:
        path = repo / mutant.path
        if not path.is_file():
            problems.append(f"{mutant.name}: {mutant.path} does not exist")
            continue
        count = path.read_text().count(mutant.original)
        if count != 1:
            problems.append(f"{mutant.name}: snippet found {count} times in {mutant.path}")
        if mutant.original == mutant.replacement:
            problems.append(f"{mutant.name}: the replacement is the original")
    return problems


def _copy(repo: Path, into: Path) -> Path:
    """The package, its tests and the pytest settings of ``repo``, copied into ``into``."""
    ignore = shutil.ignore_patterns("__pycache__", ".hypothesis", ".pytest_cache")
    for name in ("reliable_mq", "tests"):
        shutil.copytree(repo / name, into / name, ignore=ignore)
    shutil.copy2(repo / "pyproject.toml", into / "pyproject.toml")
    return into


def run_tests(root: Path, targets: Sequence[str], timeout: float) -> tuple[str, float, str]:
    """``("passed" | "failed" | "timeout" | "error: ...", seconds, the first failed test)``."""
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("CI", None)  # CI=true turns a skipped broker test into a failure
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-m",
        NO_BROKER,
        "-o",
        "addopts=--strict-markers",
        *targets,
    ]
    start = time.monotonic()
    try:
        done = subprocess.run(
            command, check=False, cwd=root, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "timeout", time.monotonic() - start, ""
    took = time.monotonic() - start
    if done.returncode == 0:
        return "passed", took, ""
    if done.returncode == 1:
        failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED ")]
        return "failed", took, failed[0].removeprefix("FAILED ") if failed else ""
    tail = (done.stdout + done.stderr).strip().splitlines()[-3:]
    return f"error {done.returncode}: {' | '.join(tail)}", took, ""


def present(repo: Path, targets: Sequence[str]) -> list[str]:
    """The test targets (``file`` or ``file::Class``) that exist in ``repo``: an older
    checkout (``--repo``, to score the tests before new ones) may lack some."""
    found = []
    for target in targets:
        file, _, cls = target.partition("::")
        path = repo / file
        if path.is_file() and (not cls or f"\nclass {cls}" in path.read_text()):
            found.append(target)
    return found


def _one(repo: Path, mutant: Mutant, timeout: float) -> tuple[Mutant, str, float, str]:
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as scratch:
        root = _copy(repo, Path(scratch))
        _apply(root, mutant)
        result, took, by = run_tests(root, present(repo, TESTS[mutant.path]), timeout)
    return mutant, result, took, by


def main(argv: Sequence[str] | None = None) -> int:  # noqa: PLR0911, PLR0912, PLR0915 - the CLI: options, then one exit code per outcome
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repo",
        type=Path,
        default=Path(__file__).resolve().parent.parent,
        help="the checkout to mutate (default: the one this script is in)",
    )
    parser.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per run")
    parser.add_argument("--jobs", type=int, default=1, help="mutants run at once")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("-v", "--verbose", action="store_true", help="name the killing test")
    parser.add_argument("--check", action="store_true", help="only check the snippets")
    args = parser.parse_args(argv)

    mutants = list(MUTANTS)
    names = {m.name for m in MUTANTS}
    if len(names) != len(MUTANTS):
        print("duplicate mutant names", file=sys.stderr)
        return 2
    if args.only:
        unknown = set(args.only) - names
        if unknown:
            print(f"unknown mutants: {', '.join(sorted(unknown))}", file=sys.stderr)
            return 2
        mutants = [m for m in MUTANTS if m.name in args.only]
    if args.list:
        for m in mutants:
            note = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
            print(f"{m.name:34} {m.path:32} {m.description}{note}")
        return 0

    repo = args.repo.resolve()
    problems = check(repo, mutants)
    if problems:
        print("mutants that do not apply exactly once:", *problems, sep="\n  ", file=sys.stderr)
        return 2
    if args.check:
        print(f"all {len(mutants)} mutants apply exactly once to {repo}")
        return 0

    wanted = sorted({t for m in mutants for t in TESTS[m.path]})
    targets = present(repo, wanted)
    for missing in sorted(set(wanted) - set(targets)):
        print(f"not in this checkout, not run: {missing}")
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as scratch:
        baseline, took, _ = run_tests(_copy(repo, Path(scratch)), targets, args.timeout * 3)
    if baseline != "passed":
        print(f"the unmutated tests do not pass ({baseline}): nothing to measure", file=sys.stderr)
        return 2
    print(f"baseline: {len(targets)} test targets pass unmutated in {took:.0f}s; {repo}")

    rows: list[tuple[Mutant, str, float]] = []
    with ThreadPoolExecutor(max_workers=max(args.jobs, 1)) as pool:
        for mutant, result, took, by in pool.map(lambda m: _one(repo, m, args.timeout), mutants):
            verdict = {"failed": "killed", "timeout": "killed (timeout)", "passed": "SURVIVED"}
            shown = verdict.get(result, result)
            if result == "passed" and mutant.equivalent:
                shown = "survived (equivalent)"
            print(f"{mutant.name:34} {shown:22} {took:5.1f}s  {mutant.description}", flush=True)
            if by and args.verbose:
                print(f"{'':34} by {by}", flush=True)
            rows.append((mutant, result, took))

    killed = [m for m, r, _ in rows if r in ("failed", "timeout")]
    equivalent = [m for m, r, _ in rows if r == "passed" and m.equivalent]
    survived = [m for m, r, _ in rows if r == "passed" and not m.equivalent]
    errors = [(m, r) for m, r, _ in rows if r not in ("failed", "timeout", "passed")]
    scored = len(rows) - len(equivalent)
    score = 100.0 * len(killed) / scored if scored else 100.0
    print()
    print(
        f"score: {len(killed)}/{scored} killed ({score:.1f}%); {len(equivalent)} equivalent, "
        f"{len(survived)} survived, {len(errors)} errors, of {len(rows)} mutants"
    )
    for m in equivalent:
        print(f"  equivalent  {m.name}: {m.equivalent}")
    for m in survived:
        print(f"  SURVIVED    {m.name}: {m.description}")
    for m, r in errors:
        print(f"  ERROR       {m.name}: {r}")
    killed_equivalent = [m for m in killed if m.equivalent]
    for m in killed_equivalent:
        print(f"  note: {m.name} is listed as equivalent but was killed: fix the list")
    return 1 if survived or errors or killed_equivalent else 0


if __name__ == "__main__":
    sys.exit(main())
