# Sourced by the other scripts: create or reuse .venv and install reliable_mq into it.
# Re-installs only when pyproject.toml changed since the last install.
set -euo pipefail
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"
EXTRAS="${RELIABLE_MQ_EXTRAS:-dev}"
PY="${PYTHON_FOR_VENV:-python3}"

if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv .venv 2>/dev/null; then
        echo "venv: '$PY -m venv' failed; installing python3-venv" >&2
        rm -rf .venv
        apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
        "$PY" -m venv .venv
    fi
fi

stamp=".venv/.reliable_mq-installed-${EXTRAS//,/-}"
wanted="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$wanted" ]; then
    echo "venv: installing reliable_mq[$EXTRAS] into .venv" >&2
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e ".[$EXTRAS]"
    echo "$wanted" > "$stamp"
fi
