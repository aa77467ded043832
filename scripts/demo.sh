#!/usr/bin/env bash
# The README's "run it locally" command: an ephemeral PostgreSQL 15, the
# shipped setup SQL, the relay streaming to stdout, and a few sample outbox
# inserts. Everything is removed when it ends.
#
#   bash scripts/demo.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
[ -x "$(command -v cargo)" ] || . "$HOME/.cargo/env"

bash scripts/install-deps.sh
echo "== building outbox-relay"
cargo build --quiet --bin outbox-relay
relay="$repo/target/debug/outbox-relay"

work=$(mktemp -d /tmp/outbox-relay-demo.XXXXXX)
chmod 755 "$work"   # the postgres user must reach the cluster dir inside
relay_pid=""
cleanup() {
    [ -n "$relay_pid" ] && kill "$relay_pid" 2>/dev/null || true
    bash scripts/pg-cluster.sh stop "$work/pg" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

echo "== starting PostgreSQL (wal_level=logical)"
url=$(bash scripts/pg-cluster.sh start "$work/pg" | tail -n 1 | cut -d= -f2-)
app_url=${url%/postgres}/postgres
cat > "$work/relay.toml" <<TOML
[postgres]
url = "$app_url"

[sink]
kind = "stdout"

[http]
listen = ""
TOML
echo "== config: $work/relay.toml"
sed 's/^/   /' "$work/relay.toml"

echo "== outbox-relay setup --apply (table, publication, slot, role)"
"$relay" --config "$work/relay.toml" setup --apply
echo "== outbox-relay check"
"$relay" --config "$work/relay.toml" check

echo "== outbox-relay run (envelopes on stdout, logs on stderr)"
"$relay" --config "$work/relay.toml" run > "$work/envelopes.ndjson" 2> "$work/relay.log" &
relay_pid=$!
psql_() { PGPASSWORD=postgres psql "$app_url" -X -q -v ON_ERROR_STOP=1 "$@"; }
for _ in $(seq 50); do
    [ "$(psql_ -At -c "select active from pg_replication_slots where slot_name = 'outbox_relay'")" = t ] && break
    sleep 0.2
done

echo "== an application transaction: a business row and its outbox row, one commit"
psql_ <<'SQL'
CREATE TABLE orders (id text PRIMARY KEY, total numeric);
BEGIN;
INSERT INTO orders VALUES ('ord-1', 42.50);
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload, headers)
VALUES ('order', 'ord-1', 'OrderCreated', '{"order_id": "ord-1", "total": 42.50}',
        '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}');
COMMIT;
INSERT INTO outbox (aggregate_type, aggregate_id, event_type, payload)
VALUES ('order', 'ord-1', 'OrderPaid', '{"order_id": "ord-1", "method": "card"}'),
       ('order', 'ord-2', 'OrderCreated', '{"order_id": "ord-2", "total": 7}');
SQL

for _ in $(seq 50); do
    [ "$(wc -l < "$work/envelopes.ndjson")" -ge 3 ] && break
    sleep 0.2
done
echo "== what the relay published:"
cat "$work/envelopes.ndjson"
kill -TERM "$relay_pid"; wait "$relay_pid" || true; relay_pid=""
echo "== relay log:"
sed 's/^/   /' "$work/relay.log"
echo "== the slot is confirmed up to the last commit:"
psql_ -c "select slot_name, confirmed_flush_lsn, pg_current_wal_lsn() as current_wal_lsn from pg_replication_slots"
