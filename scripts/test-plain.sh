#!/usr/bin/env bash
# The plain path is a mode of its own, tested as one: the publisher, consumer and fault
# suites again with the fast paths off (RELIABLE_MQ_FAST_PATH=off: aiormq's public
# basic_publish and basic_consume, pamqp's decoder). Tests of a fast-path-only protection
# pin fast_path themselves. Run after scripts/test.sh (it uses .venv). Extra arguments
# (options, or test paths instead of the default suites) go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! printf '%s\n' "$@" | grep -q '^tests'; then
    set -- "$@" tests/test_publisher.py tests/test_publisher_close.py tests/test_publisher_bounds.py \
        tests/test_publisher_hardening.py tests/test_consumer_broker.py \
        tests/test_consumer_handler_errors.py tests/test_consumer_exits.py tests/test_copies.py \
        tests/test_properties.py tests/test_seam.py tests/faults
fi
RELIABLE_MQ_FAST_PATH=off exec .venv/bin/python -m pytest -p no:cacheprovider "$@"
