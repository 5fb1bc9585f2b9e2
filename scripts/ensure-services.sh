#!/usr/bin/env bash
# Make sure the services the test suite needs are up:
#   - RabbitMQ on 127.0.0.1:5672 for guest/guest (required),
#   - Redis on 127.0.0.1:6379 (optional unless REQUIRE_REDIS=1).
# Starts (and, if missing, installs with apt) whatever is down. Never stops or
# restarts a running service. Idempotent, and silent when everything is up.
#
# Environment:
#   PYTHON                  interpreter with aio_pika for the final AMQP check (python3)
#   REQUIRE_REDIS=1         fail instead of warning when Redis cannot be had
#   RABBITMQ_START_TIMEOUT  seconds to wait for RabbitMQ to boot (120)
set -euo pipefail

readonly AMQP_HOST=127.0.0.1
readonly AMQP_PORT=5672
readonly AMQP_URL="amqp://guest:guest@${AMQP_HOST}:${AMQP_PORT}/"
readonly REDIS_HOST=127.0.0.1
readonly REDIS_PORT=6379
PYTHON="${PYTHON:-python3}"
REQUIRE_REDIS="${REQUIRE_REDIS:-0}"
RABBITMQ_START_TIMEOUT="${RABBITMQ_START_TIMEOUT:-120}"

# Debian puts rabbitmq-server and rabbitmqctl in /usr/sbin.
export PATH="${PATH}:/usr/local/sbin:/usr/sbin:/sbin"

LOG_DIR="$(mktemp -d "${TMPDIR:-/tmp}/ensure-services.XXXXXX")"
trap 'rm -rf "$LOG_DIR"' EXIT
APT_UPDATED=0

log() { printf 'ensure-services: %s\n' "$*" >&2; }
warn() { log "WARNING: $*"; }
die() {
    log "ERROR: $*"
    exit 1
}

# Show the tail of a log file on stderr (for failures).
show_log() {
    [ -s "$1" ] && tail -n 30 "$1" | sed 's/^/    /' >&2
    return 0
}

# Run a command as root: directly, or through passwordless sudo.
as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        log "need root (or passwordless sudo) to run: $*"
        return 1
    fi
}

# Run a command (not a shell function) with a time limit, when coreutils'
# timeout is available.
limited() {
    local seconds="$1"
    shift
    if command -v timeout >/dev/null 2>&1; then
        timeout "$seconds" "$@"
    else
        "$@"
    fi
}

# Same, as root.
root_limited() {
    local seconds="$1"
    shift
    if command -v timeout >/dev/null 2>&1; then
        as_root timeout "$seconds" "$@"
    else
        as_root "$@"
    fi
}

# True if something accepts TCP connections on host:port.
port_open() {
    # shellcheck disable=SC2016  # $1/$2 expand in the inner shell
    limited 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' _ "$1" "$2" 2>/dev/null
}

apt_install() {
    command -v apt-get >/dev/null 2>&1 || {
        log "apt-get is not available to install: $*"
        return 1
    }
    if [ "$APT_UPDATED" -eq 0 ]; then
        as_root apt-get update -qq >"$LOG_DIR/apt.log" 2>&1 || {
            log "apt-get update failed:"
            show_log "$LOG_DIR/apt.log"
            return 1
        }
        APT_UPDATED=1
    fi
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get install -y -qq --no-install-recommends "$@" >>"$LOG_DIR/apt.log" 2>&1 || {
        log "apt-get install $* failed:"
        show_log "$LOG_DIR/apt.log"
        return 1
    }
}

