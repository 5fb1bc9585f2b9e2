#!/usr/bin/env bash
# The core suites against the LOWEST supported aio-pika, aiormq and pamqp: the floors
# pyproject.toml declares (">=X"), installed exactly (==X) into a venv of their own,
# .venv-lowest, with only what these suites need (no Spark). The whole suite runs
# against the newest (scripts/test.sh). Extra arguments (options, or test paths
# instead of the default suites) go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"
PY="${PYTHON_FOR_VENV:-python3}"
VENV=.venv-lowest

# The floors, read from pyproject.toml (one place says what is supported).
mapfile -t LOWEST < <("$PY" - <<'PYTHON'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for requirement in project["dependencies"]:
    name, spec = re.match(r"([A-Za-z0-9_.-]+)(.*)", requirement).groups()
    if name in ("aio-pika", "aiormq", "pamqp"):
        floor = re.search(r">=\s*([0-9][^,\s]*)", spec)
        if floor is None:
            raise SystemExit(f"test-lowest: {name} has no >= floor in pyproject.toml")
        print(f"{name}=={floor.group(1)}")
PYTHON
)
[ "${#LOWEST[@]}" -eq 3 ] || { echo "test-lowest: expected 3 floors, got: ${LOWEST[*]}" >&2; exit 1; }
TEST_DEPS=(
    "pytest>=8" "pytest-asyncio>=0.24" "pytest-timeout>=2.3" "hypothesis>=6.100"
    "import-linter>=2.1" "pika>=1.3"  # pika: the other client in the property tests
)

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
stamp="$VENV/.reliable_mq-lowest"
wanted="$(cat pyproject.toml <(printf '%s\n' "${LOWEST[@]}" "${TEST_DEPS[@]}") | sha256sum | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    echo "test-lowest: installing reliable_mq with ${LOWEST[*]} into $VENV" >&2
    "$VENV/bin/python" -m pip install -q --upgrade pip
    "$VENV/bin/python" -m pip install -q -e . "${LOWEST[@]}" "${TEST_DEPS[@]}"
    echo "$wanted" > "$stamp"
fi
# What is installed is what was asked for (a resolver that moved a pin fails here).
"$VENV/bin/python" - "${LOWEST[@]}" <<'PYTHON'
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    if version(name) != wanted:
        raise SystemExit(f"test-lowest: {name} {version(name)} is installed, not {wanted}")
print("test-lowest:", ", ".join(f"{pin.split('==')[0]} {version(pin.split('==')[0])}" for pin in sys.argv[1:]))
PYTHON

if ! printf '%s\n' "$@" | grep -q '^tests'; then
    set -- "$@" tests/amqp/test_seam.py tests/amqp/test_boundaries.py tests/amqp/test_wire.py tests/amqp/test_amqp_faults.py \
        tests/publish/test_publisher.py tests/publish/test_publisher_close.py tests/consume/test_consumer_broker.py \
        tests/consume/test_consumer_fast_path.py tests/consume/test_copies.py tests/amqp/test_properties.py
fi
exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
