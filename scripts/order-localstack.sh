#!/usr/bin/env bash
# What order a consumer sees, per ordering group, at each AWS destination,
# measured against LocalStack 4.13.1 (a second AWS implementation besides moto),
# in-process, without Docker. For each destination and each pattern: its own
# outbox table, slot, publication and AWS resources; the relay running; 500
# events over 20 aggregates inserted in commit order (50 transactions of 10);
# everything the consumer receives read back (one SQS consumer receiving 10 at
# a time and deleting; or every Kinesis shard from TRIM_HORIZON); then one
# table: received, distinct, repeats, missing, groups whose first-seen order
# differs from commit order, adjacent inversions, rows marked PUBLISHED.
#
#   bash scripts/order-localstack.sh                            # everything (~3 min once built)
#   bash scripts/order-localstack.sh sns-standard eventbridge   # some destinations
#   ORDER_PATTERNS=runs bash scripts/order-localstack.sh        # one pattern
#   RELAY_BIN=/path/to/outbox-relay bash scripts/order-localstack.sh   # no build
#
# Destinations: sns-standard (topic -> queue, raw delivery), sns-fifo (FIFO
# topic -> FIFO queue), sqs-standard, sqs-fifo, eventbridge (bus -> rule ->
# queue), kinesis (2 shards). Patterns (ORDER_PATTERNS, default both):
# round-robin (event k in group k % 20: a group's events are 20 apart) and runs
# (5 events of a group in a row: several of a group in one transaction and batch).
#
# LocalStack goes into a venv (LOCALSTACK_VENV, default
# /opt/localstack-4.13.1-py<version>), installed once as DESIGN.md says, plus
# `crontab`, which its EventBridge imports. Its Kinesis needs Python 3.13 (its
# package code evaluates `threading.Lock | None`; taken from PATH or pyenv, or
# LOCALSTACK_PYTHON) and kinesis-mock, the npm package kinesis-local, installed
# here with npm into KINESIS_MOCK_DIR (default /opt/localstack-kinesis-mock) and
# linked into LocalStack's static libs, so LocalStack downloads nothing. Without
# Python 3.13, node or npm, kinesis is reported as not run. OVERRIDE_IN_DOCKER=0
# keeps LocalStack's files under FILESYSTEM_ROOT (in a container it would use
# /var/lib/localstack, /usr/lib/localstack and /tmp/localstack instead).
#
# After installing and building, the measurement runs in a network namespace
# of its own (unshare -n, loopback only) when it can, since LocalStack 4.13's
# gateway and kinesis-mock listen on every interface whatever GATEWAY_LISTEN
# says; ORDER_LOCALSTACK_NETNS=0 runs it in the host's. PG_VERSION picks the
# PostgreSQL major (scripts/pg-versions.sh). The relay, LocalStack (and what it
# started), the cluster and the work directory are removed at the end, also on
# failure or Ctrl-C.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
command -v cargo >/dev/null 2>&1 || . "$HOME/.cargo/env"

ALL="sns-standard sns-fifo sqs-standard sqs-fifo eventbridge kinesis"
EVENTS=500 NGROUPS=20 PER_TX=10
LS_VERSION=4.13.1
KINESIS_MOCK_VERSION=0.5.2 # what LocalStack 4.13.1 asks for