have_systemd() {
    [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1
}

# ---------------------------------------------------------------- RabbitMQ

rabbitmq_node_up() {
    # The node may be up but still booting (port not open yet).
    root_limited 30 rabbitmqctl -q ping >/dev/null 2>&1
}

ensure_rabbitmq() {
    port_open "$AMQP_HOST" "$AMQP_PORT" && return 0

    if ! command -v rabbitmq-server >/dev/null 2>&1 || ! command -v rabbitmqctl >/dev/null 2>&1; then
        log "installing rabbitmq-server"
        apt_install rabbitmq-server || die "could not install rabbitmq-server"
        command -v rabbitmqctl >/dev/null 2>&1 || die "rabbitmqctl missing after installing rabbitmq-server"
        # The package may have started the broker already.
        port_open "$AMQP_HOST" "$AMQP_PORT" && return 0
    fi

    if rabbitmq_node_up; then
        log "RabbitMQ node is running but not listening on ${AMQP_PORT} yet; waiting"
    else
        log "starting RabbitMQ"
        if have_systemd && as_root systemctl start rabbitmq-server >"$LOG_DIR/rabbitmq.log" 2>&1; then
            :
        elif ! as_root rabbitmq-server -detached >>"$LOG_DIR/rabbitmq.log" 2>&1; then
            show_log "$LOG_DIR/rabbitmq.log"
            die "rabbitmq-server -detached failed"
        fi
    fi

    local deadline=$((SECONDS + RABBITMQ_START_TIMEOUT))
    until port_open "$AMQP_HOST" "$AMQP_PORT"; do
        if ((SECONDS >= deadline)); then
            show_log "$LOG_DIR/rabbitmq.log"
            for f in /var/log/rabbitmq/startup_err /var/log/rabbitmq/*.log; do
                [ -f "$f" ] && show_log "$f"
            done
            die "RabbitMQ did not come up on ${AMQP_HOST}:${AMQP_PORT} within ${RABBITMQ_START_TIMEOUT}s"
        fi
        # await_startup fails at once while the node is not registered yet.
        root_limited 20 rabbitmqctl -q await_startup --timeout 15 >>"$LOG_DIR/rabbitmq.log" 2>&1 ||
            sleep 1
    done
}

# ------------------------------------------------------------------- Redis

redis_ping() {
    if command -v redis-cli >/dev/null 2>&1; then
        [ "$(limited 5 redis-cli -h "$REDIS_HOST" -p "$REDIS_PORT" ping 2>/dev/null)" = "PONG" ]
    else
        # shellcheck disable=SC2016  # $1/$2 expand in the inner shell
        limited 5 bash -c '
            exec 3<>"/dev/tcp/$1/$2" || exit 1
            printf "PING\r\n" >&3
            IFS= read -r -t 3 reply <&3 || exit 1
            [[ "$reply" == "+PONG"* ]]
        ' _ "$REDIS_HOST" "$REDIS_PORT" 2>/dev/null
    fi
}

# Returns non-zero (after saying why) if Redis cannot be had.
ensure_redis() {
    redis_ping && return 0

    if port_open "$REDIS_HOST" "$REDIS_PORT"; then
        log "something listens on ${REDIS_HOST}:${REDIS_PORT} but does not answer PING"
        return 1
    fi

    if ! command -v redis-server >/dev/null 2>&1; then
        log "installing redis-server"
        apt_install redis-server || return 1
        command -v redis-server >/dev/null 2>&1 || {
            log "redis-server missing after installing it"
            return 1
        }
        redis_ping && return 0
    fi

    log "starting Redis"
    local data_dir=/var/lib/redis log_dir=/var/log/redis
    if as_root mkdir -p "$data_dir" "$log_dir" 2>/dev/null; then
        as_root redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
            --save "" --appendonly no --dir "$data_dir" --logfile "$log_dir/ci.log" \
            >"$LOG_DIR/redis.log" 2>&1 || {
            show_log "$LOG_DIR/redis.log"
            log "redis-server failed to start"
            return 1
        }
    else
        # No root: run it as this user with its files under TMPDIR.
        data_dir="${TMPDIR:-/tmp}/reliable-mq-redis"
        mkdir -p "$data_dir"
        log_dir="$data_dir"
        redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$REDIS_PORT" \
            --save "" --appendonly no --dir "$data_dir" --logfile "$log_dir/ci.log" \
            >"$LOG_DIR/redis.log" 2>&1 || {
            show_log "$LOG_DIR/redis.log"
            log "redis-server failed to start"
            return 1
        }
    fi

    local deadline=$((SECONDS + 15))
    until redis_ping; do
        if ((SECONDS >= deadline)); then
            [ -r "$log_dir/ci.log" ] && show_log "$log_dir/ci.log"
            log "Redis did not answer PING within 15s"
            return 1
        fi
        sleep 0.2
    done
}

# -------------------------------------------------------------------- main

ensure_rabbitmq

if ! ensure_redis; then
    if [ "$REQUIRE_REDIS" = "1" ]; then
        die "Redis is required (REQUIRE_REDIS=1) but not available on ${REDIS_HOST}:${REDIS_PORT}"
    fi
    warn "Redis is not available on ${REDIS_HOST}:${REDIS_PORT}; Redis tests will skip"
fi

# A listening port is not enough: prove a real AMQP handshake works.
"$PYTHON" - "$AMQP_URL" <<'PY' || die "no AMQP handshake with ${AMQP_URL}"
import asyncio
import sys
import time

try:
    import aio_pika
except ImportError as exc:
    sys.exit(f"ensure-services: ERROR: {sys.executable} cannot import aio_pika ({exc}); set PYTHON")

URL = sys.argv[1]


async def main() -> int:
    deadline = time.monotonic() + 60
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            connection = await aio_pika.connect(URL, timeout=5)
        except Exception as exc:
            last = exc
            await asyncio.sleep(1)
            continue
        await connection.close()
        return 0
    print(f"ensure-services: ERROR: no AMQP handshake in 60s: {last!r}", file=sys.stderr)
    return 1


sys.exit(asyncio.run(main()))
PY
