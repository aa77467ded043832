#!/usr/bin/env bash
# The project's test command: installs missing tools, builds the workspace,
# starts one ephemeral PostgreSQL cluster and one moto server (AWS mock)
# for the whole run and runs every test with cargo-nextest. Arguments go to
# `cargo nextest run` (filters etc.):
#
#   scripts/test.sh                       # everything
#   scripts/test.sh -p outbox-relay-tests # one package
#   scripts/test.sh -E 'test(restart)'    # a filter expression
#   PG_VERSION=18 scripts/test.sh         # on PostgreSQL 18 (14 to 18; default 15)
#
# PG_VERSION picks the major for the shared cluster and for every private
# cluster a test starts (PG_BIN, exported here, points the harness at the
# same binaries); scripts/pg-versions.sh says where each major comes from.
#
# Exits with the test result; the cluster and moto are always stopped and removed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

command -v cargo >/dev/null 2>&1 || . "$HOME/.cargo/env"

nextest_profile=()
if [ "${CI:-}" = true ]; then
    export CARGO_TERM_COLOR=never
    nextest_profile=(--profile ci)
fi
locked=()
[ -f Cargo.lock ] && locked=(--locked)

. scripts/pg-versions.sh
pg_major >/dev/null # refuse an unknown PG_VERSION before anything else
bash scripts/install-deps.sh
PG_BIN=$(pg_bin)
export PG_BIN

# The crate's wings: imports run downward, no cycle between files (docs/architecture.md).
python3 scripts/wings.py >/dev/null || { python3 scripts/wings.py; exit 1; }

cargo build --workspace --all-targets "${locked[@]}"

pg_dir=$(mktemp -d /tmp/outbox-relay-pg.XXXXXX)
moto_dir=$(mktemp -d /tmp/outbox-relay-moto.XXXXXX)
moto_pid=
cleanup() {
    if [ -n "$moto_pid" ]; then
        kill "$moto_pid" 2>/dev/null
        wait "$moto_pid" 2>/dev/null
    fi
    rm -rf -- "$moto_dir"
    bash scripts/pg-cluster.sh stop "$pg_dir"
}
# Keep the test result as exit status even if the teardown fails.
trap 'status=$?; cleanup || true; exit $status' EXIT
cluster_out=$(bash scripts/pg-cluster.sh start "$pg_dir")
echo "$cluster_out"
export "$(tail -n 1 <<<"$cluster_out")" # OUTBOX_RELAY_TEST_PG_URL=…

# One moto server (local AWS mock: SNS, SQS) for the run, on a free port; the
# tests take its endpoint from OUTBOX_RELAY_TEST_SNS_URL. Another process may
# take the port first: then retry with a new one.
start_moto() {
    local attempt port
    for attempt in 1 2 3; do
        port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
        # moto's server with two fixes the tests need (see the file).
        python3 tests/data/moto_server.py -H 127.0.0.1 -p "$port" >"$moto_dir/moto.log" 2>&1 </dev/null &
        moto_pid=$!
        for _ in $(seq 100); do # up to ~20 s
            kill -0 "$moto_pid" 2>/dev/null || break
            if python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
                "http://127.0.0.1:$port/" 2>/dev/null; then
                echo "test.sh: moto $(python3 -c 'import moto; print(moto.__version__)') on 127.0.0.1:$port"
                export OUTBOX_RELAY_TEST_SNS_URL="http://127.0.0.1:$port"
                return 0
            fi
            sleep 0.1
        done
        kill "$moto_pid" 2>/dev/null || true
        wait "$moto_pid" 2>/dev/null || true
        moto_pid=
        grep -q 'Address already in use' "$moto_dir/moto.log" || break
    done
    echo "test.sh: the moto server did not start; tail of its log:" >&2
    tail -n 40 "$moto_dir/moto.log" >&2
    return 1
}
start_moto
echo "OUTBOX_RELAY_TEST_SNS_URL=$OUTBOX_RELAY_TEST_SNS_URL"

cargo nextest run --workspace --no-fail-fast "${locked[@]}" "${nextest_profile[@]}" "$@"
