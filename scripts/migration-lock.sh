#!/usr/bin/env bash
# Measures `outbox-relay setup --apply` migrating an outbox table from before
# the derived lifecycle (docs/operations.md, "Migrating to the derived
# lifecycle"): on a table of $ROWS rows (default 1,000,000; 10 % PENDING, the
# rest PUBLISHED) it prints how long each migration statement ran (the server
# logs every statement of the setup session), how long the table's ACCESS
# EXCLUSIVE lock was held, whether the table was rewritten, and what four
# connections inserting rows throughout saw: their slowest insert during the
# migration against before it.
#
#   scripts/migration-lock.sh                  # PostgreSQL 15
#   PG_VERSION=18 scripts/migration-lock.sh    # 14 to 18 (scripts/pg-versions.sh)
#   ROWS=200000 scripts/migration-lock.sh
#
# Runs as root (initdb and postgres as the postgres user) or as a user that
# may run them; builds the relay (debug) unless OUTBOX_RELAY_BIN names one.
# psql and pgbench are Debian's (postgresql-15), which speak to 14 to 18.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/pg-versions.sh
major=$(pg_major)
bin=${PG_BIN:-$(pg_bin_of "$major")}
[ -x "$bin/postgres" ] || bash scripts/install-deps.sh
client=$PG_SYSTEM_BIN
rows=${ROWS:-1000000}
relay=${OUTBOX_RELAY_BIN:-}
if [ -z "$relay" ]; then
    command -v cargo >/dev/null 2>&1 || . "$HOME/.cargo/env"
    cargo build -q -p outbox-relay
    relay=${CARGO_TARGET_DIR:-target}/debug/outbox-relay
fi

as_postgres=()
[ "$(id -u)" = 0 ] && as_postgres=(runuser -u postgres --)
dir=$(mktemp -d /tmp/outbox-relay-migration.XXXXXX)
chmod 755 "$dir"
[ "$(id -u)" = 0 ] && chown postgres "$dir"
port=$((20000 + RANDOM % 20000))
stop() {
    "${as_postgres[@]}" "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true
    rm -rf -- "$dir"
}
trap stop EXIT

"${as_postgres[@]}" "$bin/initdb" -D "$dir/data" -U postgres --auth=trust >/dev/null
"${as_postgres[@]}" "$bin/pg_ctl" -D "$dir/data" -l "$dir/server.log" -w -o "-p $port -k $dir \
    -c listen_addresses=127.0.0.1 -c wal_level=logical -c max_wal_size=4GB -c shared_buffers=256MB \
    -c log_line_prefix='%m [%p] %a ' -c log_min_duration_statement=0 -c log_lock_waits=on -c deadlock_timeout=5ms" start >/dev/null
psql() { "$client/psql" -X -q -v ON_ERROR_STOP=1 -h 127.0.0.1 -p "$port" -U postgres -d app "$@"; }
"$client/psql" -X -q -h 127.0.0.1 -p "$port" -U postgres -d postgres -c "CREATE DATABASE app"

# The table as setup made it before the derived lifecycle (the file the
# migration tests start from too).
psql <<SQL
SET log_min_duration_statement = -1;
\\i tests/data/outbox_before_derive.sql
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, created_at, publish_state, published_at)
SELECT 'order', 'ord-' || g % 1000, 'OrderCreated',
       jsonb_build_object('order_id', g, 'note', repeat('x', 160)),
       now() - (($rows - g) * interval '1 ms'),
       CASE WHEN g % 10 = 0 THEN 'PENDING' ELSE 'PUBLISHED' END,
       CASE WHEN g % 10 = 0 THEN NULL ELSE now() END
  FROM generate_series(1, $rows) g;
VACUUM ANALYZE outbox;
CHECKPOINT;
SQL

cat >"$dir/relay.toml" <<EOF
[postgres]
url = "postgres://postgres@127.0.0.1:$port/app"
application_name = "migration"
EOF
cat >"$dir/insert.sql" <<'EOF'
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload) VALUES ('order', 'load', 'OrderCreated', '{"n": 1}');
EOF

