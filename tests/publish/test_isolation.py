"""`judge` and `Isolation`: which messages a refusal that names no exchange fails.

Pure logic, as a table: the messages unconfirmed on the refused channel (with
their refusal counts), the isolation under way, and what follows.
"""

from __future__ import annotations

import pytest

from reliable_mq._amqp.faults import Fault, FaultKind
from reliable_mq._publish.isolation import MAX_REFUSALS, Isolation, judge
from reliable_mq._publish.outgoing import Outgoing

pytestmark = pytest.mark.unit

REFUSAL = Fault(FaultKind.REFUSED, 406, "PRECONDITION_FAILED - something")


def outs(*refusals: int) -> list[Outgoing]:
    """Messages m1, m2... (seq 1, 2...) refused ``refusals[i]`` times so far."""
    made = []
    for seq, count in enumerate(refusals, 1):
        out = Outgoing(seq, f"m{seq}", None, "", "rk", True, 0.0, 0.0, None)  # type: ignore[arg-type]  # never encoded or counted here
        out.refusals = count
        made.append(out)
    return made


def ids(items: list[Outgoing]) -> list[str]:
    return [out.message_id for out in items]


@pytest.mark.parametrize(
    ("refusals", "failed", "isolating"),
    [
        # a lone suspect is the culprit: it fails, nothing to isolate
        ((1,), ["m1"], False),
        # several suspects: none fails yet, an isolation starts
        ((1, 1, 1, 1), [], True),
        # worn out (refused MAX_REFUSALS times) fails whatever the rest shows
        ((MAX_REFUSALS, 1), ["m1", "m2"], False),
        ((MAX_REFUSALS, 1, 1), ["m1"], True),
        ((MAX_REFUSALS,), ["m1"], False),
        ((MAX_REFUSALS - 1, MAX_REFUSALS - 1), [], True),
        # nothing was unconfirmed: nothing to do
        ((), [], False),
    ],
)
def test_without_an_isolation(
    refusals: tuple[int, ...], failed: list[str], isolating: bool
) -> None:
    live = outs(*refusals)
    got, isolation = judge(live, None, REFUSAL)
    assert ids(got) == failed
    assert (isolation is not None) is isolating
    if isolation is not None:
        # every suspect not failed, in publish order; sent in halves
        assert ids(list(isolation.suspects)) == [m for m in ids(live) if m not in failed]
        assert isolation.size == (len(isolation.suspects) + 1) // 2
        assert isolation.fault is REFUSAL


def test_an_isolation_halves_until_the_culprit_is_alone() -> None:
    """Eight suspects, m6 the culprit: each refused chunk is halved; a confirmed one is
    innocent; the culprit fails alone and the others are all sent and confirmed."""
    live = outs(*[1] * 8)
    failed, isolation = judge(live, None, REFUSAL)
    assert failed == []
    assert isolation is not None
    innocent: list[str] = []
    culprit: list[str] = []
    for _ in range(20):
        chunk = isolation.next_chunk()
        if not chunk:
            break
        if "m6" not in ids(chunk):
            innocent += ids(chunk)  # confirmed: the chunk is done
            for out in chunk:
                out.tag = 0
            assert isolation.chunk_done()
            continue
        for out in chunk:
            out.refusals += 1
        failed, same = judge(chunk, isolation, REFUSAL)
        assert same is isolation
        culprit += ids(failed)
    assert culprit == ["m6"]
    assert sorted(innocent) == ["m1", "m2", "m3", "m4", "m5", "m7", "m8"]
    assert not isolation.suspects


def test_a_refused_chunk_is_halved_in_front_of_the_others() -> None:
    """A refused chunk of two holds the culprit: both go back first, to be sent one by one."""
    live = outs(1, 1, 1, 1)
    _, isolation = judge(live, None, REFUSAL)
    assert isolation is not None
    chunk = isolation.next_chunk()
    assert ids(chunk) == ["m1", "m2"]
    failed, _ = judge(chunk, isolation, REFUSAL)
    assert failed == []
    assert ids(list(isolation.suspects)) == ["m1", "m2", "m3", "m4"]
    assert isolation.size == 1
    assert ids(isolation.next_chunk()) == ["m1"]


def test_worn_out_fails_during_an_isolation_too() -> None:
    live = outs(1, 1)
    _, isolation = judge(live, None, REFUSAL)
    assert isolation is not None
    chunk = isolation.next_chunk()
    assert ids(chunk) == ["m1"]
    live[1].refusals = MAX_REFUSALS
    failed, _ = judge([chunk[0], live[1]], isolation, REFUSAL)
    assert ids(failed) == ["m2", "m1"]
    assert isinstance(isolation, Isolation)
