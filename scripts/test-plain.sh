#!/usr/bin/env bash
# The plain path is a mode of its own, tested as one: the publisher, consumer and fault
# suites again with the fast paths off (RELIABLE_MQ_FAST_PATH=off: aiormq's public
# basic_publish and basic_consume, pamqp's decoder). Tests of a fast-path-only protection
# pin fast_path themselves. Run after scripts/test.sh (it uses .venv). Extra arguments
# (options, or test paths instead of the default suites) go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# Left out, to keep CI within its time: the memory bounds (tests/faults/test_bounds.py,
# test_publisher_bounds.py) and the cluster failover (tests/faults/test_cluster.py), whose
# subject (the window, the supervisor's fail-over) is the same code on both paths.
if ! printf '%s\n' "$@" | grep -q '^tests'; then
    set -- "$@" tests/publish/test_publisher.py tests/publish/test_publisher_close.py \
        tests/publish/test_publisher_hardening.py tests/consume/test_consumer_broker.py \
        tests/consume/test_consumer_handler_errors.py tests/consume/test_consumer_exits.py tests/consume/test_copies.py \
        tests/amqp/test_properties.py tests/amqp/test_seam.py tests/faults/test_broker_faults.py \
        tests/faults/test_network_faults.py tests/faults/test_consumer_faults.py
fi
# Left out too: the slow tests marked fast_path in these files. Pinned to the fast path,
# they run here exactly as in scripts/test.sh (about 50 s for nothing new). The quick
# ones marked fast_path (test_copies.py's TestTimestamps) still run: they keep the pin
# itself exercised under RELIABLE_MQ_FAST_PATH=off.
DUPLICATES=(
    tests/consume/test_copies.py::TestEveryHop::test_pika_properties_on_every_copy
    tests/publish/test_publisher_hardening.py::TestPrivateBroker::test_unnamed_refusal_is_isolated
    tests/publish/test_publisher_hardening.py::TestMissingExchange::test_exchange_deleted_mid_stream
    tests/publish/test_publisher_hardening.py::TestMissingExchange::test_deleting_one_exchange_spares_the_other
)
RELIABLE_MQ_FAST_PATH=off exec .venv/bin/python -m pytest -p no:cacheprovider \
    "${DUPLICATES[@]/#/--deselect=}" "$@"
