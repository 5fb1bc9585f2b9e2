#!/usr/bin/env bash
# The whole test suite: set up .venv (with the spark and redis extras), make sure
# RabbitMQ, Redis, PostgreSQL (on 5432, for the outbox example), Java and
# Chromium (the docs layout test) are there, then run pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
RELIABLE_MQ_EXTRAS=dev,spark,redis source scripts/_venv.sh
PYTHON=.venv/bin/python REQUIRE_REDIS="${REQUIRE_REDIS:-1}" \
    REQUIRE_POSTGRES="${REQUIRE_POSTGRES:-1}" bash scripts/ensure-services.sh
if ! command -v java >/dev/null 2>&1; then
    echo "test: installing a Java runtime for PySpark" >&2
    apt-get update -qq && apt-get install -y -qq default-jre-headless >/dev/null
fi
if ! command -v chromium >/dev/null 2>&1; then
    echo "test: installing Chromium for the docs layout test" >&2
    apt-get update -qq && apt-get install -y -qq chromium >/dev/null
fi
exec .venv/bin/python -m pytest "$@"