read -r version size filenode < <(psql -At -F ' ' -c "SET log_min_duration_statement = -1; \
    SELECT split_part(current_setting('server_version'), ' ', 1), \
           replace(pg_size_pretty(pg_table_size('outbox')), ' ', ''), pg_relation_filenode('outbox')")
echo "PostgreSQL $version: outbox of $rows rows, $size, filenode $filenode"

# Four inserting connections throughout: 4 s before the migration, during it, after it.
"$relay" --config "$dir/relay.toml" setup >"$dir/setup.sql"
seconds=${SECONDS_OF_LOAD:-40}
PGAPPNAME=load "$client/pgbench" -n -h 127.0.0.1 -p "$port" -U postgres -c 4 -j 2 -T "$seconds" \
    -f "$dir/insert.sql" -l --log-prefix="$dir/load" app >"$dir/pgbench.out" 2>&1 &
load=$!
sleep 4
started=$(date +%s.%N)
"$relay" --config "$dir/relay.toml" setup --apply 2>"$dir/apply.err" || { cat "$dir/apply.err"; exit 1; }
finished=$(date +%s.%N)
wait "$load" || { cat "$dir/pgbench.out"; exit 1; }

psql -At -c "SET log_min_duration_statement = -1; SELECT pg_relation_filenode('outbox')" | {
    read -r after
    if [ "$after" = "$filenode" ]; then echo "no rewrite (filenode $after)"; else echo "REWRITTEN: filenode $filenode -> $after"; fi
}
psql -At -F ' ' -c "SET log_min_duration_statement = -1; SELECT count(*), count(relay_txid) FROM outbox" | {
    read -r all stamped
    echo "rows $all, of which with relay_txid $stamped (the inserts since the migration)"
}
awk -v s="$started" -v f="$finished" 'BEGIN { printf "setup --apply took %.2f s\n", f - s }'
echo
echo "statements of the setup session (server log, ms):"
# Each file but 008 runs as one "BEGIN; <file> COMMIT" (logged by its first
# line); 008 is a query, then the statements it returned, each on its own.
grep -E ' migration LOG:  duration: ' "$dir/server.log" |
    sed -E 's/.* duration: ([0-9.]+) ms +(statement|parse [^:]*|bind [^:]*|execute [^:]*): (.*)/\1\t\3/' |
    awk -F '\t' '
        BEGIN { split("001 002 003 004 005 006 007 009 010", files, " ") }
        $2 ~ /^BEGIN;/ {
            file = files[++n]
            what = file ": " (file == "003" ? "the slot" : file == "006" ? "position table columns (ADD COLUMN IF NOT EXISTS)" : \
                   file == "007" ? "ADD COLUMN relay_txid xid8; SET DEFAULT pg_current_xact_id() (ACCESS EXCLUSIVE held within this)" : \
                   file == "009" ? "the state view" : "as before the derived lifecycle")
            printf "  %10.1f  %s\n", $1, what; next
        }
        $2 ~ /outbox-relay 008/ { printf "  %10.1f  008: the query listing the index statements\n", $1; next }
        $2 ~ /INDEX/ { printf "  %10.1f  008: %s\n", $1, substr($2, 1, 100); next }
    '
echo
echo "inserts that waited for a lock (deadlock_timeout = 5 ms: waits longer are logged):"
{ grep -E 'load LOG:  process [0-9]+ acquired' "$dir/server.log" || true; } | sed -E 's/.*acquired ([A-Za-z]+) on (.*) after ([0-9.]+) ms.*/  \3 ms for \1 on \2/' | sort -t' ' -k3 -n -r | head -5
grep -qE 'load LOG:  process [0-9]+ acquired' "$dir/server.log" || echo "  none"
echo
# Insert latencies (pgbench log: client, tx, latency us, script, epoch s, us).
awk -v s="$started" -v f="$finished" '
    { t = $5 + $6 / 1e6; lat = $3 / 1000
      if (t < s) { nb++; if (lat > mb) mb = lat }
      else if (t - lat / 1000 <= f) { nd++; if (lat > md) md = lat }
      else { na++; if (lat > ma) ma = lat } }
    END { printf "inserts (4 connections): before %d, slowest %.1f ms; during the migration %d, slowest %.1f ms; after %d, slowest %.1f ms\n", nb, mb, nd, md, na, ma }
' "$dir"/load.*
