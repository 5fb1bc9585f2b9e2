"""The loss oracle's arithmetic (pure logic)."""

from __future__ import annotations

from reliable_mq.testing.oracle import LossOracle


class TestLossOracle:
    def test_clean_run_is_ok_and_counts_broker_duplicates(self) -> None:
        """Duplicated deliveries are allowed; one effect each is required."""
        oracle = LossOracle()
        for mid in ("a", "b"):
            oracle.attempted(mid)
            oracle.confirmed(mid)
            oracle.applied(mid)
        oracle.delivered_many(["a", "b", "b"])
        report = oracle.report()
        assert report.ok
        assert report.broker_duplicates == 1

    def test_confirmed_but_never_delivered_is_lost(self) -> None:
        oracle = LossOracle()
        oracle.attempted("a")
        oracle.confirmed("a")
        assert oracle.report().lost == {"a"}
        assert not oracle.report().ok

    def test_failed_publish_is_not_lost_but_resolved(self) -> None:
        oracle = LossOracle()
        oracle.attempted("a")
        oracle.failed("a")
        assert oracle.report().ok

    def test_unexpected_duplicate_effect_and_unresolved_are_flagged(self) -> None:
        oracle = LossOracle()
        oracle.attempted("a")
        oracle.delivered("ghost")
        oracle.applied("a")
        oracle.applied("a")
        report = oracle.report()
        assert report.unexpected == {"ghost"}
        assert report.duplicate_effects == {"a"}
        assert report.unresolved == {"a"}
        assert "lost=0" in report.summary()
