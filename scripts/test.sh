#!/usr/bin/env bash
# The project's test command: installs missing tools, builds the workspace,
# starts one ephemeral PostgreSQL 15 cluster for the whole run and runs every
# test with cargo-nextest. Arguments go to `cargo nextest run` (filters etc.):
#
#   scripts/test.sh                       # everything
#   scripts/test.sh -p outbox-relay-tests # one package
#   scripts/test.sh -E 'test(restart)'    # a filter expression
#
# Exits with the test result; the cluster is always stopped and removed.
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

bash scripts/install-deps.sh

cargo build --workspace --all-targets "${locked[@]}"

pg_dir=$(mktemp -d /tmp/outbox-relay-pg.XXXXXX)
# Keep the test result as exit status even if the teardown fails.
trap 'status=$?; bash scripts/pg-cluster.sh stop "$pg_dir" || true; exit $status' EXIT
cluster_out=$(bash scripts/pg-cluster.sh start "$pg_dir")
echo "$cluster_out"
export "$(tail -n 1 <<<"$cluster_out")" # OUTBOX_RELAY_TEST_PG_URL=…

cargo nextest run --workspace --no-fail-fast "${locked[@]}" "${nextest_profile[@]}" "$@"
