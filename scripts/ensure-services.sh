#!/usr/bin/env bash
# Make sure the services the test suite needs are up:
#   - RabbitMQ on 127.0.0.1:5672 for guest/guest (required),
#   - Redis on 127.0.0.1:6379 (optional unless REQUIRE_REDIS=1),
#   - PostgreSQL on 127.0.0.1:5432, user postgres without a password, with the
#     databases in POSTGRES_DATABASES (only with REQUIRE_POSTGRES=1).
# Starts (and, if missing, installs with apt) whatever is down. Never stops or
# restarts a running service. Idempotent, and silent when everything is up.
#
# Environment:
#   PYTHON                  interpreter with aio_pika for the final AMQP check (python3)
#   REQUIRE_REDIS=1         fail instead of warning when Redis cannot be had
#   REQUIRE_POSTGRES=1      make sure PostgreSQL is up (start the installed cluster,
#                           or install Debian's postgresql) and fail if it cannot be
#   POSTGRES_DATABASES      databases that must exist, space separated (postgres)
#   RABBITMQ_START_TIMEOUT  seconds to wait for RabbitMQ to boot (120)
#   POSTGRES_START_TIMEOUT  seconds to wait for PostgreSQL to accept connections (60)
set -euo pipefail

readonly AMQP_HOST=127.0.0.1
readonly AMQP_PORT=5672
readonly AMQP_URL="amqp://guest:guest@${AMQP_HOST}:${AMQP_PORT}/"
readonly REDIS_HOST=127.0.0.1
readonly REDIS_PORT=6379
readonly PG_HOST=127.0.0.1
readonly PG_PORT=5432
readonly PG_USER=postgres
PYTHON="${PYTHON:-python3}"
REQUIRE_REDIS="${REQUIRE_REDIS:-0}"
REQUIRE_POSTGRES="${REQUIRE_POSTGRES:-0}"
POSTGRES_DATABASES="${POSTGRES_DATABASES:-postgres}"
RABBITMQ_START_TIMEOUT="${RABBITMQ_START_TIMEOUT:-120}"
POSTGRES_START_TIMEOUT="${POSTGRES_START_TIMEOUT:-60}"

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

# -------------------------------------------------------------- PostgreSQL

# True once the server on PG_HOST:PG_PORT accepts connections (it may be up
# but still starting, or recovering, and refuse them for a while).
pg_accepting() {
    if command -v pg_isready >/dev/null 2>&1; then
        limited 5 pg_isready -q -h "$PG_HOST" -p "$PG_PORT" -t 3 2>/dev/null
    else
        port_open "$PG_HOST" "$PG_PORT"
    fi
}

# psql as PG_USER over TCP, never prompting for a password.
pg_sql() {
    local database="$1"
    shift
    PGCONNECT_TIMEOUT=5 limited 15 psql -X -w -q -v ON_ERROR_STOP=1 -h "$PG_HOST" -p "$PG_PORT" \
        -U "$PG_USER" -d "$database" "$@"
}

# The newest cluster version under /etc/postgresql (Debian's layout), or nothing.
pg_cluster_version() {
    [ -d /etc/postgresql ] || return 0
    find /etc/postgresql -mindepth 2 -maxdepth 2 -name main -type d 2>/dev/null |
        awk -F/ '{print $4}' | sort -V | tail -n 1
}

# A cluster this script just installed only allows password logins over TCP:
# let local TCP connections in as any user without one, as the tests expect.
# Never done to a cluster that existed before.
pg_trust_local_tcp() {
    local hba="/etc/postgresql/$1/main/pg_hba.conf"
    [ -f "$hba" ] || return 0
    as_root sed -i '1i host all all 127.0.0.1/32 trust\nhost all all ::1/128 trust' "$hba"
}

# Returns non-zero (after saying why) if PostgreSQL cannot be had.
ensure_postgres() {
    if ! pg_accepting; then
        local installed=0 version
        version="$(pg_cluster_version)"
        if ! command -v pg_ctlcluster >/dev/null 2>&1 || [ -z "$version" ]; then
            log "installing postgresql"
            apt_install postgresql || return 1
            installed=1
            version="$(pg_cluster_version)"
            [ -n "$version" ] || {
                log "no cluster under /etc/postgresql after installing postgresql"
                return 1
            }
            pg_trust_local_tcp "$version"
        fi
        # The package may have started it already (where services may start).
        if ! pg_accepting; then
            log "starting PostgreSQL $version (cluster main)"
            if ! as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start \
                >"$LOG_DIR/postgres.log" 2>&1; then
                # "already running" is fine: it may still be starting up.
                grep -qi "already running" "$LOG_DIR/postgres.log" || {
                    show_log "$LOG_DIR/postgres.log"
                    log "pg_ctlcluster $version main start failed"
                    return 1
                }
            fi
        elif [ "$installed" -eq 1 ]; then
            # Started by the package before pg_hba.conf was changed: reread it.
            as_root pg_ctlcluster --skip-systemctl-redirect "$version" main reload \
                >>"$LOG_DIR/postgres.log" 2>&1 || true
        fi
        local deadline=$((SECONDS + POSTGRES_START_TIMEOUT))
        until pg_accepting; do
            if ((SECONDS >= deadline)); then
                show_log "$LOG_DIR/postgres.log"
                local server_log="/var/log/postgresql/postgresql-${version}-main.log"
                [ -r "$server_log" ] && show_log "$server_log"
                log "PostgreSQL did not accept connections on ${PG_HOST}:${PG_PORT}" \
                    "within ${POSTGRES_START_TIMEOUT}s"
                return 1
            fi
            sleep 0.5
        done
    fi

    command -v psql >/dev/null 2>&1 || {
        log "psql is missing: cannot check the databases (install postgresql-client)"
        return 1
    }
    pg_sql postgres -c "SELECT 1" >/dev/null 2>"$LOG_DIR/psql.log" || {
        show_log "$LOG_DIR/psql.log"
        log "cannot log in to ${PG_HOST}:${PG_PORT} as ${PG_USER} without a password" \
            "(the tests expect trust for local TCP connections in pg_hba.conf)"
        return 1
    }
    local database
    for database in $POSTGRES_DATABASES; do
        [[ "$database" =~ ^[a-z_][a-z0-9_]*$ ]] || {
            log "not a plain database name: '$database'"
            return 1
        }
        if [ -z "$(pg_sql postgres -tAc "SELECT 1 FROM pg_database WHERE datname = '$database'")" ]; then
            log "creating database $database"
            pg_sql postgres -c "CREATE DATABASE $database" >/dev/null || return 1
        fi
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

if [ "$REQUIRE_POSTGRES" = "1" ] && ! ensure_postgres; then
    die "PostgreSQL is required (REQUIRE_POSTGRES=1) but is not ready on ${PG_HOST}:${PG_PORT}"
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
