#!/usr/bin/env bash
# The outbox demo: service A commits orders with their events, the relay publishes
# them with confirms, service B applies each one exactly once (inbox in PostgreSQL).
# Needs RabbitMQ (started if missing) and PostgreSQL ($RELIABLE_MQ_OUTBOX_DSN, default
# postgresql://postgres@127.0.0.1:5432/postgres: without that variable the local
# server is made ready by ensure-services.sh, its cluster started, or Debian's
# postgresql package installed first on a fresh machine).
set -euo pipefail
cd "$(dirname "$0")/.."
RELIABLE_MQ_EXTRAS=dev source scripts/_venv.sh
if [ -z "${RELIABLE_MQ_OUTBOX_DSN:-}" ]; then
    require_postgres=1
else
    require_postgres=0 # a server of the caller's choosing: not ours to start
fi
PYTHON=.venv/bin/python REQUIRE_POSTGRES="$require_postgres" bash scripts/ensure-services.sh
exec .venv/bin/python examples/outbox_orders.py "$@"
