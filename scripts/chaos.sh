#!/usr/bin/env bash
# The chaos run (docs/chaos.md): installs what is missing, builds the relay and
# the chaos driver in release mode, and runs it. The arguments go to the driver
# (tests/src/bin/chaos.rs): the seconds of faults (default 240), or its flags:
#
#   bash scripts/chaos.sh          # about 4.5 minutes in all
#   bash scripts/chaos.sh 180
#   bash scripts/chaos.sh --faults 10 --every-ms 100 --seconds 150   # as CI
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
[ -x "$(command -v cargo)" ] || . "$HOME/.cargo/env"
bash scripts/install-deps.sh
cargo build --release --quiet -p outbox-relay -p outbox-relay-tests --bin outbox-relay --bin chaos
OUTBOX_RELAY_BIN="$repo/target/release/outbox-relay" exec "$repo/target/release/chaos" "${@:-240}"
