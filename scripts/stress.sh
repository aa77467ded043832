#!/usr/bin/env bash
# The stress test of the derived lifecycle at full length (docs/stress.md):
# installs what is missing, builds the relay and the stress driver in release
# mode, and runs it. Arguments go to the driver (defaults below: 300 s of
# writes, 32 writers, 6 kill -9 of the relay, 2 graceful stops (one longer
# than the grace), one immediate PostgreSQL restart; the e2e test `stress::`
# runs 60 s, 16 writers, 2 kills, 1 stop):
#
#   bash scripts/stress.sh                               # about 6 minutes in all
#   bash scripts/stress.sh --seconds 600 --writers 48 --kills 10 --stops 3 --pg-restart --require-derived
#   PG_VERSION=18 bash scripts/stress.sh
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
[ -x "$(command -v cargo)" ] || . "$HOME/.cargo/env"
. scripts/pg-versions.sh
pg_major >/dev/null
bash scripts/install-deps.sh
PG_BIN=$(pg_bin)
export PG_BIN
cargo build --release --quiet -p outbox-relay -p outbox-relay-tests --bin outbox-relay --bin stress
args=("$@")
[ ${#args[@]} -gt 0 ] || args=(--seconds 300 --writers 32 --kills 6 --stops 2 --pg-restart --require-derived)
target=${CARGO_TARGET_DIR:-$repo/target}
OUTBOX_RELAY_BIN="$target/release/outbox-relay" exec "$target/release/stress" "${args[@]}"
