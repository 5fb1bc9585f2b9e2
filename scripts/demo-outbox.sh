#!/usr/bin/env bash
# The outbox demo: service A commits orders with their events, the relay publishes
# them with confirms, service B applies each one exactly once (inbox in PostgreSQL).
# Needs RabbitMQ (started if missing) and PostgreSQL ($RELIABLE_MQ_OUTBOX_DSN, default
# postgresql://postgres@127.0.0.1:5432/postgres; on a fresh Debian machine the
# postgresql package is installed and its cluster started if missing).
set -euo pipefail
cd "$(dirname "$0")/.."
RELIABLE_MQ_EXTRAS=dev source scripts/_venv.sh
PYTHON=.venv/bin/python bash scripts/ensure-services.sh
if [ -z "${RELIABLE_MQ_OUTBOX_DSN:-}" ] && ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    if ! command -v pg_ctlcluster >/dev/null 2>&1; then
        echo "demo-outbox: installing postgresql" >&2
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
    fi
    version="$(ls /etc/postgresql | sort -V | tail -n 1)"
    pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
    for _ in $(seq 1 30); do pg_isready -q -h 127.0.0.1 -p 5432 && break; sleep 1; done
fi
exec .venv/bin/python examples/outbox_orders.py "$@"
