#!/usr/bin/env bash
# The main demo: set up .venv, make sure RabbitMQ is up, publish through cut connections.
set -euo pipefail
cd "$(dirname "$0")/.."
RELIABLE_MQ_EXTRAS=dev source scripts/_venv.sh
PYTHON=.venv/bin/python bash scripts/ensure-services.sh
exec .venv/bin/python examples/publisher_demo.py "$@"
