#!/usr/bin/env bash
# The benchmarks (docs/benchmarks.md): installs what is missing, builds the
# relay and the bench in release mode, and runs both parts in one invocation.
# Arguments go to the bench, e.g.:
#
#   bash scripts/bench.sh                         # 1,000,000-row drain + steady state
#   bash scripts/bench.sh --rows 200000 --no-steady
#   bash scripts/bench.sh --no-drain --rates 1000,5000,max --seconds 20
#   bash scripts/bench.sh --no-drain --no-lifecycle --no-large --no-steady   # the quota list alone
#   bash scripts/bench.sh --no-drain --no-lifecycle --no-large --no-steady --quotas 3000 --quota-bursts 1
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$repo"
[ -x "$(command -v cargo)" ] || . "$HOME/.cargo/env"
bash scripts/install-deps.sh
cargo build --release --quiet -p outbox-relay -p outbox-relay-bench
exec "$repo/target/release/outbox-relay-bench" "$@"
