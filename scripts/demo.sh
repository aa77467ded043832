#!/usr/bin/env bash
# The README's "run it locally" command: an ephemeral PostgreSQL (15, or the
# major in PG_VERSION) and a local AWS endpoint (moto), the shipped setup
# SQL, a FIFO topic with a subscribed SQS queue, the relay publishing to it, a
# few sample outbox inserts, and what arrived in the queue. Everything is
# removed when it ends.
#
#   bash scripts/demo.sh                      # SNS (moto) -> SQS
#   bash scripts/demo.sh --sink sqs           # straight to a FIFO queue
#   bash scripts/demo.sh --sink eventbridge   # a bus, a rule, a queue behind it
#   bash scripts/demo.sh --sink kinesis       # a stream of two shards, read back
#   bash scripts/demo.sh --sink stdout        # the stdout sink instead (also --stdout)
#   bash scripts/demo.sh --sink webhook       # signed POSTs to a local receiver that
#                                             # verifies them (Standard Webhooks library)
# (scripts/demo_aws.py creates the AWS destinations and reads them back.)
set -euo pipefail
sink=sns
case "${1:-}" in
    --stdout) sink=stdout ;;
    --sink) sink=${2:?--sink needs sns, sqs, eventbridge, kinesis, stdout or webhook} ;;
    "") ;;
    *) echo "usage: $0 [--sink sns|sqs|eventbridge|kinesis|stdout|webhook]" >&2; exit 2 ;;
esac
aws=false
case "$sink" in
    sns | sqs | eventbridge | kinesis) aws=true ;;
    stdout | webhook) ;;
    *) echo "--sink: $sink is not one of sns, sqs, eventbridge, kinesis, stdout, webhook" >&2; exit 2 ;;
esac
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
moto_pid=""
receiver_pid=""
cleanup() {
    [ -n "$relay_pid" ] && kill "$relay_pid" 2>/dev/null || true
    [ -n "$receiver_pid" ] && kill "$receiver_pid" 2>/dev/null || true
    [ -n "$moto_pid" ] && kill "$moto_pid" 2>/dev/null || true
    bash scripts/pg-cluster.sh stop "$work/pg" >/dev/null 2>&1 || true
    rm -rf "$work"
}
trap cleanup EXIT

echo "== starting PostgreSQL (wal_level=logical)"
url=$(bash scripts/pg-cluster.sh start "$work/pg" | tail -n 1 | cut -d= -f2-)
app_url=${url%/postgres}/postgres
if $aws; then
    echo "== starting a local AWS endpoint (moto)"
    moto_port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    python3 -m moto.server -H 127.0.0.1 -p "$moto_port" > "$work/moto.log" 2>&1 &
    moto_pid=$!
    export AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1
    export MOTO_URL="http://127.0.0.1:$moto_port"
    python3 - <<'PY'
import os, time, urllib.request
for _ in range(200):
    try:
        urllib.request.urlopen(os.environ["MOTO_URL"], timeout=1); break
    except Exception:
        time.sleep(0.1)
PY
    echo "== creating the $sink destination"
    section=$(python3 scripts/demo_aws.py setup "$sink")
    cat > "$work/relay.toml" <<TOML
[postgres]
url = "$app_url"

[sink]
kind = "$sink"

$section

[http]
listen = ""
TOML
elif [ "$sink" = webhook ]; then
    echo "== starting a webhook receiver that verifies signatures (standardwebhooks)"
    export OUTBOX_RELAY__WEBHOOK__SECRET="whsec_$(python3 -c 'import base64, os; print(base64.b64encode(os.urandom(32)).decode())')"
    python3 tests/data/webhook_receiver.py "$OUTBOX_RELAY__WEBHOOK__SECRET" "$work/receiver.port" \
        "$work/requests.jsonl" "$work" 2> "$work/receiver.log" &
    receiver_pid=$!
    for _ in $(seq 100); do [ -s "$work/receiver.port" ] && break; sleep 0.1; done
    cat > "$work/relay.toml" <<TOML
[postgres]
url = "$app_url"

[sink]
kind = "webhook"

[webhook]
url = "http://127.0.0.1:$(cat "$work/receiver.port")/events"
# secret: from OUTBOX_RELAY__WEBHOOK__SECRET

[http]
listen = ""
TOML
else
    cat > "$work/relay.toml" <<TOML
[postgres]
url = "$app_url"

[sink]
kind = "stdout"

[http]
listen = ""
TOML
fi
echo "== config: $work/relay.toml"
sed 's/^/   /' "$work/relay.toml"

echo "== outbox-relay setup --apply (table, publication, slot, role)"
"$relay" --config "$work/relay.toml" setup --apply
echo "== outbox-relay check"
"$relay" --config "$work/relay.toml" check

echo "== outbox-relay run (sink: $sink; logs on stderr)"
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

if $aws; then
    echo "== what arrived ($sink):"
    python3 scripts/demo_aws.py show "$sink" 3
elif [ "$sink" = webhook ]; then
    for _ in $(seq 75); do
        [ -f "$work/requests.jsonl" ] && [ "$(wc -l < "$work/requests.jsonl")" -ge 3 ] && break
        sleep 0.2
    done
    echo "== what the receiver got (webhook-id, signature verified, answer, body):"
    python3 - "$work/requests.jsonl" <<'PY'
import json, sys
lines = open(sys.argv[1]).read().splitlines()
for line in lines:
    r = json.loads(line)
    print(f"-- webhook-id {r['id']}  verified {r['valid']}  answered {r['status']}")
    print(r["body"])
if len(lines) < 3 or not all(json.loads(l)["valid"] for l in lines):
    raise SystemExit("not every event arrived verified; see the relay log below")
PY
else
    for _ in $(seq 50); do
        [ "$(wc -l < "$work/envelopes.ndjson")" -ge 3 ] && break
        sleep 0.2
    done
    echo "== what the relay published:"
    cat "$work/envelopes.ndjson"
fi
kill -TERM "$relay_pid"; wait "$relay_pid" || true; relay_pid=""
echo "== relay log:"
sed 's/^/   /' "$work/relay.log"
echo "== the outbox rows are marked published:"
psql_ -c "select aggregate_id, event_type, publish_state, published_at is not null as published from outbox order by created_at"
echo "== the slot is confirmed up to the last commit:"
psql_ -c "select slot_name, confirmed_flush_lsn, pg_current_wal_lsn() as current_wal_lsn from pg_replication_slots"
