#!/usr/bin/env bash
# Starts or stops an ephemeral PostgreSQL cluster for the test run, of the
# major PG_VERSION (14 to 18, default 15; PG_BIN overrides the binaries, see
# scripts/pg-versions.sh), with the same settings as the harness's Cluster
# (tests/pg-test.conf).
#
#   scripts/pg-cluster.sh start DIR   # DIR: new or empty; last line printed:
#                                     # OUTBOX_RELAY_TEST_PG_URL=postgres://…
#   scripts/pg-cluster.sh env DIR     # prints that line again
#   scripts/pg-cluster.sh stop DIR    # stops the server (immediate), removes DIR
#
# As root, DIR is given to the postgres user and the server tools run as it.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
. "$repo/scripts/pg-versions.sh"
PG_BIN=$(pg_bin)
cmd=${1:?usage: pg-cluster.sh start|stop|env DIR}
dir=${2:?usage: pg-cluster.sh start|stop|env DIR}

# Run a PostgreSQL tool, as postgres when we are root.
pg() {
    local tool=$1; shift
    if [ "$(id -u)" = 0 ]; then
        (cd "$dir" && runuser -u postgres -- "$PG_BIN/$tool" "$@")
    else
        (cd "$dir" && "$PG_BIN/$tool" "$@")
    fi
}

url() {
    echo "OUTBOX_RELAY_TEST_PG_URL=postgres://postgres:postgres@127.0.0.1:$(cat "$dir/port")/postgres"
}

case $cmd in
start)
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    [ -z "$(ls -A "$dir")" ] || { echo "pg-cluster.sh: $dir is not empty" >&2; exit 1; }
    [ "$(id -u)" = 0 ] && chown postgres: "$dir"
    echo postgres > "$dir/pwfile"
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    echo "$port" > "$dir/port"
    pg initdb -D "$dir/data" -U postgres --auth-local=trust --auth-host=scram-sha-256 \
        --pwfile="$dir/pwfile" -E UTF8 --no-locale --no-sync --no-instructions >"$dir/initdb.log" 2>&1 \
        || { cat "$dir/initdb.log" >&2; exit 1; }
    grep -Eq '^host[[:space:]]+replication[[:space:]]+all[[:space:]]+127\.0\.0\.1/32' "$dir/data/pg_hba.conf" \
        || echo "host    replication     all             127.0.0.1/32            scram-sha-256" >> "$dir/data/pg_hba.conf"
    {
        echo
        echo "# outbox-relay test harness"
        cat "$repo/tests/pg-test.conf"
        echo "unix_socket_directories = '$dir'"
        echo "port = $port"
    } >> "$dir/data/postgresql.conf"
    pg pg_ctl -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null \
        || { echo "pg-cluster.sh: server did not start; tail of $dir/server.log:" >&2; tail -n 40 "$dir/server.log" >&2; exit 1; }
    version=$(pg psql -X -A -t -h "$dir" -p "$port" -U postgres -d postgres -c 'SHOW server_version') \
        || { echo "pg-cluster.sh: the server does not answer; tail of $dir/server.log:" >&2; tail -n 40 "$dir/server.log" >&2; exit 1; }
    echo "pg-cluster.sh: PostgreSQL $version ($PG_BIN) on 127.0.0.1:$port, data in $dir"
    url
    ;;
env)
    url
    ;;
stop)
    if [ -f "$dir/data/postmaster.pid" ]; then
        pg pg_ctl -D "$dir/data" -m immediate -w -t 60 stop >/dev/null || true
    fi
    rm -rf -- "$dir"
    ;;
*)
    echo "usage: pg-cluster.sh start|stop|env DIR" >&2
    exit 2
    ;;
esac