# -- Python for LocalStack: 3.13 when there is one (Kinesis needs it).
python_313() {
    local p
    for p in "${LOCALSTACK_PYTHON:-}" "$(command -v python3.13 || true)" \
        "$(pyenv root 2>/dev/null || true)"/versions/3.13*/bin/python3.13; do
        [ -n "$p" ] && [ -x "$p" ] && "$p" -c 'import sys; assert sys.version_info >= (3, 13)' 2>/dev/null \
            && { echo "$p"; return 0; }
    done
    return 1
}
# Install LocalStack (and kinesis-mock) if missing, build the relay, then
# measure in a network namespace.
prepare() {
kinesis_ok=""
if py=$(python_313); then
    kinesis_ok=yes
else
    py=${LOCALSTACK_PYTHON:-python3}
    kinesis_why="LocalStack's Kinesis needs Python 3.13 (threading.Lock | None); none found"
fi
py_version=$("$py" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
venv=${LOCALSTACK_VENV:-/opt/localstack-$LS_VERSION-py$py_version}

installed() {
    "$venv/bin/python" - "$LS_VERSION" 2>/dev/null <<'PY'
import importlib.metadata as m, sys
import boto3, crontab  # crontab: LocalStack's EventBridge imports it
assert m.version("localstack-core") == sys.argv[1]
PY
}
if ! installed; then
    echo "== installing LocalStack $LS_VERSION into $venv (Python $py_version)"
    "$py" -m venv "$venv"
    # As docs say (DESIGN.md, Dependencies); crontab: what EventBridge needs besides.
    "$venv/bin/pip" install -q "localstack-core[base-runtime]==$LS_VERSION" moto-ext 'cbor2<6' 'pyopenssl<25' \
        'cryptography<45' service_identity 'crontab>=0.22.6'
    installed || { echo "LocalStack did not install into $venv" >&2; exit 1; }
fi

mock_dir=${KINESIS_MOCK_DIR:-/opt/localstack-kinesis-mock}
mock_marker=$mock_dir/kinesis-local/$KINESIS_MOCK_VERSION/node_modules/kinesis-local/main.js
if [ -n "$kinesis_ok" ] && [ ! -f "$mock_marker" ]; then
    if command -v node >/dev/null && command -v npm >/dev/null; then
        echo "== installing kinesis-mock (npm kinesis-local@$KINESIS_MOCK_VERSION) into $mock_dir"
        npm install --silent --no-audit --no-fund --prefix "$mock_dir/kinesis-local/$KINESIS_MOCK_VERSION" \
            "kinesis-local@$KINESIS_MOCK_VERSION" || true
    fi
    [ -f "$mock_marker" ] || { kinesis_ok=""; kinesis_why="kinesis-mock (npm kinesis-local) could not be installed"; }
fi
if [ -z "$kinesis_ok" ] && [ -n "${kinesis_why:-}" ]; then
    echo "== kinesis will not run: $kinesis_why"
fi

if [ -n "${RELAY_BIN:-}" ]; then
    echo "== the relay: $RELAY_BIN (RELAY_BIN; not built)"
else
    echo "== building the relay (cargo build -p outbox-relay --release --locked)"
    cargo build -p outbox-relay --release --locked
fi
export ORDER_RELAY_BIN=${RELAY_BIN:-$repo/target/release/outbox-relay}
if [ -n "${RELAY_BIN:-}" ]; then
    export ORDER_RELAY_DESC="relay $RELAY_BIN"
else
    export ORDER_RELAY_DESC="relay built at $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- crates Cargo.lock || echo ' + uncommitted changes')"
fi

# The rest runs in a network namespace of its own with only loopback when it
# can (LocalStack 4.13's gateway and kinesis-mock listen on every interface
# whatever GATEWAY_LISTEN says): nothing in the run reaches or is reachable
# from another machine. ORDER_LOCALSTACK_NETNS=0 runs it in the host's.
export ORDER_VENV=$venv ORDER_PY_VERSION=$py_version ORDER_KINESIS_OK=$kinesis_ok \
    ORDER_KINESIS_WHY=${kinesis_why:-} ORDER_MOCK_DIR=$mock_dir
if [ "${ORDER_LOCALSTACK_NETNS:-1}" != 0 ] && command -v unshare >/dev/null && command -v ip >/dev/null \
    && unshare -n true 2>/dev/null; then
    exec unshare -n -- bash "$repo/scripts/order-localstack.sh" --measure $dests
fi
echo "== (no network namespace: LocalStack listens on every interface)"
exec bash "$repo/scripts/order-localstack.sh" --measure $dests
}

measure() {
dests=$*
patterns=${ORDER_PATTERNS:-round-robin runs}
venv=$ORDER_VENV py_version=$ORDER_PY_VERSION kinesis_ok=$ORDER_KINESIS_OK kinesis_why=$ORDER_KINESIS_WHY
mock_dir=$ORDER_MOCK_DIR
ip link set lo up 2>/dev/null || true
relay_bin=$ORDER_RELAY_BIN

. scripts/pg-versions.sh
PG_BIN=$(pg_bin)

work=$(mktemp -d /tmp/outbox-relay-order.XXXXXX)
chmod 755 "$work" # the postgres user must reach the cluster dir inside
relay_pid="" ls_pid="" ls_children=""
stop_relay() {
    if [ -n "$relay_pid" ]; then
        kill -TERM "$relay_pid" 2>/dev/null || true
        for _ in $(seq 100); do kill -0 "$relay_pid" 2>/dev/null || break; sleep 0.1; done
        kill -KILL "$relay_pid" 2>/dev/null || true
        wait "$relay_pid" 2>/dev/null || true
        relay_pid=""
    fi
}
descendants() {
    local child
    for child in $(pgrep -P "$1" 2>/dev/null); do echo "$child"; descendants "$child"; done
}
stop_localstack() {
    [ -n "$ls_pid" ] || return 0
    # LocalStack runs in its own process group; kinesis-mock (node) in a session of its own.
    ls_children=$(descendants "$ls_pid")
    kill -TERM -- "-$ls_pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$ls_pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$ls_pid" 2>/dev/null || true
    # shellcheck disable=SC2086
    [ -z "$ls_children" ] || kill -KILL $ls_children 2>/dev/null || true
    wait "$ls_pid" 2>/dev/null || true
    ls_pid=""
}
cleanup() {
    stop_relay
    stop_localstack
    bash scripts/pg-cluster.sh stop "$work/pg" >/dev/null 2>&1 || true
    rm -rf -- "$work"
}
trap 'status=$?; cleanup; exit $status' EXIT
trap 'exit 130' INT TERM

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

echo "== starting PostgreSQL"
url=$(bash scripts/pg-cluster.sh start "$work/pg" | tail -n 1 | cut -d= -f2-)
psql_() { PGPASSWORD=postgres "$PG_BIN/psql" "$url" -X -q -v ON_ERROR_STOP=1 "$@"; }

echo "== starting LocalStack $LS_VERSION in-process"
ls_root="$work/localstack"
mkdir -p "$ls_root/usr/lib/localstack"
[ -n "$kinesis_ok" ] && ln -s "$mock_dir/kinesis-local" "$ls_root/usr/lib/localstack/kinesis-local"
services=sns,sqs,events
[ -n "$kinesis_ok" ] && services=$services,kinesis
for attempt in 1 2 3; do
    port=$(free_port)
    (
        cd "$ls_root"
        export SERVICES=$services GATEWAY_LISTEN=127.0.0.1:$port LOCALSTACK_HOST=127.0.0.1:$port \
            SKIP_INFRA_DOWNLOADS=1 SKIP_SSL_CERT_DOWNLOAD=1 DISABLE_EVENTS=1 FILESYSTEM_ROOT=$ls_root \
            DNS_ADDRESS=0 SQS_ENDPOINT_STRATEGY=off KINESIS_MOCK_PROVIDER_ENGINE=node \
            OVERRIDE_IN_DOCKER=0 KINESIS_PERSISTENCE=0 PERSISTENCE=0
        exec setsid "$venv/bin/python" -m localstack.runtime.main
    ) >"$work/localstack.log" 2>&1 </dev/null &
    ls_pid=$!
    for _ in $(seq 120); do
        kill -0 "$ls_pid" 2>/dev/null || break
        curl -sf "http://127.0.0.1:$port/_localstack/health" >/dev/null 2>&1 && break
        sleep 0.5
    done
    curl -sf "http://127.0.0.1:$port/_localstack/health" >/dev/null 2>&1 && break
    kill -TERM -- "-$ls_pid" 2>/dev/null || true
    wait "$ls_pid" 2>/dev/null || true
    ls_pid=""
    grep -q 'already in use' "$work/localstack.log" || break
done
[ -n "$ls_pid" ] || { echo "LocalStack did not start; its log:" >&2; tail -n 40 "$work/localstack.log" >&2; exit 1; }
export LS_URL="http://127.0.0.1:$port" AWS_ACCESS_KEY_ID=test AWS_SECRET_ACCESS_KEY=test AWS_REGION=us-east-1
echo "   $(curl -s "$LS_URL/_localstack/health" | "$venv/bin/python" -c 'import json, sys; h = json.load(sys.stdin); print("LocalStack", h["version"], {k: v for k, v in h["services"].items() if v != "disabled"})')"
driver() { "$venv/bin/python" scripts/order_localstack.py "$@"; }

results=()
for pattern in $patterns; do
for dest in $dests; do
    id=${dest//-/_}_${pattern//-/_}
    out="$work/$id.json"
    results+=("$out")
    echo "== $dest, pattern $pattern"
    if [ "$dest" = kinesis ] && [ -z "$kinesis_ok" ]; then
        printf '{"destination": "%s", "pattern": "%s", "skipped": "%s"}\n' "$dest" "$pattern" "$kinesis_why" > "$out"
        echo "   not run: $kinesis_why"
        continue
    fi
    if ! section=$(driver setup "$dest" "$pattern" 2>"$work/$id.setup.log"); then
        why=$(tail -n 1 "$work/$id.setup.log" | tr -d '"\\' | cut -c1-200)
        printf '{"destination": "%s", "pattern": "%s", "skipped": "LocalStack refused the setup: %s"}\n' "$dest" "$pattern" "$why" > "$out"
        echo "   not run: $why"
        continue
    fi
    cat > "$work/$id.toml" <<TOML
[postgres]
url = "$url"
table = "public.order_$id"
slot = "order_$id"
publication = "order_$id"

$section

[http]
listen = ""
TOML
    "$relay_bin" --config "$work/$id.toml" setup --apply 2>"$work/$id.relay-setup.log" \
        || { cat "$work/$id.relay-setup.log" >&2; exit 1; }
    "$relay_bin" --config "$work/$id.toml" run >/dev/null 2>"$work/$id.relay.log" &
    relay_pid=$!
    for _ in $(seq 100); do
        [ "$(psql_ -At -c "select active from pg_replication_slots where slot_name = 'order_$id'")" = t ] && break
        kill -0 "$relay_pid" 2>/dev/null || { echo "the relay stopped; its log:" >&2; tail -n 30 "$work/$id.relay.log" >&2; exit 1; }
        sleep 0.2
    done
    driver sql "public.order_$id" "$EVENTS" "$NGROUPS" "$PER_TX" "$pattern" | psql_
    driver read "$dest" "$pattern" "$EVENTS" "$out" >/dev/null
    published=0
    for _ in $(seq 50); do
        published=$(psql_ -At -c "select count(*) from public.order_$id where publish_state = 'PUBLISHED'")
        [ "$published" -ge "$EVENTS" ] && break
        sleep 0.2
    done
    stop_relay
    "$venv/bin/python" - "$out" "$published" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r["published"] = int(sys.argv[2])
json.dump(r, open(sys.argv[1], "w"))
print(f"   received {r['received']}, distinct {r['distinct']}, repeats {r['repeats']}, missing {r['missing']}, "
      f"groups out of order {r['groups_out_of_order']} of {r['groups']}, rows PUBLISHED {r['published']}")
PY
    grep -E '"level":"(WARN|ERROR)"| (WARN|ERROR) ' "$work/$id.relay.log" | head -n 3 | cut -c1-300 | sed 's/^/   relay: /' || true
done
done

echo
echo "Order as consumers see it: LocalStack $LS_VERSION (in-process, Python $py_version), PostgreSQL" \
    "$(psql_ -At -c 'show server_version'), $EVENTS events over $NGROUPS groups, $((EVENTS / PER_TX)) transactions of $PER_TX, $ORDER_RELAY_DESC"
echo
driver table "${results[@]}"
}

if [ "${1:-}" = --measure ]; then
    shift
    measure "$@"
    exit
fi
dests=${*:-$ALL}
for d in $dests; do
    case " $ALL " in *" $d "*) ;; *) echo "unknown destination $d (one of: $ALL)" >&2; exit 2 ;; esac
done
for p in ${ORDER_PATTERNS:-round-robin runs}; do
    case $p in round-robin | runs) ;; *) echo "unknown pattern $p in ORDER_PATTERNS (round-robin, runs)" >&2; exit 2 ;; esac
done
prepare
